"""The tensors a model's HF checkpoint holds, from its `config.json` alone.

The memory planner has to size a model before any weight is downloaded, so this works from the config
dict only (no weights, no network, no transformers model): `(name, shape)` in the HF checkpoint's naming
(experts one by one, as the shards store them, even where transformers fuses them in memory).

The dense and MoE llama-like families are written out as formulas. `glm5_next` (GLM-5.3-Flash) takes its
text part from flagdeploy's own model built on the meta device, as the tiny-checkpoint writer does, so the
two cannot drift apart; its vision tower is written out from transformers' `Glm5NextVision*` classes.
`idefics3` (SmolVLM) is the llama formulas under its text prefix plus its SigLIP encoder.

Fields a config leaves out take transformers' default for that model type where it changes a shape (see
`_DEFAULTS`); the sizes every config.json carries (vocab/hidden/intermediate size, layer and head counts)
are required.
"""

from __future__ import annotations

from math import prod
from typing import Callable, Iterator

Shapes = Iterator[tuple[str, tuple[int, ...]]]

# transformers' defaults (5.23) for the optional fields that change a shape, per model_type
_DEFAULTS: dict[str, dict] = {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "mistral": {"num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "attention_bias": False},
    "qwen2_moe": {"num_key_value_heads": 16, "num_experts": 60, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "qkv_bias": True},
    "qwen3_moe": {"num_key_value_heads": 4, "num_experts": 128, "moe_intermediate_size": 768,
                  "attention_bias": False},
    "mixtral": {"num_key_value_heads": 8, "num_local_experts": 8},
}
# transformers' Glm5NextVisionConfig defaults (5.23)
_VISION_DEFAULTS = dict(depth=24, hidden_size=1024, num_heads=16, in_channels=3, patch_size=14, temporal_patch_size=2,
                        spatial_merge_size=2, out_hidden_size=1536, intermediate_size=4096,
                        projection_intermediate_size=10240, attention_bias=True)


def checkpoint_tensors(config: dict, *, include_mtp: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the model's HF checkpoint as `(name, shape)`, computed from `config` alone.

    include_mtp: for `glm5_next`, add the multi-token-prediction layer that the published checkpoint
    ships (transformers ignores it, so it is left out by default). Other model types have none.
    """
    model_type = config.get("model_type")
    builder = _BUILDERS.get(model_type)
    if builder is None:
        if not _GENERIC_KEYS <= config.keys():
            raise ValueError(f"unsupported model_type {model_type!r}: supported: {', '.join(sorted(_BUILDERS))}; other "
                             f"decoders need at least {', '.join(sorted(_GENERIC_KEYS))} in their config for an estimate")
        return list(_llama_like({**config, "model_type": "generic"}))
    if model_type == "glm5_next":
        return list(_glm5_next(config, include_mtp))
    if model_type == "idefics3":
        return list(_idefics3(config))
    c = {**_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None}}
    return list(builder(c))


# An unknown decoder with these keys is estimated as a llama-like one (MoE if it names routed experts):
# attention, norms and embeddings are near enough across families for planning; the result is not exact.
_GENERIC_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"}


def is_exact(config: dict) -> bool:
    """Whether `checkpoint_tensors` knows this model type (else it is a generic estimate)."""
    return config.get("model_type") in _BUILDERS


def parameter_count(config: dict, *, include_mtp: bool = False) -> int:
    """Total number of elements over `checkpoint_tensors` (tied weights once, as the checkpoint stores them)."""
    return sum(prod(shape) for _, shape in checkpoint_tensors(config, include_mtp=include_mtp))


# ---- llama-like families -----------------------------------------------------------------------------


def _linear(name: str, out: int, inp: int, bias: bool) -> Shapes:
    yield name + ".weight", (out, inp)
    if bias:
        yield name + ".bias", (out,)


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> Shapes:
    yield from _linear(prefix + "gate_proj", inter, hidden, bias)
    yield from _linear(prefix + "up_proj", inter, hidden, bias)
    yield from _linear(prefix + "down_proj", hidden, inter, bias)


def _attention(c: dict, prefix: str) -> Shapes:
    """GQA self-attention. Biases: qwen2 always on q/k/v, qwen2_moe `qkv_bias` on q/k/v, the others
    `attention_bias` on all four; qwen3 / qwen3_moe add per-head q_norm / k_norm."""
    mt, hidden, heads = c["model_type"], c["hidden_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    qkv_bias = {"qwen2": True, "qwen2_moe": c.get("qkv_bias")}.get(mt, c.get("attention_bias", False))
    o_bias = mt not in ("qwen2", "qwen2_moe") and c.get("attention_bias", False)
    yield from _linear(prefix + "q_proj", heads * head_dim, hidden, qkv_bias)
    yield from _linear(prefix + "k_proj", kv_heads * head_dim, hidden, qkv_bias)
    yield from _linear(prefix + "v_proj", kv_heads * head_dim, hidden, qkv_bias)
    yield from _linear(prefix + "o_proj", hidden, heads * head_dim, o_bias)
    if mt in ("qwen3", "qwen3_moe"):
        yield prefix + "q_norm.weight", (head_dim,)
        yield prefix + "k_norm.weight", (head_dim,)


def _is_sparse(c: dict, i: int) -> bool:
    """qwen2_moe / qwen3_moe: transformers' rule for which layers get the MoE block."""
    return (i not in (c.get("mlp_only_layers") or []) and c["num_experts"] > 0
            and (i + 1) % c.get("decoder_sparse_step", 1) == 0)


def _ffn(c: dict, p: str, i: int) -> Shapes:
    mt, hidden = c["model_type"], c["hidden_size"]
    if mt == "mixtral":
        e, inter = c["num_local_experts"], c["intermediate_size"]
        yield p + "block_sparse_moe.gate.weight", (e, hidden)
        for j in range(e):
            q = f"{p}block_sparse_moe.experts.{j}."
            yield q + "w1.weight", (inter, hidden)  # gate
            yield q + "w2.weight", (hidden, inter)  # down
            yield q + "w3.weight", (inter, hidden)  # up
    elif mt in ("qwen2_moe", "qwen3_moe") and _is_sparse(c, i):
        yield p + "mlp.gate.weight", (c["num_experts"], hidden)
        for j in range(c["num_experts"]):
            yield from _mlp(f"{p}mlp.experts.{j}.", hidden, c["moe_intermediate_size"])
        if mt == "qwen2_moe":
            yield from _mlp(p + "mlp.shared_expert.", hidden, c["shared_expert_intermediate_size"])
            yield p + "mlp.shared_expert_gate.weight", (1, hidden)
    elif mt == "generic" and _generic_experts(c) and i >= c.get("first_k_dense_replace", 0):
        e, inter = _generic_experts(c), c.get("moe_intermediate_size") or c["intermediate_size"]
        yield p + "mlp.gate.weight", (e, hidden)
        for j in range(e):
            yield from _mlp(f"{p}mlp.experts.{j}.", hidden, inter)
        if c.get("n_shared_experts"):
            yield from _mlp(p + "mlp.shared_experts.", hidden, inter * c["n_shared_experts"])
    else:
        yield from _mlp(p + "mlp.", hidden, c["intermediate_size"], bool(c.get("mlp_bias", False)))


def _generic_experts(c: dict) -> int:
    return c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0


def _llama_like(c: dict) -> Shapes:
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield from _attention(c, p + "self_attn.")
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield from _ffn(c, p, i)
    yield "model.norm.weight", (hidden,)
    if not c.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden)


# ---- glm5_next (GLM-5.3-Flash) -----------------------------------------------------------------------


def _glm5_next(config: dict, include_mtp: bool) -> Shapes:
    """Text tensors from our own meta-device model (`tiny_checkpoint._text_model/_text_shapes`, the same
    names the tiny checkpoint writer uses), then the vision tower, then optionally the MTP layer."""
    from flagdeploy.checkpoints.tiny_checkpoint import TEXT_PREFIX, _text_model, _text_shapes

    cfg, model = _text_model(config)
    text = list(_text_shapes(model))
    yield from text
    yield from _glm5_vision({**_VISION_DEFAULTS, **(config.get("vision_config") or {})})
    if include_mtp:
        # The published checkpoint's MTP draft layer (index num_hidden_layers): a DeepSeek-style MTP layer, an
        # MLA + full-indexer attention with an MoE MLP and no mHC weights, plus eh_proj over [embedding; hidden],
        # enorm, hnorm and shared_head.norm (embed_tokens and lm_head shared with the main model). DEDUCED, not
        # read: with the docs' dtypes, a 4096-wide vision projector and index_kpool 4, this layout reproduces
        # the published total_size (328,326,771,576 bytes) to the byte; a copy of the last (KDA) layer does not.
        n, h = cfg.num_layers, cfg.hidden_size
        like = max(i for i in range(n) if cfg.layer_types[i] == "indexed_attention" and cfg.indexer_types[i] == "full"
                   and cfg.mlp_layer_types[i] == "sparse")
        src, mtp = f"{TEXT_PREFIX}layers.{like}.", f"{TEXT_PREFIX}layers.{n}."
        yield from ((mtp + name[len(src):], shape) for name, shape in text if name.startswith(src) and ".hc_" not in name)
        yield mtp + "eh_proj.weight", (h, 2 * h)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield f"{mtp}{norm}.weight", (h,)


def _glm5_vision(v: dict) -> Shapes:
    """transformers' Glm5NextVisionModel: Conv3d patch embed, pre-norm blocks (fused qkv with per-head
    RMS q/k norms, SwiGLU MLP; biases per `attention_bias`), final RMSNorm, a Conv2d spatial-merge
    downsample to out_hidden_size, and the patch merger (proj, LayerNorm, SwiGLU without biases).
    The axial rotary embedding has only non-persistent buffers."""
    h, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    ctx = v["projection_intermediate_size"]
    bias, head_dim, m, ps = v["attention_bias"], h // v["num_heads"], v["spatial_merge_size"], v["patch_size"]
    p = "model.visual."
    yield p + "patch_embed.proj.weight", (h, v["in_channels"], v["temporal_patch_size"], ps, ps)
    yield p + "patch_embed.proj.bias", (h,)
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        yield b + "norm1.weight", (h,)
        yield b + "norm2.weight", (h,)
        yield from _linear(b + "attn.qkv", 3 * h, h, bias)
        yield from _linear(b + "attn.proj", h, h, bias)
        yield b + "attn.q_norm.weight", (head_dim,)
        yield b + "attn.k_norm.weight", (head_dim,)
        yield from _mlp(b + "mlp.", h, inter, bias)
    yield p + "merger.proj.weight", (out, out)
    yield p + "merger.post_projection_norm.weight", (out,)
    yield p + "merger.post_projection_norm.bias", (out,)
    yield from _mlp(p + "merger.", out, ctx)
    yield p + "downsample.weight", (out, h, m, m)
    yield p + "downsample.bias", (out,)
    yield p + "post_layernorm.weight", (h,)


# ---- idefics3 (SmolVLM) ----------------------------------------------------------------------------------

# transformers' Idefics3VisionConfig defaults (5.23)
_SIGLIP_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_channels=3, image_size=224,
                        patch_size=32)


def _idefics3(config: dict) -> Shapes:
    """transformers' Idefics3ForConditionalGeneration: the llama text model under `model.text_model.` (the
    head stays `lm_head`), the SigLIP encoder (conv patch embed, learned positions, LayerNorm ViT layers
    with biases everywhere, post-LayerNorm) and the connector's one projection."""
    text = {**_DEFAULTS["llama"], "tie_word_embeddings": config.get("tie_word_embeddings", False),
            **{k: v for k, v in (config.get("text_config") or {}).items() if v is not None}, "model_type": "llama"}
    for name, shape in _llama_like(text):
        yield (name if name.startswith("lm_head") else "model.text_model." + name.removeprefix("model.")), shape
    v = {**_SIGLIP_DEFAULTS, **{k: x for k, x in (config.get("vision_config") or {}).items() if x is not None}}
    h, p = v["hidden_size"], "model.vision_model."
    yield p + "embeddings.patch_embedding.weight", (h, v["num_channels"], v["patch_size"], v["patch_size"])
    yield p + "embeddings.patch_embedding.bias", (h,)
    yield p + "embeddings.position_embedding.weight", ((v["image_size"] // v["patch_size"]) ** 2, h)
    for i in range(v["num_hidden_layers"]):
        q = f"{p}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            yield q + norm + ".weight", (h,)
            yield q + norm + ".bias", (h,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield from _linear(q + "self_attn." + proj, h, h, True)
        yield from _linear(q + "mlp.fc1", v["intermediate_size"], h, True)
        yield from _linear(q + "mlp.fc2", h, v["intermediate_size"], True)
    yield p + "post_layernorm.weight", (h,)
    yield p + "post_layernorm.bias", (h,)
    yield "model.connector.modality_projection.proj.weight", (text["hidden_size"], h * config.get("scale_factor", 2) ** 2)


_BUILDERS: dict[str, Callable] = {**{mt: _llama_like for mt in _DEFAULTS}, "glm5_next": _glm5_next,
                                   "idefics3": _idefics3}
