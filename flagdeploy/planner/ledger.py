"""The memory ledger: what a model's weights, caches and states cost, from its config alone.

Weights come from the checkpoint's own tensor list (`shapes.checkpoint_tensors`), each given a storage
dtype (as the checkpoint's quantization_config says, or as a quantize policy would convert it), a module
family, a layer, and the way a layout divides it (TP, EP, or replicated on every device). Caches and
states come from the attention kinds: GQA keys and values per token, glm5_next's MLA latent and DSA
indexer rows per token (no head axis: TP does not split them), and KDA's fixed-size state per sequence.

Speculative decoding with the model's MTP layer (`plan --mtp`) adds three things, each its own ledger line:
the MTP layer's weights (`weight_groups(include_mtp=True)`), its own per-token cache (one more MLA latent and
one more full DSA indexer's key/gate rows, `CacheShape.draft_*`, computed from the config like the main
layers'), and K more copies of every sequence's KDA state (K+1 state slots per running request, so that a
rejected draft rolls back by choosing a slot; `speculative_state_slots`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from flagdeploy.errors import FlagdeployError
from flagdeploy.checkpoints.source import PRESETS_DIR

from .shapes import checkpoint_tensors

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


class PlanInputError(FlagdeployError, ValueError):
    """The model, chip or layout given to the planner cannot be used."""


# ---- the model's config ---------------------------------------------------------------------------------


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_config(model: str) -> tuple[str, dict]:
    """(name, HF config dict) from a preset name, a config.json, a model directory, or any model source that
    `serve` takes and that is on this disk (a GGUF file, the bundled or a cached model): `--model` means one
    thing in every command."""
    path = Path(model)
    if (PRESETS_DIR / f"{model.lower()}.json").exists():
        path = PRESETS_DIR / f"{model.lower()}.json"
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file() or path.suffix == ".gguf":
        from flagdeploy.checkpoints.source import resolve

        try:
            src = resolve(model, download=False, weights=False)
        except FlagdeployError:
            raise PlanInputError(f"no model {model!r}: pass a preset ({', '.join(presets())}), a config.json, a "
                                 f"model directory that has one, a GGUF file, or a model in the cache (`flagdeploy "
                                 f"models`).") from None
        return src.name, source_config(src)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"{path} is not valid JSON ({exc}).") from exc
    name = path.stem if path.parent == PRESETS_DIR else (path.parent.name if path.name == "config.json" else path.stem)
    return name, config


def source_config(src) -> dict:
    """The HF config of a resolved model source (`checkpoints.source.ModelSource`): its config.json, or for a
    GGUF the llama config its metadata describes."""
    if src.format != "gguf":
        return json.loads((Path(src.path) / "config.json").read_text())
    from flagdeploy.checkpoints import gguf_reader

    c = gguf_reader.read_config(gguf_reader.open_gguf(src.path))
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias, "torch_dtype": "float32"}


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


# ---- weights ------------------------------------------------------------------------------------------------

# (family, how a layout divides it), first match wins; "ep" means split by EP when expert parallel is on,
# by TP otherwise. The MLA down-projections and the DSA indexer are small and replicated, as engines do.
_FAMILIES = [
    (r"^model\.(visual|vision_model|connector)\.", "vision", "replicated"),
    (r"(embed_tokens|wte)\.weight$", "embedding", "tp"),
    (r"^lm_head\.", "lm_head", "tp"),
    (r"(norm\d?|layernorm)\.(weight|bias)$|\.(enorm|hnorm)\.", "norm", "replicated"),
    (r"\.mlp\.(gate|router)\.|\.e_score_correction_bias$|shared_expert_gate|block_sparse_moe\.gate\.", "router", "replicated"),
    (r"\.experts\.", "experts", "ep"),
    (r"shared_expert", "shared_experts", "tp"),
    (r"\.(mlp|block_sparse_moe)\.", "mlp", "tp"),
    (r"\.hc_(attn|ffn)_", "hyper_connections", "replicated"),
    (r"\.self_attn\.indexer\.", "indexer", "replicated"),
    (r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.", "attention", "replicated"),
    (r"\.self_attn\.(f_a_proj|f_b_proj|g_a_proj|g_b_proj|b_proj|\w_conv1d|dt_bias|A_log)|\.self_attn\.o_norm", "linear_attention", "tp"),
    (r"\.self_attn\.", "attention", "tp"),
]
_FAMILY_RES = [(re.compile(p), f, s) for p, f, s in _FAMILIES]
_LAYER = re.compile(r"layers\.(\d+)\.")
# tensors checkpoints keep in float32 whatever the model dtype (glm5_next's published layout)
_FP32 = re.compile(r"(e_score_correction_bias|\.dt_bias|\.A_log|\.hc_(attn|ffn)_(base|scale))$")


def family_of(name: str) -> tuple[str, str]:
    for pattern, family, split in _FAMILY_RES:
        if pattern.search(name):
            return family, split
    return "other", "replicated"


@dataclass(frozen=True)
class WeightGroup:
    family: str
    dtype: str
    split: str  # tp, ep or replicated
    layer: int | None  # decoder layer (None: embeddings, head, vision, final norm)
    params: int
    bytes: int  # with the quantization scales that belong to it


@lru_cache(maxsize=8)
def _not_converted(entries: tuple[str, ...]) -> frozenset[str]:
    return frozenset(entries)


def _stored_dtype(name: str, shape: tuple[int, ...], config: dict) -> str:
    """The dtype the checkpoint stores a tensor in, from its quantization_config."""
    base = {"float32": "fp32", "float16": "fp16"}.get(str(config.get("dtype") or config.get("torch_dtype")), "bf16")
    if _FP32.search(name):
        return "fp32"
    qc = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    module = name.rsplit(".", 1)[0]
    if qc.get("quant_method") == "flagdeploy":
        return {"w8a8_dynamic": "int8", "w8a16": "int8", "fp8": "fp8"}.get(qc.get("modules", {}).get(module, ""), base)
    if qc.get("quant_method") == "fp8" and name.endswith(".weight") and len(shape) == 2:
        if family_of(name)[0] in ("embedding", "lm_head", "norm", "router", "vision"):
            return base
        parts = module.split(".")  # an entry matches as a whole-name prefix or suffix, as transformers reads it
        around = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} | {".".join(parts[i:]) for i in range(len(parts))}
        return base if around & _not_converted(tuple(qc.get("modules_to_not_convert") or ())) else "fp8"
    return base


def _policy_dtype(name: str, shape: tuple[int, ...], stored: str, policy) -> str:
    """The dtype after `flagdeploy quantize` with `policy` (same rules as the converter)."""
    from flagdeploy.quantize.schemes import SCHEMES, is_matrix_weight

    scheme = policy.rule_for(name).scheme
    if SCHEMES[scheme].int8 and is_matrix_weight(name, shape):
        return "int8"
    if scheme == "fp8" and is_matrix_weight(name, shape):
        return "fp8"
    if scheme == "keep":
        return stored
    return stored if stored == "fp32" else "bf16"


def _nbytes(dtype: str, shape: tuple[int, ...], numel: int, block: tuple[int, int]) -> int:
    b = numel * DTYPE_BYTES[dtype]
    if dtype == "fp8" and len(shape) == 2:  # float32 inverse scale per block
        b += -(-shape[0] // block[0]) * -(-shape[1] // block[1]) * 4
    elif dtype == "int8" and len(shape) == 2:  # float32 scale per output channel
        b += shape[0] * 4
    return b


def weight_groups(config: dict, *, policy=None, include_mtp: bool = False) -> list[WeightGroup]:
    """The checkpoint's weights by (family, dtype, split, layer), as stored or as `policy` (a frozen, hashable
    Policy) converts them. The result is kept per config and policy: a plan asks twice, `deploy` plans once per
    engine it tries, and a large config's tensor list takes seconds to walk."""
    return list(_stored_groups(json.dumps(config, sort_keys=True, default=str), policy, include_mtp))


@lru_cache(maxsize=16)
def _stored_groups(config_json: str, policy, include_mtp: bool) -> tuple[WeightGroup, ...]:
    return tuple(_weight_groups(json.loads(config_json), policy, include_mtp))


def _weight_groups(config: dict, policy, include_mtp: bool) -> list[WeightGroup]:
    sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    qc = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or (128, 128))
    for name, shape in checkpoint_tensors(config, include_mtp=include_mtp):
        numel = 1
        for d in shape:
            numel *= d
        dtype = _stored_dtype(name, shape, config)
        if policy is not None:
            dtype = _policy_dtype(name, shape, dtype, policy)
        family, split = family_of(name)
        m = _LAYER.search(name) if family != "vision" else None  # (an encoder's layers are not decoder layers)
        key = (family, dtype, split, int(m.group(1)) if m else None)
        sums[key][0] += numel
        sums[key][1] += _nbytes(dtype, shape, numel, block)
    return [WeightGroup(*k, p, b) for k, (p, b) in sums.items()]


# ---- caches and states ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheShape:
    """Per-token cache and per-sequence state, in elements, per decoder layer.

    kv_split: per layer, the number of KV heads a TP group can divide (0: no head axis, replicated).
    dense / sparse: values per token read by every decode step over the whole context / only over the
    DSA's selected positions (at most `sparse_topk`). state: per-sequence values (float32) and conv taps.
    """

    dense: list[int]
    sparse: list[int]
    kv_split: list[int]
    state_fp32: list[int] = field(default_factory=list)
    state_conv: list[int] = field(default_factory=list)
    state_split: list[int] = field(default_factory=list)  # heads TP divides the state by
    sparse_topk: int = 0
    # the MTP draft layer's own cache per token (`cache_shape(include_mtp=True)`; 0: none): values read over
    # the whole context / at the selected positions, and the KV heads TP divides it by (0: no head axis)
    draft_dense: int = 0
    draft_sparse: int = 0
    draft_split: int = 0

    @property
    def layers(self) -> int:
        return len(self.dense)

    @property
    def has_draft_layer(self) -> bool:
        return bool(self.draft_dense or self.draft_sparse)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The main model's cache per token (the MTP layer's is `draft_kv_bytes_per_token`)."""
        return (sum(self.dense) + sum(self.sparse)) * dtype_bytes

    def draft_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The MTP layer's own cache per token: its MLA latent and its DSA indexer rows."""
        return (self.draft_dense + self.draft_sparse) * dtype_bytes

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        return sum(self.state_fp32) * 4 + sum(self.state_conv) * dtype_bytes


def speculative_state_slots(num_speculative_tokens: int) -> int:
    """Extra linear-attention (KDA) state copies per running sequence under speculative decoding: K.

    A request verifying K drafts owns K+1 state slots, the state after each verified token, and the next
    step starts from the slot of the last accepted one (vLLM: `spec_state_indices_tensor` [batch, K+1] in
    `vllm/v1/attention/backends/gdn_attn.py`, shared by GDN and KDA; the conv state is indexed the same way),
    so K copies beyond the one a plain decode keeps. shared/docs/speculative-multimodal-multinode.md 1.4.
    SGLang keeps the K+1 in separate intermediate caches beside the main pool, one copy more than this.
    """
    return max(0, num_speculative_tokens)


def _glm5_layer_cache(c, indexed: bool, indexer_kind: str) -> tuple[int, int]:
    """(dense, sparse) values per token of one glm5_next attention layer: an indexed (MLA) layer keeps its
    latent (kv_lora_rank, read at the DSA's selected positions) and, with a full indexer, the indexer's key
    and pool-gate rows (index_head_dim each, read over the whole context); a KDA layer keeps none."""
    return (2 * c.index_head_dim if indexed and indexer_kind == "full" else 0), (c.kv_lora_rank if indexed else 0)


def cache_shape(config: dict, *, include_mtp: bool = False) -> CacheShape:
    """include_mtp: also the MTP draft layer's own cache (glm5_next: an MLA + full-indexer layer, like the
    one `shapes.checkpoint_tensors(include_mtp=True)` adds; other model types have no MTP layer here)."""
    t = text_config(config)
    if config.get("model_type") == "glm5_next":
        from flagdeploy.models.glm5_next import from_hf_config

        c = from_hf_config(config)
        dense, sparse, split, s32, conv, ssplit = [], [], [], [], [], []
        for lt, kind in zip(c.layer_types, c.indexer_types):
            indexed = lt == "indexed_attention"
            d, sp = _glm5_layer_cache(c, indexed, kind)
            sparse.append(sp)  # the latent, read at the selected positions
            dense.append(d)  # indexer key + pool gate
            split.append(0)
            s32.append(0 if indexed else c.linear_num_heads * c.linear_head_dim ** 2)
            conv.append(0 if indexed else (c.linear_conv_kernel_dim - 1) * 3 * c.linear_num_heads * c.linear_head_dim)
            ssplit.append(0 if indexed else c.linear_num_heads)
        draft_dense, draft_sparse = _glm5_layer_cache(c, True, "full") if include_mtp else (0, 0)
        return CacheShape(dense, sparse, split, s32, conv, ssplit, c.index_topk, draft_dense, draft_sparse, 0)
    heads = t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or t["hidden_size"] // heads
    n = t["num_hidden_layers"]
    return CacheShape([2 * kv * head_dim] * n, [0] * n, [kv] * n)
