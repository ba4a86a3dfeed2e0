"""The Ascend backend (910B / 910C / 950 through torch_npu).

Importing this package never imports torch_npu: the op registry imports every installed backend on every
machine. torch_npu is imported by `detect()` and inside the ops, on first use.

Overrides follow /work/shared/docs/ascend-torch-npu.md call for call; docs/backends/ascend.md says, per op,
which torch_npu function runs, and what has been checked where (so far: only on the CPU stand-in in
tests/standins/torch_npu, never on silicon).
"""

from __future__ import annotations

import importlib

from flagdeploy.ops.registry import Backend

from . import ops
from .detect import detect_info  # noqa: F401  (re-exported for installers and `flagdeploy selftest`)


def detect() -> bool:
    """True only when torch_npu imports and torch.npu sees a device. Cheap, never raises."""
    try:
        importlib.import_module("torch_npu")
        import torch

        return bool(torch.npu.is_available())
    except Exception:
        return False


backend = Backend(
    name="ascend",
    vendor="huawei",
    device_type="npu",
    # what the A2/A3 cube unit takes (ADOC [2]); fp8 is only on 950 (see detect.FAMILY_MATMUL_DTYPES)
    dtypes=("bfloat16", "float16", "int8", "int4"),
    collective="hccl",
    detect=detect,
    overrides={
        "rms_norm": ops.rms_norm,
        "add_rms_norm": ops.add_rms_norm,
        "gated_rms_norm": ops.gated_rms_norm,
        "rope": ops.rope,
        "swiglu": ops.swiglu,
        "attention_prefill": ops.attention_prefill,
        "paged_attention_decode": ops.paged_attention_decode,
        "write_kv_cache": ops.write_kv_cache,
        "linear_w8a8_dynamic": ops.linear_w8a8_dynamic,
        "linear_w8a16": ops.linear_w8a16,
        "moe_router": ops.moe_router,
        "moe_experts": ops.moe_experts,
    },
    prepare={
        "linear_w8a8_dynamic": ops.prepare_w8a8,
        "linear_w8a16": ops.prepare_w8a16,
        "moe_experts": ops.prepare_moe_banks,
    },
    priority=10,
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
    description="Huawei Ascend 910B/910C/950 through torch_npu (FIA attention, W8A8 quant matmul, MoE GMM); "
                "verified only on a CPU stand-in so far",
)
