"""Routed experts with FP8 block-scaled weights for decode steps, as two Triton kernels (issue 11).

A decode step routes a few tokens to top_k experts each, so every (token, expert) pair is a matrix-vector
product over that expert's weights, and the step is bound by reading the picked experts once. The
weights stay as the checkpoint stores them (e4m3, one float32 inverse scale per block of
block[0] x block[1]): half the bytes of bf16. Each program takes one pair and BN output rows, walks the
input in steps of one scale block, rounds the activations of that step to e4m3 exactly as the
reference does (per token and group of block[1] channels, absmax at 448: what an FP8 matrix unit
consumes), decodes the weights, and accumulates in float32.

- `_gate_up`: gate and up rows of the pair's expert in one pass, then the clamped SwiGLU; out [P, I].
- `_down`: the down projection of that output (quantised again, as the reference's second linear); out
  [P, H] float32, weighted and summed per token by the caller.

Pairs come from `routing.topk(top_k)`, a fixed count: nothing is read back to the host, so a decode
step with these kernels is captured in the CUDA graph. With `TRITON_INTERPRET=1` they run on CPU tensors
(tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch

from flagdeploy.ops.weights import FP8_E4M3_MAX, Fp8BlockWeight

from .triton_decode import _runs_here

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

# Launch shape by the number of (token, expert) pairs: (most pairs, output rows per program, warps, stages).
# Measured on the H200 at GLM-5.3-Flash's expert shapes with `benchmarks/cuda_moe_fp8.py --sweep` (2026-11-29):
# one token's 8 pairs want many short programs (16 rows), 64 pairs fewer, wider ones (128 rows).
LAUNCH = ((16, 16, 2, 3), (None, 128, 2, 2))
FORCED: dict | None = None  # {"block_n", "num_warps", "num_stages"}: set by the sweep


def launch_config(pairs: int) -> dict:
    if FORCED is not None:
        return FORCED
    _, bn, warps, stages = next(row for row in LAUNCH if row[0] is None or pairs <= row[0])
    return {"block_n": bn, "num_warps": warps, "num_stages": stages}


if triton is not None:

    @triton.jit
    def _quant_e4m3(v, fp8_max):
        """The activation group `v` (one scale block of input channels) rounded through e4m3 as torch's
        cast does it (round half to even, subnormals below 2^-6), in float32 arithmetic: the exponent is
        read from the bits, so the grid is exact on any GPU and in the interpreter."""
        scale = tl.maximum(tl.max(tl.abs(v), 0) / fp8_max, 1e-12).to(tl.float32)  # fp8_max may arrive as fp64
        a = (tl.abs(v) / scale).to(tl.float32)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # e4m3 keeps 3 mantissa bits
        r = a / step
        f = tl.floor(r)
        d = r - f
        up = (d > 0.5) | ((d == 0.5) & ((f.to(tl.int32) & 1) == 1))
        q = tl.where(up, f + 1.0, f) * step
        return tl.where(v < 0, -q, q) * scale

    @triton.jit
    def _moe_fp8_kernel(x, ids, w, s, out, K, N, limit, fp8_max,
                        s_we, s_se, s_sn,
                        TOP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr,
                        GATED: tl.constexpr, HAS_LIMIT: tl.constexpr):
        p = tl.program_id(0)
        t = p // TOP
        e = tl.load(ids + p).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        cols = tl.arange(0, BC)
        w_rows = w + e * s_we + rn[:, None].to(tl.int64) * K
        s_rows = s + e * s_se + (rn // BR) * s_sn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if GATED:  # the up rows sit N rows below the gate rows (fused gate_up, N = intermediate size)
            w_up = w_rows + N * K
            s_up = s + e * s_se + ((rn + N) // BR) * s_sn
            acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BC)):
            rk = kb * BC + cols
            kmask = rk < K
            xq = _quant_e4m3(tl.load(x + t * K + rk, mask=kmask, other=0.0).to(tl.float32), fp8_max)
            m2 = nmask[:, None] & kmask[None, :]
            wv = tl.load(w_rows + rk[None, :], mask=m2, other=0.0).to(tl.float32)
            acc += tl.sum(wv * xq[None, :], 1) * tl.load(s_rows + kb, mask=nmask, other=0.0)
            if GATED:
                wu = tl.load(w_up + rk[None, :], mask=m2, other=0.0).to(tl.float32)
                acc_up += tl.sum(wu * xq[None, :], 1) * tl.load(s_up + kb, mask=nmask, other=0.0)
        if GATED:
            gate = acc
            up = acc_up
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            acc = gate * tl.sigmoid(gate) * up
        tl.store(out + p * N + rn, acc.to(out.dtype.element_ty), mask=nmask)


def supports(x: torch.Tensor, gate_up, down, top_k: int | None) -> bool:
    """FP8 banks whose scale blocks the kernels can walk, CUDA (or interpreted CPU) tensors."""
    if top_k is None or not _runs_here(x):
        return False
    if not (isinstance(gate_up, Fp8BlockWeight) and isinstance(down, Fp8BlockWeight)):
        return False
    inter = down.in_features
    bc_ok = all(b[1] >= 16 and b[1] & (b[1] - 1) == 0 for b in (gate_up.block, down.block))
    return (gate_up.q.dim() == 3 and bc_ok and inter % gate_up.block[0] == 0 and x.dtype != torch.float64
            and gate_up.in_features == down.out_features == x.shape[1])


def _launch(x, ids, bank: Fp8BlockWeight, out, n, top_k, gated, limit):
    _, rows, k = bank.q.shape
    br, bc = bank.block
    s = bank.scale_inv.float().contiguous()
    cfg = launch_config(ids.numel())
    bn = cfg["block_n"]
    grid = (ids.numel(), triton.cdiv(n, bn))
    _moe_fp8_kernel[grid](x.contiguous(), ids, bank.q.contiguous(), s, out, k, n,
                          float(limit) if limit is not None else 0.0, FP8_E4M3_MAX,
                          rows * k, s.shape[1] * s.shape[2], s.shape[2],
                          TOP=1 if not gated else top_k, BR=br, BC=bc, BLOCK_N=bn, GATED=gated,
                          HAS_LIMIT=limit is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def moe_fp8_experts(x: torch.Tensor, routing: torch.Tensor, gate_up: Fp8BlockWeight, down: Fp8BlockWeight,
                    limit: float | None, top_k: int) -> torch.Tensor:
    """`moe_experts` for FP8 banks: each token's top_k experts (zero-weight picks add nothing)."""
    t, inter, hidden = x.shape[0], down.in_features, down.out_features
    picked = routing.abs().topk(top_k, dim=-1).indices
    weight = routing.gather(1, picked)
    ids = picked.flatten().to(torch.int32).contiguous()
    # float32: down re-quantises it, a 16-bit rounding first would move values across e4m3 steps
    h = torch.empty(t * top_k, inter, dtype=torch.float32, device=x.device)
    _launch(x, ids, gate_up, h, inter, top_k, True, limit)
    y = torch.empty(t * top_k, hidden, dtype=torch.float32, device=x.device)
    _launch(h, ids, down, y, hidden, top_k, False, None)
    return (y.view(t, top_k, hidden) * weight.float().unsqueeze(-1)).sum(1).to(x.dtype)
