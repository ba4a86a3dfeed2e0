"""The cuda backend: NVIDIA GPUs through torch's CUDA kernels (verified on an H200; see docs/backends/cuda.md)."""

import torch

from flagdeploy.ops import fused
from flagdeploy.ops.registry import Backend

from . import ops


def _detect() -> bool:
    return torch.cuda.is_available()


backend = Backend(
    name="cuda",
    vendor="nvidia",
    device_type="cuda",
    dtypes=("float32", "bfloat16", "float16", "int8", "float8_e4m3fn"),
    collective="nccl",
    detect=_detect,
    overrides={
        "rms_norm": fused.rms_norm,
        "add_rms_norm": fused.add_rms_norm,
        "rope": fused.rope,
        "write_kv_cache": fused.write_kv_cache,
        "attention_prefill": fused.attention_prefill,
        "paged_attention_decode": fused.paged_attention_decode,
        "linear_w4a16": ops.linear_w4a16,
        "linear_w8a16": ops.linear_w8a16,
        "linear_w8a8_dynamic": ops.linear_w8a8_dynamic,
        "moe_experts": ops.moe_experts,
        "linear_fp8_block": ops.linear_fp8_block,
    },
    prepare={"linear_w4a16": ops.prepare_dense, "linear_w8a16": ops.prepare_dense},
    priority=20,
    description="torch CUDA kernels (FlashAttention via SDPA, cuBLASLt int8, Hopper grouped GEMM for MoE, blockwise FP8 GEMM)",
)
