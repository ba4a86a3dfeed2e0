"""From a model source to a model with its weights and its tokenizer: read the config, build the model,
stream the weights in. No engine here: the ranks of a parallel replica (engine/lockstep.py) load their
shard through this module, and the engine is assembled around the model in engine/replica.py."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from flagdeploy import ops, parallel
from flagdeploy.errors import ModelLoadError
from flagdeploy.checkpoints import gguf_reader, safetensors_reader
from flagdeploy.models import build_model, load_weights
from flagdeploy.models.linear import Linear
from flagdeploy.ops.weights import to_device
from flagdeploy.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_model(path: Path, fmt: str, dtype: torch.dtype, device: str, progress: bool = True,
               weight_format: str = "dense", load_format: str = "auto", mtp: bool = False, q8_activations: bool = False):
    """(model, tokenizer) from a .gguf file or an HF safetensors directory.

    weight_format "dense" dequantises everything to `dtype`. "auto" keeps a GGUF's 4-bit linears
    as int4 and stores the LM head as int8 where the backend has kernels for them, and its other quantized
    linears (a Q4_K_M file's Q6_K, Q5_0, Q8_0) as int8 where those kernels read int8 (`Backend.packed_weights`;
    on the CPU that is what makes decoding fast: the step reads 1/8 to 1/4 of the bytes), keeps FP8 block-scaled linears FP8
    where the backend runs `linear_fp8_block`, and in a float32 run keeps expert banks that are exactly
    bfloat16 (a BF16 checkpoint's) bfloat16 where the backend declares bf16 matmuls at full speed in a
    float32 step (`Backend.narrow_weight_dtypes`: the experts are most of a MoE decode step's bytes);
    elsewhere it falls back to dense.
    load_format "dummy" reads only the config and makes random weights of the right shapes, so that
    real shapes can be run and measured without a checkpoint.
    mtp: also build and load the checkpoint's multi-token-prediction draft layer (`--speculative mtp`);
    a model or checkpoint without one is refused before any weight is read.
    q8_activations: the quantized linears take their activations at llama.cpp's precision where the backend's
    kernels hold them finer (`Backend.q8_activations`); a warning where no linear can.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', not {load_format!r}")
    if weight_format not in ("auto", "dense"):
        raise ValueError(f"weight_format must be 'auto' or 'dense', not {weight_format!r}")
    be = ops.active_backend()
    keep_int4 = weight_format == "auto" and "linear_w4a16" in be.overrides
    quantize_head = keep_int4 and fmt == "gguf" and "linear_w8a16" in be.overrides
    keep_int8 = quantize_head and "linear_w8a16" in be.packed_weights  # the wider types read as int8, not dense
    keep_fp8 = weight_format == "auto" and "linear_fp8_block" in be.overrides  # FP8 matmul units run FP8 as stored
    # a float32 run whose matmuls take bf16 at full speed (the CPU's AMX): a BF16 checkpoint's experts stay bf16
    bf16_experts = weight_format == "auto" and dtype == torch.float32 and "bfloat16" in be.narrow_weight_dtypes
    cfg = read_model_config(path, fmt)
    head_int8 = keep_int8 and fmt == "gguf" and be.int8_low_bits() and gguf_reader.head_as_stored(gguf_reader.open_gguf(path))
    if head_int8:  # a head of its own, as the file holds it (a tied one also stays the embedding, for the lookups)
        cfg.tie_word_embeddings = False
    model = build_model(cfg, dtype, device)
    if mtp:
        _attach_mtp(model, path, fmt, load_format)
    tokenizer = Tokenizer.from_source(path, fmt, extra_eos_ids=cfg.eos_token_ids)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        if fmt == "gguf":
            reader = gguf_reader.open_gguf(path)
            tensors, total = gguf_reader.iter_tensors(reader, cfg, dtype, keep_int4, keep_int8, head_int8), len(reader.tensors)
        else:
            # under TP/EP each rank reads only its slices (and skips experts it does not hold)
            plan = getattr(model, "read_plan", None) if parallel.tp_size() * parallel.ep_size() > 1 else None
            tensors, total = safetensors_reader.iter_tensors(path, dtype, plan), safetensors_reader.count_tensors(path)
        bar = tqdm(tensors, total=total, desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False)
        try:
            load_weights(model, ((n, to_device(t, device)) for n, t in bar), quantize_head, keep_fp8, bf16_experts)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}. The file does not match its own config; re-download it.") from exc
    if q8_activations:
        _q8_activations(model, be)
    return model, tokenizer


def _q8_activations(model, be) -> None:
    """--q8-activations on a loaded model: the backend's linears that hold activations finer take llama.cpp's Q8."""
    count = be.q8_activations(model) if be.q8_activations is not None else 0
    if count:
        log.info("%d quantized weights take their activations as one int8 a value (--q8-activations)", count)
    else:
        log.warning("--q8-activations changes nothing here: no linear runs on a kernel with finer activations (the %s "
                    "backend's own int4 and int8 kernels, on a GGUF's quantized weights with --weight-format auto)", be.name)


def _attach_mtp(model, path: Path, fmt: str, load_format: str) -> None:
    """Give `model` its MTP draft layer, checking first that the checkpoint ships it."""
    attach = getattr(model, "attach_mtp", None)
    if attach is None:
        raise ModelLoadError(f"--speculative mtp drafts with the checkpoint's own multi-token-prediction layer; "
                             f"{type(model).__name__} ({model.cfg.architecture}) has none here (GLM-5.3-Flash, "
                             "glm5_next, has one). Serve with --speculative ngram or off.")
    names = None
    if load_format != "dummy":
        names = safetensors_reader.tensor_names(path) if fmt == "safetensors" else []
    attach(names)


def read_model_config(path: Path, fmt: str):
    if fmt == "gguf":
        return gguf_reader.read_config(gguf_reader.open_gguf(path))
    if fmt == "safetensors":
        return safetensors_reader.read_config(path)
    raise ModelLoadError(f"unknown model format {fmt!r}; expected 'gguf' or 'safetensors'")


def check_source(path: Path, fmt: str, weights: bool = True) -> None:
    """Cheap validation before a server starts: the header/config parses and names a supported model."""
    if fmt == "gguf":
        gguf_reader.read_config(gguf_reader.open_gguf(path))
    else:
        safetensors_reader.read_config(path)
        if weights:
            safetensors_reader.shard_files(path)


def init_dummy_weights(model, seed: int = 0) -> None:
    """Random weights for every parameter and linear (norm scales at 1, the rest N(0, 0.02^2)):
    enough for the activations to stay finite, which is all a speed measurement needs."""
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU (same weights on every device), then moved
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02)
        device = next(model.parameters()).device
        for m in model.modules():
            if isinstance(m, Linear):
                m.init_random(gen, device=device)
    if getattr(model.cfg, "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens


def check_split(path: Path, fmt: str, config) -> None:
    """Refuse the tp / ep split of `config` (an EngineConfig) the model cannot take before any worker
    starts: build the last rank's shard on the meta device (no memory, same constructor checks as the real ranks)."""
    cfg = read_model_config(path, fmt)
    with parallel.simulated(parallel.ParallelConfig(config.tp, config.ep)):
        try:
            build_model(cfg, config.dtype, "meta")
        except ValueError as exc:
            raise ModelLoadError(f"{path.name} cannot be split with --tp {config.tp} --ep {config.ep}: {exc}") from None
