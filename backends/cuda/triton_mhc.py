"""GLM-5.3-Flash's hyper-connections (mHC) around every block, as Triton kernels (issue 11).

Each layer calls `hc_pre` and `hc_post` twice (around the token mixer and around the FFN). Their
references are chains of small kernels: at batch 1 on an H200 one `hc_pre` was ~13 launches (casts,
the RMS norm as pow/mean/add/rsqrt/mul, a float32 GEMV over a float32 copy of `fn`, the gates and
Sinkhorn, the collapse, three casts: ~31 us) and one `hc_post` three (~6 us), about a quarter of a
4-layer decode step. Here:

- `_hc_proj_kernel`: the projection of the raw streams onto `fn`'s (2+N)N rows and the streams' sum of
  squares, split over the N*D input channels (a program per token and block of channels writes its
  partial sums). The RMS norm is a per-token scalar, so it is applied to the sums afterwards:
  (x * r) @ fn^T = (x @ fn^T) * r. Past a few dozen tokens (prefill) a cuBLAS float32 matmul does the
  projection instead: the kernel would read `fn` once per token.
- `_hc_mix_kernel`: a program per token and block of D channels adds the partial sums up, applies the
  norm, computes the gates and runs every Sinkhorn iteration in registers (each program redoes this
  tiny part: cheaper than another launch), and collapses its channels of the N streams weighted by
  `pre`; the first block also writes `post` and `comb`.
- `_hc_post_kernel`: new stream i = post_i * block output + sum_j comb[j, i] * stream j, in float32,
  rounded once.

Float32 arithmetic throughout, as the references; launch shapes come from tensor shapes only, so both
run inside CUDA graph capture. With `TRITON_INTERPRET=1` they run on CPU tensors
(tests/test_triton_kernels.py); float64 and tensors off the GPU run the references.
"""

from __future__ import annotations

import torch

from flagdeploy.ops.registry import OPS

from .triton_decode import _FLOATS, _runs_here

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

_BLOCK_K = 256  # input channels per projection program
_BLOCK_D = 512  # channels per collapse / post program
_SPLIT_TOKENS = 64  # more tokens than this: the projection as one cuBLAS matmul (fn read once, not per token)

if triton is not None:

    @triton.jit
    def _hc_proj_kernel(streams, fn, part, part_sq, K, W, S,
                        BW: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        s = tl.program_id(1)
        k = s * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.arange(0, BW)
        km = k < K
        x = tl.load(streams + t * K + k, mask=km, other=0.0).to(tl.float32)
        f = tl.load(fn + w[:, None] * K + k[None, :], mask=(w[:, None] < W) & km[None, :], other=0.0).to(tl.float32)
        tl.store(part + (t * S + s) * BW + w, tl.sum(f * x[None, :], axis=1))
        tl.store(part_sq + t * S + s, tl.sum(x * x, axis=0))

    @triton.jit
    def _hc_mix_kernel(streams, part, part_sq, base, scale, post_out, comb_out, h_out, K, S, PW, D, norm_eps, hc_eps,
                       iters, N: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        j = tl.program_id(1)
        sp = tl.arange(0, BS)
        sm = sp < S
        r = tl.rsqrt(tl.sum(tl.load(part_sq + t * S + sp, mask=sm, other=0.0), axis=0) / K + norm_eps)
        rows = part + (t * S + sp) * PW
        i = tl.arange(0, BN)
        vi = i < N
        pm = sm[:, None] & vi[None, :]
        pre_p = tl.sum(tl.load(rows[:, None] + i[None, :], mask=pm, other=0.0), axis=0) * r
        post_p = tl.sum(tl.load(rows[:, None] + N + i[None, :], mask=pm, other=0.0), axis=0) * r
        s0 = tl.load(scale)
        s1 = tl.load(scale + 1)
        s2 = tl.load(scale + 2)
        pre = tl.sigmoid(pre_p * s0 + tl.load(base + i, mask=vi, other=0.0)) + hc_eps
        pre = tl.where(vi, pre, 0.0)
        post = 2.0 * tl.sigmoid(post_p * s1 + tl.load(base + N + i, mask=vi, other=0.0))
        # comb: the N x N logits summed over the splits as a [BS, BN, BN] tile
        ri = i[:, None]
        ci = i[None, :]
        m = (ri < N) & (ci < N)
        off = 2 * N + ri * N + ci
        comb_p = tl.sum(tl.load(rows[:, None, None] + off[None, :, :], mask=sm[:, None, None] & m[None, :, :],
                                other=0.0), axis=0) * r
        logits = tl.where(m, comb_p * s2 + tl.load(base + off, mask=m, other=0.0), float("-inf"))
        top = tl.max(logits, axis=1)
        e = tl.where(m, tl.exp(logits - tl.where(top > float("-inf"), top, 0.0)[:, None]), 0.0)
        comb = tl.where(m, e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        first = (i * 0 + j) == 0  # only the first block of channels writes the gates
        tl.store(post_out + t * N + i, post.to(post_out.dtype.element_ty), mask=vi & first)
        tl.store(comb_out + t * N * N + ri * N + ci, comb.to(comb_out.dtype.element_ty), mask=m & first[:, None])
        d = j * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(streams + t * K + i[:, None] * D + d[None, :], mask=vi[:, None] & dm[None, :], other=0.0)
        tl.store(h_out + t * D + d, tl.sum(pre[:, None] * x.to(tl.float32), axis=0).to(h_out.dtype.element_ty),
                 mask=dm)

    @triton.jit
    def _hc_post_kernel(block_out, streams, post, comb, out, D,
                        N: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        j = tl.program_id(1)
        i = tl.arange(0, BN)
        vi = i < N
        d = j * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = d < D
        sm = vi[:, None] & dm[None, :]
        x = tl.load(streams + t * N * D + i[:, None] * D + d[None, :], mask=sm, other=0.0).to(tl.float32)
        h = tl.load(block_out + t * D + d, mask=dm, other=0.0).to(tl.float32)
        p = tl.load(post + t * N + i, mask=vi, other=0.0).to(tl.float32)
        # c[j, i] for source stream j (axis 0) and destination i (axis 1)
        c = tl.load(comb + t * N * N + i[:, None] * N + i[None, :], mask=vi[:, None] & vi[None, :],
                    other=0.0).to(tl.float32)
        mixed = tl.sum(c[:, :, None] * x[:, None, :], axis=0)
        y = p[:, None] * h[None, :] + mixed
        tl.store(out + t * N * D + i[:, None] * D + d[None, :], y.to(out.dtype.element_ty), mask=sm)


def _pow2_at_least(n: int, least: int = 2) -> int:
    return max(triton.next_power_of_2(n), least)


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """Two launches: the projection, then norm + gates + Sinkhorn + collapse (module docstring)."""
    if (not _runs_here(streams, fn, base, scale) or streams.dtype not in _FLOATS or fn.dtype not in _FLOATS
            or streams.dim() != 3 or sinkhorn_iters < 1):
        return OPS["hc_pre"].reference(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    t, n, d = streams.shape
    k, w = n * d, fn.shape[0]
    streams, fn = streams.contiguous(), fn.contiguous()
    base, scale = base.float().contiguous(), scale.float().contiguous()
    if t <= _SPLIT_TOKENS:
        splits, pw = triton.cdiv(k, _BLOCK_K), _pow2_at_least(w)
        part = torch.empty(t, splits, pw, dtype=torch.float32, device=streams.device)
        part_sq = torch.empty(t, splits, dtype=torch.float32, device=streams.device)
        if t:
            _hc_proj_kernel[(t, splits)](streams, fn, part, part_sq, k, w, splits, BW=pw, BLOCK_K=_BLOCK_K)
    else:
        flat = streams.view(t, k).float()
        splits, pw = 1, w
        part, part_sq = flat @ fn.float().t(), flat.square().sum(-1)
    post = torch.empty(t, n, dtype=streams.dtype, device=streams.device)
    comb = torch.empty(t, n, n, dtype=streams.dtype, device=streams.device)
    h = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        block_d = min(_BLOCK_D, _pow2_at_least(d, 16))
        _hc_mix_kernel[(t, triton.cdiv(d, block_d))](
            streams, part, part_sq, base, scale, post, comb, h, k, splits, pw, d, float(norm_eps), float(hc_eps),
            int(sinkhorn_iters), N=n, BN=_pow2_at_least(n), BS=_pow2_at_least(splits), BLOCK_D=block_d,
            num_warps=1)  # the Sinkhorn iterations are chains of reductions over 4 x 4: cheapest in one warp
    return post, comb, h


def hc_post(block_out, streams, post, comb):
    """One launch: every new stream from the block output and the old streams (module docstring)."""
    if (not _runs_here(block_out, streams, post, comb) or streams.dtype not in _FLOATS or streams.dim() != 3
            or not block_out.dtype == post.dtype == comb.dtype == streams.dtype):
        return OPS["hc_post"].reference(block_out, streams, post, comb)
    t, n, d = streams.shape
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t:
        block_d = min(_BLOCK_D // 2, _pow2_at_least(d, 16))
        _hc_post_kernel[(t, triton.cdiv(d, block_d))](block_out.contiguous(), streams.contiguous(), post.contiguous(),
                                                      comb.contiguous(), out, d, N=n, BN=_pow2_at_least(n),
                                                      BLOCK_D=block_d)
    return out
