"""The model facts the runtime needs, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagdeploy.errors import ModelLoadError


@dataclass
class ModelConfig:
    architecture: str  # the family in flagdeploy.models: "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    source_model_type: str = ""


# HF model_type → our family. The llama family covers every model whose decoder is GQA + RoPE +
# RMSNorm + SwiGLU; the differences (qkv bias, tying) are config fields, not new code.
HF_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama"}


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type", "")
    family = HF_FAMILIES.get(model_type)
    if family is None:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported by the builtin engine yet (supported: "
            f"{', '.join(HF_FAMILIES)}). Serve it with an external engine, or "
            f"pick a model of a supported family."
        )
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelLoadError(f"rope scaling {rope_type!r} is not supported yet by the builtin llama family.")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    theta = cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))
    return ModelConfig(
        architecture=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        bos_token_id=cfg.get("bos_token_id"),
        source_model_type=model_type,
    )
