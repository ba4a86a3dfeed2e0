"""glm5_next's text-model config: `Glm5Config` and `from_hf_config`, which reads an HF config dict with
transformers' defaults, schedules and checks. Apart because everything else is built from it and it
needs nothing of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagdeploy.errors import ModelLoadError


@dataclass
class Glm5Config:
    """The text-model facts, with transformers' defaults (GLM-5.3-Flash) for anything a config omits."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_layers: int = 45
    num_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    indexer_types: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = "glm5_next"
    # FP8 checkpoints: (rows, cols) of the blocks sharing one `weight_scale_inv` entry; None if not FP8
    fp8_block: tuple[int, int] | None = None
    # multi-token-prediction draft layers the checkpoint ships (at layers.{num_layers}.*); None: not stated
    num_nextn_predict_layers: int | None = None
    # the checkpoint's `vision_config` (a Glm5NextForConditionalGeneration): the model builds its vision
    # tower from it (vision.Glm5VisionConfig.from_hf); None: a text-only checkpoint
    vision: dict[str, Any] | None = None


# the multimodal token ids a Glm5NextConfig states at its top level, with transformers' defaults (for
# configs written without them; the media processor reads them)
MM_TOKEN_IDS = {"image_token_id": 154854, "video_token_id": 154855, "image_start_token_id": 154830,
                "image_end_token_id": 154831, "video_start_token_id": 154832, "video_end_token_id": 154833}

# HF text-config key → our field, where the names differ.
_RENAMED = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}


def _text_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text part of a `glm5_next` (nested or flat) or `glm5_next_text` config dict."""
    model_type = cfg.get("model_type", "glm5_next")
    if model_type not in ("glm5_next", "glm5_next_text"):
        raise ModelLoadError(f"expected a glm5_next config, got model_type {model_type!r}")
    if model_type == "glm5_next" and cfg.get("text_config") is not None:
        return dict(cfg["text_config"])
    return dict(cfg)  # flat text-only checkpoints keep the text fields at the top level (as transformers reads them)


def from_hf_config(cfg: dict[str, Any]) -> Glm5Config:
    """Our config from an HF config dict: transformers' defaults, schedules and checks, same messages.

    Rejects what transformers' `validate_architecture` rejects, plus what its forward would fail on
    later (a "shared" indexer layer not directly after a "full" indexed layer; a non-SiLU activation).
    """
    t = _text_fields(cfg)
    out = Glm5Config()
    for key, value in t.items():
        name = _RENAMED.get(key, key)
        if name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_ids", "architecture"):
            continue
        if hasattr(out, name) and value is not None:
            setattr(out, name, value)
    if "linear_lower_bound" in t:
        out.linear_lower_bound = t["linear_lower_bound"]
    n = out.num_layers
    kv_heads = t.get("num_key_value_heads") or out.num_heads
    if (lin := t.get("linear_attn_config")) is not None:
        out.linear_head_dim = lin.get("head_dim", out.linear_head_dim)
        out.linear_num_heads = lin.get("num_heads", out.linear_num_heads)
        out.linear_conv_kernel_dim = lin.get("short_conv_kernel_size", out.linear_conv_kernel_dim)
        out.linear_lower_bound = lin.get("gate_lower_bound", out.linear_lower_bound)
        if lin.get("safe_gate", True) and out.linear_lower_bound is None:
            out.linear_lower_bound = -5.0
    out.mlp_layer_types = list(t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0))
    layer_types = t.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    out.layer_types = ["indexed_attention" if lt == "full_attention" else lt for lt in layer_types]
    out.indexer_types = list(t.get("indexer_types") or _indexer_schedule(t, n))
    eos = t.get("eos_token_id", cfg.get("eos_token_id"))
    out.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
    out.bos_token_id = t.get("bos_token_id", cfg.get("bos_token_id"))
    if out.num_nextn_predict_layers is None and cfg.get("num_nextn_predict_layers") is not None:
        out.num_nextn_predict_layers = cfg["num_nextn_predict_layers"]  # stated beside text_config
    if cfg.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in t:
        out.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
    if cfg.get("model_type", "glm5_next") == "glm5_next" and cfg.get("vision_config") is not None:
        out.vision = dict(cfg["vision_config"])
    quant = cfg.get("quantization_config") or t.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" or quant.get("weight_block_size"):  # FP8 as published, or kept by quantize
        out.fp8_block = tuple(quant.get("weight_block_size") or (128, 128))  # type: ignore[assignment]
    _validate(out, kv_heads, t.get("qk_rope_head_dim", 0), t.get("q_lora_rank", 1), t.get("hidden_act", "silu"))
    return out


def _indexer_schedule(t: dict[str, Any], n: int) -> list[str]:
    """transformers' default: an explicit "FS..." pattern, else "full" every `index_topk_freq` layers."""
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(t.get("index_topk_freq", 1), 1), t.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _validate(c: Glm5Config, kv_heads: int, rope_dim: int, q_lora_rank, act: str) -> None:
    def bad(msg: str) -> None:
        raise ModelLoadError(msg)

    # transformers' validate_architecture, same wording
    if c.num_heads != kv_heads:
        bad(f"num_attention_heads ({c.num_heads}) must be the same as num_key_value_heads ({kv_heads}).")
    if c.index_kpool < 1:
        bad(f"index_kpool must be positive, got {c.index_kpool}.")
    if c.index_topk % c.index_kpool != 0:
        bad(f"index_topk ({c.index_topk}) must be divisible by index_kpool ({c.index_kpool}).")
    if q_lora_rank is None:
        bad("For DSA usage in the attention layers, the `q_lora_rank` is strictly required!")
    if rope_dim > 0:
        bad(f"Expecting NoPE for the DSA attention layers, but got {rope_dim} as RoPE dim.")
    # what transformers only finds out in forward
    if act != "silu":
        bad(f"hidden_act {act!r} is not supported (GLM-5.3-Flash uses silu).")
    for name, seq in (("layer_types", c.layer_types), ("mlp_layer_types", c.mlp_layer_types),
                      ("indexer_types", c.indexer_types)):
        if len(seq) != c.num_layers:
            bad(f"{name} has {len(seq)} entries, num_hidden_layers is {c.num_layers}.")
    for i, lt in enumerate(c.layer_types):
        if lt not in ("linear_attention", "indexed_attention"):
            bad(f"layer_types[{i}] is {lt!r}; expected 'linear_attention' or 'indexed_attention'.")
        if lt == "indexed_attention" and c.indexer_types[i] == "shared":
            prev_ok = i > 0 and c.layer_types[i - 1] == "indexed_attention" and c.indexer_types[i - 1] == "full"
            if not prev_ok:
                bad(f"layer {i} is a 'shared' indexer layer but layer {i - 1} is not a 'full' indexed layer; "
                    f"transformers only hands top-k indices to the layer directly after a full one.")
    if c.n_routed_experts % c.n_group:
        bad(f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group}).")
