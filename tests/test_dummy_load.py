"""--load-format dummy: a directory with only config.json and a tokenizer runs with random weights."""

from __future__ import annotations

import json

import pytest
import torch

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.source import ModelSourceError, resolve
from flagdeploy.checkpoints.tiny_checkpoint import TINY_TEXT, TINY_VISION, write_word_tokenizer

CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True},
    "glm5_next": {"model_type": "glm5_next", "text_config": TINY_TEXT, "vision_config": TINY_VISION},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_config_only_directory_runs_with_random_weights(tmp_path, family):
    cfg = CONFIGS[family]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(tmp_path, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    with pytest.raises(ModelSourceError, match="safetensors"):
        resolve(str(tmp_path))  # a real load needs the weights
    src = resolve(str(tmp_path), weights=False)
    engine = build_llm_engine(src.path, src.format, EngineConfig(max_model_len=64, load_format="dummy"),
                              chip="cpu", progress=False)
    out = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o) for o in out] == [4, 4]
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
