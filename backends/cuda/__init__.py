"""The cuda backend: NVIDIA GPUs through torch's CUDA kernels (verified on an H200; see docs/backends/cuda.md)."""

import torch

from flagdeploy.ops import fused
from flagdeploy.ops.registry import Backend

from . import ops, triton_decode, triton_glm, triton_mhc


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
        # one Triton kernel each (backends/cuda/triton_decode.py), the fused ones as their fallback
        "linear": ops.linear,
        "rms_norm": ops.rms_norm,  # short rows (per-head norms) tiled, wider ones triton_decode's kernel
        "add_rms_norm": triton_decode.add_rms_norm,
        "rope": triton_decode.rope,
        "swiglu": triton_decode.swiglu,
        "write_kv_cache": triton_decode.write_kv_cache,
        "rope_write_kv": triton_decode.rope_write_kv,
        "attention_prefill": fused.attention_prefill,
        "paged_attention_decode": triton_decode.paged_attention_decode,
        "linear_w4a16": ops.linear_w4a16,
        "linear_w8a16": ops.linear_w8a16,
        "linear_w8a8_dynamic": ops.linear_w8a8_dynamic,
        "moe_experts": ops.moe_experts,
        "linear_fp8_block": ops.linear_fp8_block,
        "hc_pre": triton_mhc.hc_pre,
        "hc_post": triton_mhc.hc_post,
        "kda_recurrent": ops.kda_recurrent,
        "kda_chunk": ops.kda_chunk,
        "kda_recurrent_update": ops.kda_recurrent_update,
        "kda_gates": ops.kda_gates,
        "causal_conv1d_update": ops.causal_conv1d_update,
        "sparse_attention": ops.sparse_attention,
        "moe_router": ops.moe_router,
        "dsa_indexer_topk": ops.dsa_indexer_topk,
        "gated_rms_norm": ops.gated_rms_norm,
        # GLM-5.3-Flash's DSA decode step, Triton kernels (backends/cuda/triton_glm.py), the references as fallback
        "dsa_indexer_topk_decode": triton_glm.dsa_indexer_topk_decode,
        "latent_attention_decode": triton_glm.latent_attention_decode,
    },
    prepare={"linear_w4a16": ops.prepare_dense, "linear_w8a16": ops.prepare_dense},
    priority=20,
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    description="torch CUDA kernels (FlashAttention via SDPA, cuBLASLt int8, Hopper grouped GEMM for MoE, blockwise FP8 GEMM)",
)
