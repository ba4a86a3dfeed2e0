"""Decode-sized matmuls (a few rows against a 16-bit weight) as one Triton kernel, no split-K (issue 11).

At one to a few rows a linear layer is a read of its weight. For several decode shapes cuBLAS's heuristics
pick a tile that leaves part of the GPU's bandwidth unused (Llama-3-8B's o_proj at one row: 73% of a copy)
or split-K with a second reduce kernel (another launch per matmul inside the decode graph). Here a program takes BLOCK_N output channels and walks the whole input dimension, the
rows padded to the tensor cores' 16 in one `tl.dot` per step, the weight tiles pipelined: one launch,
as many programs as blocks of output channels.

`skinny_linear` is used only for the weight shapes in TUNED: those where `benchmarks/cuda_skinny_gemm.py
--triton --sweep` measured it at least 5% faster than cuBLAS at 1 and 8 rows on the H200, with the best
launch configuration found for each (others run cuBLAS; see `linear` in ops.py). It runs on CPU tensors
under `TRITON_INTERPRET=1` (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch

from .triton_decode import _runs_here

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

MAX_ROWS = 16  # one tl.dot tile of rows


def _cfg(block_n: int, block_k: int, stages: int) -> dict:
    return {"block_n": block_n, "block_k": block_k, "num_stages": stages, "num_warps": 4}


# (out, in) features -> launch configuration; speed-up over cuBLAS at 1 / 8 rows (H200, 2026-11-30)
TUNED = {
    (6144, 4096): _cfg(64, 256, 4),  # Llama-3-8B qkv: 1.11 / 1.06
    (4096, 4096): _cfg(32, 512, 3),  # Llama-3-8B o_proj 1.38 / 1.11; GLM-5.3-Flash shared expert gate/up 1.25 / 1.08
    (4096, 14336): _cfg(32, 512, 4),  # Llama-3-8B down: 1.07 / 1.07
    (24896, 4096): _cfg(64, 128, 3),  # GLM-5.3-Flash KDA input projection: 1.13 / 1.14
    (4096, 8192): _cfg(32, 512, 4),  # GLM-5.3-Flash KDA o_proj: 1.17 / 1.16
    (4096, 16384): _cfg(32, 512, 4),  # GLM-5.3-Flash MLA o_proj: 1.06 / 1.06
    (8192, 128): _cfg(64, 128, 3),  # GLM-5.3-Flash KDA f_b / g_b: 1.24 / 1.23
}

if triton is not None:

    @triton.jit
    def _skinny_kernel(x, w, bias, y, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nm = n < N
        mm = m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(x + m[:, None] * s_xm + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            wv = tl.load(w + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            if DOT_F32:  # the interpreter's tl.dot mishandles bf16 operands: float32 there (never on a GPU)
                acc += tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)))
            else:
                acc += tl.dot(xv, tl.trans(wv))
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y + m[:, None] * s_ym + n[None, :], acc.to(y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A few rows (any leading shape) against a 2-D 16-bit weight of the same dtype, rows contiguous."""
    return (_runs_here(x, weight) and weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == weight.dtype and x.shape[-1] == weight.shape[1] and weight.stride(1) == 1
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: dict):
    """y = x W^T (+ b) for the few rows of x under launch configuration `cfg`; the caller checked `supports`."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = cfg["block_n"]
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_F32=not x.is_cuda, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=cfg["block_k"], num_stages=cfg["num_stages"],
        num_warps=cfg["num_warps"])
    return y.view(*x.shape[:-1], n)
