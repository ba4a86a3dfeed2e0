"""From a model source to a ready engine: read config, build the model, stream weights in, tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from flagdeploy import ops
from flagdeploy.errors import ModelLoadError
from flagdeploy.loaders import gguf_reader, safetensors_reader
from flagdeploy.models import build_model, load_weights
from flagdeploy.tokenizer import Tokenizer

from .llm_engine import EngineConfig, LLMEngine

log = logging.getLogger(__name__)


def load_model(path: Path, fmt: str, dtype: torch.dtype, device: str, progress: bool = True,
               weight_format: str = "dense"):
    """(model, tokenizer) from a .gguf file or an HF safetensors directory.

    weight_format "dense" dequantises everything to `dtype`. "auto" keeps a GGUF's 4-bit linears
    as int4 and stores the LM head as int8 where the backend has kernels for them (on the CPU that is
    what makes decoding fast: the step reads 1/8 of the bytes); elsewhere it falls back to dense.
    """
    be = ops.active_backend()
    if weight_format not in ("auto", "dense"):
        raise ValueError(f"weight_format must be 'auto' or 'dense', not {weight_format!r}")
    keep_int4 = weight_format == "auto" and "linear_w4a16" in be.overrides
    quantize_head = keep_int4 and fmt == "gguf" and "linear_w8a16" in be.overrides
    if fmt == "gguf":
        reader = gguf_reader.open_gguf(path)
        cfg = gguf_reader.read_config(reader)
        tensors, total = gguf_reader.iter_tensors(reader, cfg, dtype, keep_int4), len(reader.tensors)
    elif fmt == "safetensors":
        cfg = safetensors_reader.read_config(path)
        tensors, total = safetensors_reader.iter_tensors(path, dtype), safetensors_reader.count_tensors(path)
    else:
        raise ModelLoadError(f"unknown model format {fmt!r}; expected 'gguf' or 'safetensors'")
    model = build_model(cfg, dtype, device)
    bar = tqdm(tensors, total=total, desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False)
    try:
        load_weights(model, ((n, t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in bar), quantize_head)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}. The file does not match its own config; re-download it.") from exc
    tokenizer = Tokenizer.from_source(path, fmt, extra_eos_ids=cfg.eos_token_ids)
    return model, tokenizer


def build_llm_engine(path: Path, fmt: str, config: EngineConfig | None = None, chip: str | None = None,
                     progress: bool = True) -> LLMEngine:
    config = config or EngineConfig()
    backend = ops.use_backend(chip)
    config.device = backend.device_type
    model, tokenizer = load_model(path, fmt, config.dtype, config.device, progress, config.weight_format)
    if config.max_model_len > model.cfg.max_position_embeddings:
        log.warning("--max-model-len %d exceeds the model's trained context %d; capping",
                    config.max_model_len, model.cfg.max_position_embeddings)
        config.max_model_len = model.cfg.max_position_embeddings
    model.prepare(config.max_model_len)
    return LLMEngine(model, tokenizer, config)


def check_source(path: Path, fmt: str) -> None:
    """Cheap validation before a server starts: the header/config parses and names a supported model."""
    if fmt == "gguf":
        gguf_reader.read_config(gguf_reader.open_gguf(path))
    else:
        safetensors_reader.read_config(path)
        safetensors_reader.shard_files(path)
