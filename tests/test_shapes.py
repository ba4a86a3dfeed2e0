"""`planner.shapes` counts what transformers builds from the same config, exactly.

Every model is built by transformers on the meta device (no memory, no weights). The reference count is
its parameters (tied weights once, as `parameters()` yields them) plus its persistent buffers: a checkpoint
stores those too, and GLM-5.3-Flash's router `e_score_correction_bias` is one (an `nn.Buffer` in
transformers, a tensor in the shards). The llama-family models have no persistent buffer, so for them the
reference is exactly `parameters()`.
"""

from __future__ import annotations

from math import prod

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from flagdeploy.checkpoints.tiny_checkpoint import _config
from flagdeploy.planner.shapes import checkpoint_tensors, parameter_count

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CONFIGS = {
    "llama_untied_bias": dict(SMALL, model_type="llama", attention_bias=True, mlp_bias=True, head_dim=16,
                              tie_word_embeddings=False),
    "llama_tied": dict(SMALL, model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(SMALL, model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(SMALL, model_type="qwen3", head_dim=12, tie_word_embeddings=True),
    "qwen2_moe": dict(SMALL, **MOE, model_type="qwen2_moe", num_hidden_layers=5, shared_expert_intermediate_size=24,
                      decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=False),
    "qwen3_moe": dict(SMALL, **MOE, model_type="qwen3_moe", num_hidden_layers=4, head_dim=8, mlp_only_layers=[0, 2],
                      tie_word_embeddings=False),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
}


def _reference(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, persistent buffers) of a transformers model; tied parameters once."""
    params = sum(p.numel() for p in model.parameters())
    param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = sum(t.numel() for n, t in model.state_dict().items() if n not in param_names)
    return params, buffers


def _hf(cfg: dict):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


def _glm5(cfg: dict):
    with torch.device("meta"):
        return transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**cfg))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_family_count_matches_transformers(name):
    cfg = CONFIGS[name]
    params, buffers = _reference(_hf(cfg))
    assert buffers == 0
    assert parameter_count(cfg) == params


@pytest.mark.parametrize("name", ["llama_untied_bias", "llama_tied"])
def test_llama_names_and_shapes_match_state_dict(name):
    cfg = CONFIGS[name]
    expected = {n: tuple(t.shape) for n, t in _hf(cfg).state_dict().items()}
    if cfg["tie_word_embeddings"]:  # the state dict lists the tied head; the checkpoint does not store it
        del expected["lm_head.weight"]
    ours = checkpoint_tensors(cfg)
    assert len(ours) == len(dict(ours)) and dict(ours) == expected


def _glm5_check(cfg: dict) -> None:
    model = _glm5(cfg)
    params, buffers = _reference(model)
    text = model.config.text_config
    n_sparse = text.mlp_layer_types.count("sparse")
    assert buffers == n_sparse * text.n_routed_experts  # the e_score_correction_bias of each MoE layer
    assert parameter_count(cfg) == params + buffers
    vision = {n: tuple(t.shape) for n, t in model.state_dict().items() if n.startswith("model.visual.")}
    assert {n: s for n, s in checkpoint_tensors(cfg) if n.startswith("model.visual.")} == vision


def test_glm5_next_tiny_count_matches_transformers():
    _glm5_check(_config(False, (16, 16), {}))


def test_glm5_next_default_count_matches_transformers():
    """transformers' default Glm5NextConfig (GLM-5.3-Flash sizes, ~314B without MTP)."""
    _glm5_check(transformers.Glm5NextConfig().to_dict())


def test_glm5_next_mtp_layer():
    cfg = _config(False, (16, 16), {})
    n, h = cfg["text_config"]["num_hidden_layers"], cfg["text_config"]["hidden_size"]
    base, mtp = checkpoint_tensors(cfg), checkpoint_tensors(cfg, include_mtp=True)
    extra = mtp[len(base):]
    assert mtp[:len(base)] == base
    assert all(name.startswith(f"model.language_model.layers.{n}.") for name, _ in extra)
    # an MLA + full-indexer + MoE layer without mHC weights (the layout that matches the published bytes)
    t = cfg["text_config"]
    like = max(i for i in range(n) if t["layer_types"][i] == "indexed_attention" and t["indexer_types"][i] == "full"
               and t["mlp_layer_types"][i] == "sparse")
    layer = sum(prod(s) for name, s in base if name.startswith(f"model.language_model.layers.{like}.") and ".hc_" not in name)
    assert parameter_count(cfg, include_mtp=True) - parameter_count(cfg) == layer + 2 * h * h + 3 * h
    assert not any(".hc_" in name for name, _ in extra)
    assert dict(extra)[f"model.language_model.layers.{n}.eh_proj.weight"] == (h, 2 * h)


def test_unsupported_model_type():
    with pytest.raises(ValueError, match="gpt2.*supported: .*llama"):
        checkpoint_tensors({"model_type": "gpt2"})
