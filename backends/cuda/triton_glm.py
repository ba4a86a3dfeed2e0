"""Triton kernels for GLM-5.3-Flash's DSA decode step: the kpool indexer and the latent attention.

The references (`flagdeploy/ops/glm.py`) are vectorised torch with no host reads, but each is a chain of
small kernels per indexed layer (casts, views, softmax, einsums, masked_fill, topk, scatter,
repeat_interleave, ...) whose launch latency dominates a replayed decode graph at batch 1..8. Here:

- `dsa_indexer_topk_decode`: `_pool_scores_kernel` compresses a block of complete pools (per-channel
  online softmax over the pool's rows of gate + ape, times the keys) and scores them against every
  index head in one float32 dot, visibility applied as -inf; `_pool_select_kernel` ranks each pool
  against all the sequence's scores (the top k_sel are those with fewer than k_sel better) and writes
  the 0/1 mask over positions, the tail included. While every pool fits the top-k budget (contexts up
  to index_topk tokens) the ranking selects every visible pool: the scores are then not computed.
- `latent_attention_decode`: flash-decoding over the shared latent: a program per (sequence, block of
  heads, split of the context) walks the context in tiles, skips tiles that select nothing (their
  latent rows are not read), and keeps an online softmax with the heads' queries in one tensor-core
  dot; split contexts are combined by triton_decode's `_paged_combine_kernel`.

Launch shapes come from tensor shapes only (never lengths' values), so both run inside CUDA graph
capture. Inputs the kernels were not written for (float64, latent ranks that are not powers of two,
tensors off the GPU) run the references.
"""

from __future__ import annotations

import torch

from flagdeploy.ops.registry import OPS

from .triton_decode import _FLOATS, _LOG2E, _SMS, _paged_combine_kernel, _pow2, _runs_here

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None


# ---- DSA kpool indexer: pool scores, then the top-k selection as a 0/1 mask ------------------------------

if triton is not None:

    @triton.jit
    def _pool_scores_kernel(q, hw, keys, gate, ape, lens, scores, sq_b, sq_h, sw_b, sk_b, sk_s, sg_b, sg_s, sa_p,
                            HI, D, NP, qk_scale, w_scale, P: tl.constexpr, BHI: tl.constexpr, BD: tl.constexpr,
                            BP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pools = tl.program_id(1) * BP + tl.arange(0, BP)
        d = tl.arange(0, BD)
        dm = d < D
        tm = (pools < NP)[:, None] & dm[None, :]
        # per channel, softmax over the pool's P rows of gate + ape, online (each row read once); the
        # pipelined loop keeps the next rows' loads in flight (H200: 13 us against 17 for a plain loop)
        m = tl.full([BP, BD], float("-inf"), dtype=tl.float32)
        den = tl.zeros([BP, BD], dtype=tl.float32)
        num = tl.zeros([BP, BD], dtype=tl.float32)
        for j in tl.range(0, P, num_stages=3):
            row = (pools * P + j).to(tl.int64)[:, None]
            x = tl.load(gate + b * sg_b + row * sg_s + d[None, :], mask=tm, other=0.0).to(tl.float32)
            x += tl.load(ape + j * sa_p + d, mask=dm, other=0.0).to(tl.float32)[None, :]
            k = tl.load(keys + b * sk_b + row * sk_s + d[None, :], mask=tm, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, x)
            alpha = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            den = den * alpha + e
            num = num * alpha + e * k
            m = m_new
        pool_keys = num / den  # [BP, BD]
        h = tl.arange(0, BHI)
        hm = h < HI
        qv = tl.load(q + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        # float32 products as the reference's: the top-k below must pick the pools it picks
        per_head = tl.dot(qv.to(tl.float32), tl.trans(pool_keys), input_precision="ieee")  # [BHI, BP]
        w = tl.load(hw + b * sw_b + h, mask=hm, other=0.0).to(tl.float32) * w_scale
        s = tl.sum(tl.maximum(per_head * qk_scale, 0.0) * w[:, None], axis=0)
        visible = (pools + 1) * P <= tl.load(lens + b)  # the pool ends at or before the query (length - 1)
        tl.store(scores + b * NP + pools, tl.where(visible, s, float("-inf")), mask=pools < NP)

    @triton.jit
    def _pool_select_kernel(scores, lens, out, so_b, S, NP, K_SEL, P: tl.constexpr, BP: tl.constexpr,
                            BPP: tl.constexpr, BJ: tl.constexpr, TOPK: tl.constexpr, TAIL: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pools = tl.program_id(1) * BP + tl.arange(0, BP)
        n = tl.load(lens + b)
        chosen = ((pools + 1) * P <= n) & (pools < NP)  # visible complete pools
        if TOPK:
            # a pool is among the top K_SEL when fewer than K_SEL pools beat it (equal scores: the lower
            # index wins), which picks what topk picks wherever the scores have no ties
            s_i = tl.load(scores + b * NP + pools, mask=pools < NP, other=float("-inf"))
            better = tl.zeros([BP], dtype=tl.int32)
            for start in range(0, NP, BJ):
                j = start + tl.arange(0, BJ)
                s_j = tl.load(scores + b * NP + j, mask=j < NP, other=float("-inf"))
                beats = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < pools[:, None]))
                better += tl.sum((beats & (j < NP)[None, :]).to(tl.int32), axis=1)
            chosen = chosen & (better < K_SEL)
        i = tl.arange(0, BPP)[None, :]
        col = pools[:, None] * P + i
        cm = (i < P) & (col < S)
        sel = chosen[:, None] & cm
        if TAIL:  # the query's own incomplete pool: positions n - n % P .. n - 1
            sel = sel | ((col >= n - n % P) & (col < n))
        # through float32: the interpreter casts int1 straight to bf16 bits (1 -> 9e-41)
        tl.store(out + b * so_b + col, tl.where(sel, 1.0, 0.0).to(out.dtype.element_ty), mask=cm)


_SCORE_POOLS = 16  # pools per scoring program (the dot's N: at least 16)
_SELECT_POOLS = 16  # pools per selecting program (H200: 16 a little faster than 64 or 128)
_RANK_BLOCK = 128  # competing scores compared per step of the ranking


def _pool_scores(q, head_weights, keys, gate, ape, lengths) -> torch.Tensor:
    """[B, S // P] float32: the score of each complete pool, -inf where it ends after the query."""
    p = ape.shape[0]
    b, s, d = keys.shape
    hi, n_pools = q.shape[1], s // p
    scores = torch.empty(b, n_pools, dtype=torch.float32, device=q.device)
    if b and n_pools:
        _pool_scores_kernel[(b, triton.cdiv(n_pools, _SCORE_POOLS))](
            q, head_weights, keys, gate, ape, lengths, scores, q.stride(0), q.stride(1), head_weights.stride(0),
            keys.stride(0), keys.stride(1), gate.stride(0), gate.stride(1), ape.stride(0), hi, d, n_pools,
            d**-0.5, hi**-0.5, P=p, BHI=max(16, triton.next_power_of_2(hi)), BD=max(16, triton.next_power_of_2(d)),
            BP=_SCORE_POOLS, num_warps=8)
    return scores


def dsa_indexer_topk_decode(q, head_weights, keys, gate, ape, lengths, index_topk, select_tail):
    """The reference's mask, in at most two kernels: the pool scores (float32, as the reference computes
    them) only when the top-k budget leaves some visible pool out, then the selection and the tail."""
    ok = (_runs_here(q, head_weights, keys, gate, ape, lengths) and q.dim() == 3 and keys.dim() == 3
          and all(x.dtype in _FLOATS for x in (q, head_weights, keys, gate, ape))
          and not lengths.is_floating_point() and lengths.shape == (q.shape[0],)
          and head_weights.shape == q.shape[:2] and keys.shape[0] == q.shape[0] and gate.shape == keys.shape
          and ape.dim() == 2 and ape.shape[1] == keys.shape[2] == q.shape[2] and ape.shape[0] > 0
          and q.shape[2] <= 256 and q.shape[1] <= 128)
    if not ok:
        return OPS["dsa_indexer_topk_decode"].reference(q, head_weights, keys, gate, ape, lengths, index_topk,
                                                        select_tail)
    p = ape.shape[0]
    b, s, _ = keys.shape
    n_pools = s // p
    k_sel = min(index_topk // p, n_pools)
    out = torch.empty(b, s, dtype=q.dtype, device=q.device)
    if not b or not s:
        return out
    q, head_weights, keys, gate, ape, lengths = (x if x.stride(-1) == 1 else x.contiguous()
                                                 for x in (q, head_weights, keys, gate, ape, lengths))
    topk = 0 < k_sel < n_pools
    scores = _pool_scores(q, head_weights, keys, gate, ape, lengths) if topk else out  # (out: not read)
    # without the ranking every visible pool is chosen, or none (k_sel == 0: NP = 0 leaves none visible)
    _pool_select_kernel[(b, triton.cdiv(triton.cdiv(s, p), _SELECT_POOLS))](
        scores, lengths, out, out.stride(0), s, n_pools if k_sel else 0, k_sel, P=p, BP=_SELECT_POOLS,
        BPP=triton.next_power_of_2(p), BJ=_RANK_BLOCK, TOPK=topk, TAIL=bool(select_tail), num_warps=4)
    return out


# ---- absorbed-MLA decode attention over the selected latent rows -----------------------------------------

if triton is not None:

    @triton.jit
    def _latent_decode_kernel(q, lat, mask, out, part_o, part_lse, scale_log2, sq_b, sq_h, sl_b, sl_s, sm_b, so_b,
                              so_h, H, S, ROWS, NSPLIT, R: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                              BN: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        sp = tl.program_id(2)
        hm = heads < H
        r = tl.arange(0, BR)
        rm = r < R
        qv = tl.load(q + b * sq_b + heads[:, None] * sq_h + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        if DOT_F32:  # the interpreter's tl.dot mishandles bf16 operands: float32 there (never on a GPU)
            qv = qv.to(tl.float32)
        lo = sp * ROWS  # this program's rows: [lo, hi)
        hi = tl.minimum(lo + ROWS, S)
        m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, BR], dtype=tl.float32)
        for start in range(lo, hi, BN):
            n = start + tl.arange(0, BN)
            sel = tl.load(mask + b * sm_b + n, mask=n < hi, other=0) != 0
            if tl.max(sel.to(tl.int32), axis=0) > 0:  # a tile that selects nothing is not read
                kv = tl.load(lat + b * sl_b + n.to(tl.int64)[:, None] * sl_s + r[None, :],
                             mask=sel[:, None] & rm[None, :], other=0.0)
                if DOT_F32:
                    kv = kv.to(tl.float32)
                s = tl.dot(qv, tl.trans(kv), input_precision=PREC) * scale_log2  # [BH, BN], log2 units
                s = tl.where(sel[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile selects a row
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PREC)
                m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # nothing selected: zeros
        om = hm[:, None] & rm[None, :]
        if SPLIT:
            # an empty split gets a log-sum-exp far below any real one rather than -inf: the combine then
            # gives it weight 0 beside a non-empty split, and a sequence with no row at all gets zeros
            slot = (b * H + heads) * NSPLIT + sp
            tl.store(part_o + slot[:, None] * R + r[None, :], o, mask=om)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), -1e30)
            tl.store(part_lse + slot, lse, mask=hm)
        else:
            tl.store(out + b * so_b + heads[:, None] * so_h + r[None, :], o.to(out.dtype.element_ty), mask=om)


# Launch shapes, (query heads per program, latent rows per step, warps), from a sweep on the H200 at
# GLM-5.3-Flash's dims (64 heads, rank 512, bf16, masks from the indexer's top 2,048 tokens, CUDA graph
# replay): while there are few sequences, blocks of 16 heads give the SMs more programs (1 x 4,096 rows:
# 20 us, against 33 with all 64 heads in one program); from 4 sequences and 32K rows in all, one program
# for all heads reads each latent row once, with larger tensor-core tiles (8 x 4,096 rows: 37 us against 48).
_LATENT_SMALL = (16, 64, 4)
_LATENT_LARGE = (64, 32, 8)
_SPLIT_ROWS = 64  # rows a split keeps at least
_MAX_SPLITS = 16  # more splits (up to 128) measured no faster: every program pays the tile latency anyway


def _latent_launch(b: int, h: int, s: int) -> tuple[int, int, int, int]:
    """(heads per program, rows per step, warps, rows per split): from shapes only (capturable)."""
    bh, bn, warps = _LATENT_LARGE if b >= 4 and b * s >= 32768 else _LATENT_SMALL
    bh = min(bh, max(16, triton.next_power_of_2(h)))  # (the dot's M is at least 16)
    splits = max(1, min(triton.cdiv(s, _SPLIT_ROWS), triton.cdiv(2 * _SMS, b * triton.cdiv(h, bh)), _MAX_SPLITS))
    return bh, bn, warps, triton.cdiv(triton.cdiv(s, splits), bn) * bn


def latent_attention_decode(q, latent, mask, scale):
    """One kernel (two when the context is split: few sequences, long contexts), the reference's float32
    softmax; float32 inputs get exact float32 dots (no TF32)."""
    r = q.shape[-1]
    ok = (_runs_here(q, latent, mask) and q.dim() == 3 and latent.dim() == 3 and mask.dim() == 2
          and q.dtype in _FLOATS and latent.dtype == q.dtype and latent.shape[0] == q.shape[0]
          and latent.shape[2] == r and mask.shape == latent.shape[:2] and _pow2(r) and r <= 1024)
    if not ok:
        return OPS["latent_attention_decode"].reference(q, latent, mask, scale)
    b, h, _ = q.shape
    s = latent.shape[1]
    if not b or not s:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    q, latent, mask = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, latent, mask))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bh, bn, warps, rows = _latent_launch(b, h, s)
    splits = triton.cdiv(s, rows)
    part_o = part_lse = out  # unused without a split
    if splits > 1:
        part_o = torch.empty(b, h, splits, r, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _latent_decode_kernel[(b, triton.cdiv(h, bh), splits)](
        q, latent, mask, out, part_o, part_lse, float(scale) * _LOG2E, q.stride(0), q.stride(1), latent.stride(0),
        latent.stride(1), mask.stride(0), out.stride(0), out.stride(1), h, s, rows, splits, R=r, BR=max(16, r),
        BH=bh, BN=bn, SPLIT=splits > 1, DOT_F32=not q.is_cuda,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps)  # (PREC: read for float32 dots only)
    if splits > 1:
        _paged_combine_kernel[(b, h)](part_o, part_lse, out, out.stride(0), out.stride(1), h, splits, D=r,
                                      BSPLIT=triton.next_power_of_2(splits), num_warps=1)
    return out
