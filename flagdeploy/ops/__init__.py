"""The op layer: models call these functions, never a chip's API.

Each name below routes to the active backend's override or, failing that, to the plain-torch
reference in `flagdeploy.ops.reference`. `use_backend(...)` picks the backend (default: detected).
"""

from . import glm as _glm  # noqa: F401  (declares the GLM-5.3-Flash ops)
from . import reference as _reference  # noqa: F401  (declares the ops)
from .registry import (
    OPS, Backend, OpSpec, Tolerance, active_backend, backends, detect_backend, dispatch, get_backend, in_prefill_step,
    in_verify_step, prefill_step, prepare_weight, require_device, tracing, use_backend, verify_step,
)
from .reference import a16_dtype, rope_tables
from .weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight

linear = dispatch("linear")
linear_all_reduce = dispatch("linear_all_reduce")
all_reduce = dispatch("all_reduce")
linear_w4a16 = dispatch("linear_w4a16")
linear_w8a16 = dispatch("linear_w8a16")
linear_w8a8_dynamic = dispatch("linear_w8a8_dynamic")
linear_fp8_block = dispatch("linear_fp8_block")
embedding = dispatch("embedding")
rms_norm = dispatch("rms_norm")
add_rms_norm = dispatch("add_rms_norm")
rope = dispatch("rope")
swiglu = dispatch("swiglu")
argmax = dispatch("argmax")
sample_probs = dispatch("sample_probs")
draw = dispatch("draw")
attention_prefill = dispatch("attention_prefill")
paged_attention_decode = dispatch("paged_attention_decode")
write_kv_cache = dispatch("write_kv_cache")
rope_write_kv = dispatch("rope_write_kv")

__all__ = [
    "OPS", "Backend", "OpSpec", "Tolerance", "active_backend", "backends", "detect_backend", "get_backend", "require_device",
    "use_backend", "prepare_weight", "prefill_step", "in_prefill_step", "verify_step", "in_verify_step", "tracing", "a16_dtype", "rope_tables", "Fp8BlockWeight", "Int4Weight", "Int8Weight", "W8A8Weight", "linear", "linear_all_reduce", "all_reduce",
    "linear_w4a16", "linear_w8a16", "linear_w8a8_dynamic", "linear_fp8_block", "embedding", "rms_norm", "add_rms_norm", "rope", "swiglu", "argmax", "sample_probs", "draw",
    "attention_prefill", "paged_attention_decode", "write_kv_cache", "rope_write_kv",
]
