"""Routed experts with FP8 block-scaled weights for decode steps, as Triton kernels (issue 11).

A decode step routes a few tokens to top_k experts each, so the step is bound by reading the picked
experts' weights once. The weights stay as the checkpoint stores them (e4m3, one float32 inverse scale
per block of block[0] x block[1]): half the bytes of bf16. Five launches, whatever the routing:

- `_act_quant_kernel` with TOP: each token's top_k experts (the largest |routing|, ids and weights) and
  its activations rounded to e4m3 exactly as the reference does (per token and group of block[1]
  channels, absmax at 448: what an FP8 matrix unit consumes), as codes and float32 scales.
- `_moe_fp8_kernel` with GATED: the gate and up rows of the pairs' experts, raw float32 sums
  [SPLIT, P, 2I] (SPLIT programs share the input channels, each writing its partial sums).
- `_act_quant_kernel` with SWIGLU: the splits added up, the clamped SwiGLU, and the result rounded to
  e4m3 again, as the reference's second linear quantises its input (from float32: a 16-bit rounding
  first would move values across e4m3 steps).
- `_moe_fp8_kernel` without GATED: the down projection, [SPLIT, P, H] float32.
- `_combine_kernel`: each token's pairs (and splits) weighted and summed.

`_moe_fp8_kernel` handles the pairs of one expert together: the program of the pair that comes first
among its expert's pairs (in slot order; a program per BLOCK_M of them) takes all of them, the others find
they are not first and do nothing, so a weight tile is read once however many tokens picked its expert.
Each program takes BLOCK_N output rows of its expert and walks the input in steps of one scale block:
the e4m3 weight tile times the pairs' e4m3 activation codes on the tensor cores (`tl.dot`, FP8 x FP8 with
float32 out; through fp16 for blocks under 32 channels: the products of two e4m3 values are exact either
way), that block's partial sums times the two scales (weight block, activation group) added to a
float32 accumulator. The activations are quantised once, before: the loop only loads and multiplies,
and the pipeliner keeps several weight tiles in flight.

The pair count is t * top_k and the grouping by expert happens inside the kernels: nothing is read back
to the host and the launch count is fixed, so a decode step with these kernels is captured in the CUDA
graph. With `TRITON_INTERPRET=1` they run on CPU tensors (tests/test_triton_kernels.py).
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

# Launch shapes by the number of (token, expert) pairs: (most pairs, gate_up, down), each
# (output rows per program, warps, stages, input splits). Measured on the H200 at GLM-5.3-Flash's expert
# shapes with `benchmarks/cuda_moe_fp8.py --sweep`: 64 or 128 rows with 4 warps, 3 to 6 stages all within
# ~2%; 32 rows were slower, and splitting the input did not help even at one token (8 pairs).
LAUNCH = (
    (16, (64, 4, 4, 1), (64, 4, 4, 1)),
    (None, (64, 4, 6, 1), (128, 4, 4, 1)),
)
BLOCK_M = 16  # pairs of one expert per program (tl.dot's smallest tile); more pairs: more programs
FORCED: dict | None = None  # {"gate_up": (rows, warps, stages, splits), "down": ...}: set by the sweep


def launch_config(pairs: int, gated: bool) -> dict:
    which = "gate_up" if gated else "down"
    row = next(row for row in LAUNCH if row[0] is None or pairs <= row[0])
    cfg = (FORCED or {}).get(which) or row[1 if gated else 2]
    bn, warps, stages, split = cfg
    return {"block_n": bn, "num_warps": warps, "num_stages": stages, "split": split}


if triton is not None:

    @triton.jit
    def _quant_e4m3(v, fp8_max):
        """Activations `v` [rows, group] (one scale block of input channels per row) rounded to e4m3 as
        torch's cast does it (round half to even, subnormals below 2^-6), in float32 arithmetic: the
        exponent is read from the bits, so the grid is exact on any GPU and in the interpreter. Returns
        the codes (e4m3, exact) and each row's scale."""
        scale = tl.maximum(tl.max(tl.abs(v), 1) / fp8_max, 1e-12).to(tl.float32)  # fp8_max may arrive as fp64
        a = (tl.abs(v) / scale[:, None]).to(tl.float32)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # e4m3 keeps 3 mantissa bits
        r = a / step
        f = tl.floor(r)
        d = r - f
        up = (d > 0.5) | ((d == 0.5) & ((f.to(tl.int32) & 1) == 1))
        q = tl.where(up, f + 1.0, f) * step
        return tl.where(v < 0, -q, q).to(tl.float8e4nv), scale

    @triton.jit
    def _swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _act_quant_kernel(src, q, sc, R, K, limit, fp8_max, routing, s_rt, E, ids, wts,
                          BC: tl.constexpr, GROUPS: tl.constexpr, SPLIT_IN: tl.constexpr,
                          SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, TOP: tl.constexpr, E_PAD: tl.constexpr):
        """One row's activations, GROUPS scale groups of BC channels, as e4m3 codes [R, K] and float32
        scales [R, cdiv(K, BC)]. With SWIGLU the row is gate_up's raw gate and up sums, [SPLIT_IN, R, 2K]:
        the splits are added up and the clamped SwiGLU applied first.

        With TOP > 0 the rows are tokens, and the first program of each also picks the token's TOP experts:
        the largest |routing| (the lowest index among equals), ids and weights [R * TOP].
        A pick of weight zero (the row has fewer nonzeros) names the token's first pick again, so that its
        (zero) share costs no weights of another expert."""
        r = tl.program_id(0)
        if TOP > 0:
            if tl.program_id(1) == 0:
                cand = tl.arange(0, E_PAD)
                rw = tl.load(routing + r.to(tl.int64) * s_rt + cand, mask=cand < E, other=0.0).to(tl.float32)
                left = tl.where(cand < E, tl.abs(rw), -1.0)
                first = 0
                for j in tl.static_range(TOP):
                    top = tl.max(left, 0)
                    at = tl.minimum(tl.min(tl.where(left == top, cand, E_PAD), 0), E - 1)  # (NaN: no match)
                    wt = tl.sum(tl.where(cand == at, rw, 0.0), 0)
                    left = tl.where(cand == at, -1.0, left)
                    if j == 0:
                        first = at
                    tl.store(ids + r * TOP + j, tl.where(top > 0, at, first).to(ids.dtype.element_ty))
                    tl.store(wts + r * TOP + j, tl.where(top > 0, wt, 0.0))
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        rk = g[:, None] * BC + tl.arange(0, BC)[None, :]
        m = rk < K
        if SWIGLU:
            gate = tl.zeros([GROUPS, BC], dtype=tl.float32)
            up = tl.zeros([GROUPS, BC], dtype=tl.float32)
            for j in tl.static_range(SPLIT_IN):
                row = src + (j * R + r).to(tl.int64) * (2 * K)
                gate += tl.load(row + rk, mask=m, other=0.0)
                up += tl.load(row + K + rk, mask=m, other=0.0)
            v = _swiglu(gate, up, limit, HAS_LIMIT)
        else:
            v = tl.load(src + r.to(tl.int64) * K + rk, mask=m, other=0.0).to(tl.float32)
        codes, scale = _quant_e4m3(v, fp8_max)
        tl.store(q + r.to(tl.int64) * K + rk, codes, mask=m)
        ng = tl.cdiv(K, BC)
        tl.store(sc + r * ng + g, scale, mask=g < ng)

    @triton.jit
    def _moe_fp8_kernel(xq, xs, ids, w, s, out, P, K, N,
                        s_we, s_se, s_sn,
                        TOP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr):
        i = tl.program_id(0)
        split = tl.program_id(2)
        # the pairs of this slot's expert: this program runs if the slot is first of a group of BLOCK_M
        slots = tl.arange(0, P_PAD)
        picked = tl.load(ids + slots, mask=slots < P, other=-1)
        e32 = tl.load(ids + i)
        same = picked == e32
        rank = tl.sum((same & (slots < i)).to(tl.int32), 0)
        lead = (rank % BLOCK_M) == 0
        nth = tl.cumsum(same.to(tl.int32), 0) - 1
        hit = same[None, :] & (nth[None, :] == (rank + tl.arange(0, BLOCK_M))[:, None])
        pair = tl.sum(tl.where(hit, slots[None, :], 0), 1)  # [BLOCK_M] slots, 0 where none
        live = (tl.sum(hit.to(tl.int32), 1) > 0) & ((rank + tl.zeros([BLOCK_M], tl.int32)) % BLOCK_M == 0)

        e = e32.to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        cols = tl.arange(0, BC)
        w_rows = w + e * s_we + rn[:, None].to(tl.int64) * K
        s_rows = s + e * s_se + (rn // BR) * s_sn
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if GATED:  # the up rows sit N rows below the gate rows (fused gate_up, N = intermediate size)
            w_up = w_rows + N * K
            s_up = s + e * s_se + ((rn + N) // BR) * s_sn
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        src = pair // TOP  # the activation row of each pair: its token (gate_up) or itself (down)
        x_rows = xq + src.to(tl.int64) * K
        nkb = tl.cdiv(K, BC)
        sx_rows = xs + src * nkb
        per = tl.cdiv(nkb, SPLIT)
        kb0 = split * per
        kb1 = tl.where(lead, tl.minimum(kb0 + per, nkb), kb0)
        # the scales are loaded a step ahead (the pipeliner prefetches the dot's operands only)
        sg1 = tl.load(s_rows + kb0, mask=nmask & (kb0 + 0 * rn < kb1), other=0.0)
        sx1 = tl.load(sx_rows + kb0, mask=live & (kb0 + 0 * src < kb1), other=0.0)
        if GATED:
            su1 = tl.load(s_up + kb0, mask=nmask & (kb0 + 0 * rn < kb1), other=0.0)
        for kb in range(kb0, kb1):
            sg = sg1
            sx = sx1
            sg1 = tl.load(s_rows + kb + 1, mask=nmask & (kb + 1 + 0 * rn < kb1), other=0.0)
            sx1 = tl.load(sx_rows + kb + 1, mask=live & (kb + 1 + 0 * src < kb1), other=0.0)
            if GATED:
                su = su1
                su1 = tl.load(s_up + kb + 1, mask=nmask & (kb + 1 + 0 * rn < kb1), other=0.0)
            rk = kb * BC + cols
            kmask = rk < K
            xt = tl.trans(tl.load(x_rows[:, None] + rk[None, :], mask=live[:, None] & kmask[None, :], other=0.0))
            m2 = nmask[:, None] & kmask[None, :]
            wv = tl.load(w_rows + rk[None, :], mask=m2, other=0.0)
            if BC < 32:  # an FP8 dot takes 32 channels at a time: 16-channel blocks go through fp16 (exact)
                xt = xt.to(tl.float16)
                wv = wv.to(tl.float16)
            acc += tl.dot(wv, xt) * (sg[:, None] * sx[None, :])
            if GATED:
                wu = tl.load(w_up + rk[None, :], mask=m2, other=0.0)
                if BC < 32:
                    wu = wu.to(tl.float16)
                acc_up += tl.dot(wu, xt) * (su[:, None] * sx[None, :])
        om = live[None, :] & nmask[:, None]  # (no live pairs unless this program leads)
        width = 2 * N if GATED else N
        o = out + (split * P + pair[None, :]).to(tl.int64) * width + rn[:, None]
        tl.store(o, acc.to(out.dtype.element_ty), mask=om)
        if GATED:  # raw sums, [SPLIT, P, 2N]: the SwiGLU comes with the splits' sum, as down's input is quantised
            tl.store(o + N, acc_up.to(out.dtype.element_ty), mask=om)


    @triton.jit
    def _combine_kernel(y, wts, out, P, H, TOP: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = sum over the token's top_k pairs (and the splits) of routing weight x down's output."""
        t = tl.program_id(0)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = rh < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP):
            p = t * TOP + j
            part = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(SPLIT):
                part += tl.load(y + (k * P + p).to(tl.int64) * H + rh, mask=m, other=0.0)
            acc += part * tl.load(wts + p)
        tl.store(out + t.to(tl.int64) * H + rh, acc.to(out.dtype.element_ty), mask=m)


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


def _quantise(src, rows, k, bc, split_in, swiglu, limit, routing=None, top_k=0):
    """e4m3 codes [rows, k] and float32 scales [rows, cdiv(k, bc)] of the activations (`_act_quant_kernel`);
    with `routing`, also each row's top_k expert ids (int32) and weights (float32), [rows * top_k]."""
    ng = triton.cdiv(k, bc)
    groups = min(4, triton.next_power_of_2(ng))
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=src.device)
    sc = torch.empty(rows, ng, dtype=torch.float32, device=src.device)
    ids = torch.empty(rows * top_k, dtype=torch.int32, device=src.device)
    wts = torch.empty(rows * top_k, dtype=torch.float32, device=src.device)
    if routing is None:
        routing = sc  # not read
    elif routing.stride(1) != 1:
        routing = routing.contiguous()
    _act_quant_kernel[(rows, triton.cdiv(ng, groups))](
        src, q, sc, rows, k, float(limit) if limit is not None else 0.0, FP8_E4M3_MAX,
        routing, routing.stride(0), routing.shape[1], ids, wts,
        BC=bc, GROUPS=groups, SPLIT_IN=split_in, SWIGLU=swiglu, HAS_LIMIT=limit is not None,
        TOP=top_k, E_PAD=triton.next_power_of_2(routing.shape[1]), num_warps=4)
    return q, sc, ids, wts


def _launch(xq, xs, ids, bank: Fp8BlockWeight, out, n, top_k, gated, cfg):
    br, bc = bank.block
    s = bank.scale_inv.float().contiguous()
    pairs = ids.numel()
    grid = (pairs, triton.cdiv(n, cfg["block_n"]), cfg["split"])
    _moe_fp8_kernel[grid](xq, xs, ids, bank.q.contiguous(), s, out, pairs, xq.shape[1], n,
                          bank.q.shape[1] * bank.q.shape[2], s.shape[1] * s.shape[2], s.shape[2],
                          TOP=top_k if gated else 1, BR=br, BC=bc, BLOCK_N=cfg["block_n"], BLOCK_M=BLOCK_M,
                          P_PAD=triton.next_power_of_2(pairs), SPLIT=cfg["split"], GATED=gated,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def moe_fp8_experts(x: torch.Tensor, routing: torch.Tensor, gate_up: Fp8BlockWeight, down: Fp8BlockWeight,
                    limit: float | None, top_k: int) -> torch.Tensor:
    """`moe_experts` for FP8 banks: each token's top_k experts (zero-weight picks add nothing)."""
    t, inter, hidden = x.shape[0], down.in_features, down.out_features
    pairs = t * top_k
    cg, cd = launch_config(pairs, True), launch_config(pairs, False)
    # the token's picks (token-major pairs) and its activations as e4m3, in one kernel
    xq, xs, ids, wts = _quantise(x.contiguous(), t, hidden, gate_up.block[1], 1, False, None, routing, top_k)
    # raw gate and up sums in float32 per split: down quantises the SwiGLU of their sum, a 16-bit rounding
    # first would move values across e4m3 steps
    h = torch.empty(cg["split"], pairs, 2 * inter, dtype=torch.float32, device=x.device)
    _launch(xq, xs, ids, gate_up, h, inter, top_k, True, cg)
    hq, hs, _, _ = _quantise(h, pairs, inter, down.block[1], cg["split"], True, limit)
    y = torch.empty(cd["split"], pairs, hidden, dtype=torch.float32, device=x.device)
    _launch(hq, hs, ids, down, y, hidden, top_k, False, cd)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    block_h = min(512, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](y, wts, out, pairs, hidden, TOP=top_k, SPLIT=cd["split"],
                                                       BLOCK_H=block_h, num_warps=4)
    return out
