"""The MoE layers' sigmoid router for decode steps, as two Triton kernels (issue 11).

torch's version is ~15 launches per MoE layer at batch 1 on an H200 (a float32 copy of the router
weight every step, the GEMV, sigmoid, bias add, a radix top-k and a bitonic sort, gather, sum, divide,
scale, zeros, scatter, cast: ~35 us). Here:

- `_router_logits_kernel`: x . w_e in float32, a program per block of experts and block of hidden
  channels (its partial sums: at one token a program per block of experts alone left most of the GPU
  idle, 15 us for GLM-5.3-Flash's 288 x 6144 weight), reading the weight in its own dtype.
- `_router_select_kernel`: a program per token adds the partial sums up, takes the sigmoid, takes the
  top_k of the biased scores by repeated argmax (ties to the lower expert id), renormalises the
  unbiased scores of the chosen experts and writes the dense routing row, zero elsewhere, as the
  reference does.

Only the one-group case (GLM-5.3-Flash: n_group = topk_group = 1), where the group ranking selects every
expert; other configurations run the cuda backend's torch version. Launch shapes come from tensor
shapes only (CUDA graph capture); `TRITON_INTERPRET=1` runs them on CPU tensors.
"""

from __future__ import annotations

import torch

from .triton_decode import _FLOATS, _runs_here

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

_BLOCK_E = 16  # experts per logits program (GLM-5.3-Flash at one token: 144 programs)
_BLOCK_H = 512  # hidden channels per logits program

if triton is not None:

    @triton.jit
    def _router_logits_kernel(x, w, part, E, H, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        s = tl.program_id(2)
        h = s * BLOCK_H + tl.arange(0, BLOCK_H)
        em = e < E
        hm = h < H
        xv = tl.load(x + t * H + h, mask=hm, other=0.0).to(tl.float32)
        wv = tl.load(w + e[:, None] * H + h[None, :], mask=em[:, None] & hm[None, :], other=0.0).to(tl.float32)
        tl.store(part + (t * tl.num_programs(2) + s) * E + e, tl.sum(wv * xv[None, :], axis=1), mask=em)

    @triton.jit
    def _router_select_kernel(part, bias, out, E, S, factor, TOP: tl.constexpr, NORM: tl.constexpr,
                              BE: tl.constexpr, BS: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, BE)
        em = e < E
        sp = tl.arange(0, BS)  # every split's partial sums in one load (a loop of loads waits on each)
        logits = tl.load(part + (t * S + sp[:, None]) * E + e[None, :], mask=(sp[:, None] < S) & em[None, :], other=0.0)
        s = tl.sigmoid(tl.sum(logits, axis=0))
        biased = tl.where(em, s + tl.load(bias + e, mask=em, other=0.0).to(tl.float32), float("-inf"))
        chosen = e < 0
        for _ in tl.static_range(TOP):
            best = tl.argmax(biased, axis=0)
            chosen = chosen | (e == best)
            biased = tl.where(e == best, float("-inf"), biased)
        w = tl.where(chosen, s, 0.0)
        if NORM:
            w = w / (tl.sum(w, axis=0) + 1e-20)
        tl.store(out + t * E + e, (w * factor).to(out.dtype.element_ty), mask=em)


def supports(x, weight, correction_bias, top_k, n_group) -> bool:
    return (n_group == 1 and _runs_here(x, weight, correction_bias) and x.dtype in _FLOATS
            and weight.dtype in _FLOATS and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and 0 < top_k <= weight.shape[0] <= 1024)


def moe_router(x, weight, correction_bias, top_k, norm_topk_prob, routed_scaling_factor):
    """Dense routing weights [T, E] in x's dtype (module docstring); the caller checked `supports`."""
    t, h = x.shape
    e = weight.shape[0]
    x, weight, bias = x.contiguous(), weight.contiguous(), correction_bias.contiguous()
    splits = triton.cdiv(h, _BLOCK_H)
    part = torch.empty(t, splits, e, dtype=torch.float32, device=x.device)
    out = torch.empty(t, e, dtype=x.dtype, device=x.device)
    if t:
        _router_logits_kernel[(t, triton.cdiv(e, _BLOCK_E), splits)](x, weight, part, e, h, BLOCK_E=_BLOCK_E,
                                                                     BLOCK_H=_BLOCK_H)
        _router_select_kernel[(t,)](part, bias, out, e, splits, float(routed_scaling_factor), TOP=int(top_k),
                                    NORM=bool(norm_topk_prob), BE=triton.next_power_of_2(e),
                                    BS=max(triton.next_power_of_2(splits), 2))
    return out
