"""From a model source to a ready engine: the model (engine/model_loading.py), the other ranks of a
parallel replica (engine/lockstep.py), and the engine around them."""

from __future__ import annotations

import logging
from pathlib import Path

from flagdeploy import ops, parallel
from flagdeploy.checkpoints import safetensors_reader
from flagdeploy.models import media_processor

from . import lockstep
from .llm_engine import EngineConfig, LLMEngine
from .model_loading import (
    check_source,
    check_split,
    init_dummy_weights,
    load_model,
    read_model_config,
)
from .nodes import NodeGroup

__all__ = ["build_llm_engine", "check_source", "check_split", "init_dummy_weights", "load_model", "read_model_config"]

log = logging.getLogger(__name__)


def build_llm_engine(path: Path, fmt: str, config: EngineConfig | None = None, chip: str | None = None,
                     progress: bool = True, nodes: NodeGroup | None = None) -> LLMEngine:
    """The engine of one replica; with config.tp * config.ep > 1 this process becomes rank 0 of it and
    starts the other ranks of its node (flagdeploy/engine/lockstep.py); `nodes`: the machines the ranks
    spread over, when more than this one (flagdeploy/engine/nodes.py)."""
    config = config or EngineConfig()
    backend = ops.use_backend(chip)
    config.device = backend.device_type
    mtp = config.speculative is not None and config.speculative.method == "mtp"
    workers = None
    if config.tp * config.ep > 1:
        check_split(path, fmt, config)
        workers = lockstep.start(path, fmt, config, chip, nodes)
    try:
        model, tokenizer = load_model(path, fmt, config.dtype, config.device, progress, config.weight_format,
                                      config.load_format, mtp, config.q8_activations)
        if workers is not None:
            workers.wait("loaded")
    except BaseException:
        if workers is not None:
            workers.close(force=True)
            parallel.shutdown()
        raise
    if config.max_model_len > model.cfg.max_position_embeddings:
        log.warning("--max-model-len %d exceeds the model's trained context %d; capping",
                    config.max_model_len, model.cfg.max_position_embeddings)
        config.max_model_len = model.cfg.max_position_embeddings
    model.prepare(config.max_model_len)
    engine = LLMEngine(model, tokenizer, config, workers)
    if fmt == "safetensors":  # a model with a vision encoder: its processor, for the server to prepare media
        engine.media_processor = media_processor(model, path, safetensors_reader.raw_config(path))
    return engine
