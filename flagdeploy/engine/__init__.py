"""The builtin engine: scheduler, paged KV cache with prefix caching, model runner, async front."""

from __future__ import annotations

from .async_engine import AsyncEngine
from .llm_engine import EngineConfig, LLMEngine
from .request import RequestOutput, SamplingParams


def build_engine(model: str | None = None, *, chip: str | None = None, progress: bool = False, **options) -> AsyncEngine:
    """Resolve `model` (None: the embedded default), load it and start the engine loop.

    `options` are EngineConfig fields (max_model_len, max_num_seqs, kv_cache_memory, ...).
    """
    from flagdeploy.checkpoints.source import resolve

    from .replica import build_llm_engine

    src = resolve(model, weights=options.get("load_format", "auto") != "dummy")
    return AsyncEngine(build_llm_engine(src.path, src.format, EngineConfig(**options), chip=chip, progress=progress))


__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "build_engine"]
