"""Triton kernels for the small ops between a decode step's GEMMs (issue 11).

With one stream the step is bandwidth-bound on the weights, and cuBLAS reads them at 76-100% of copy
bandwidth; what kept the engine at 47% of the limit was the ~30 small torch kernels per layer between
the matmuls (casts, cats, chunks, index_select gathers, SDPA's several launches), each a few µs of
launch latency in the replayed CUDA graph. Here each op is one kernel:

- `rms_norm` / `add_rms_norm`: one program per row does the residual add, the float32 reduction, the
  cast back and the weight multiply (rounding where the reference rounds: after the add and before
  the weight multiply, so bf16 results match it bit for bit in most elements);
- `rope`: one program per token rotates every q and k head (rotate-half layout) into two fresh
  contiguous tensors, reading the strided q/k views of the fused qkv output directly (no copies);
- `swiglu`: silu(gate) * up (with GLM/gpt-oss's `limit` clamps) in one pass;
- `write_kv_cache`: one program per token stores its k and v rows at its slot;
- `paged_attention_decode`: one program per (sequence, kv head) walks the sequence's keys through its
  block table, `BLOCK_N` keys a step (gathering each key's block, so any block size works), with an
  online softmax, all query heads of the GQA group in one tensor-core dot (padded to 16 rows); with few
  sequences and long contexts the keys are split over more programs and a second small kernel combines
  the partial softmaxes (flash-decoding), so that a single stream does not run on 8 of 132 SMs.

No kernel reads anything back to the host, so all of them run inside CUDA graph capture. Inputs a
kernel was not written for (CPU tensors, float64, head sizes that are not powers of two, ...) go to
the shared fused implementations (`flagdeploy.ops.fused`), which follow the reference. With
`TRITON_INTERPRET=1` the kernels also take CPU tensors, so tests/test_triton_kernels.py checks them
on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch

from flagdeploy.ops import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

_HALF = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _runs_here(*xs: torch.Tensor) -> bool:
    """Triton can launch on these tensors: all on a CUDA device, or all on the CPU under the interpreter."""
    if triton is None:
        return False
    if all(x.is_cuda for x in xs):
        return True
    return _interpret() and all(x.device.type == "cpu" for x in xs)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ---- RMSNorm, with or without the residual add ----------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x, res, w, out, res_out, sx, sr, so, sro, eps,
                         D: tl.constexpr, BD: tl.constexpr, HAS_RES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        h = tl.load(x + row * sx + d, mask=m, other=0.0)
        if HAS_RES:
            # x + residual rounded to the input dtype first: the reference adds in that dtype
            h = (h.to(tl.float32) + tl.load(res + row * sr + d, mask=m, other=0.0).to(tl.float32)).to(h.dtype)
            tl.store(res_out + row * sro + d, h, mask=m)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        y = (hf * inv).to(h.dtype).to(tl.float32)  # the reference casts back before the weight multiply
        wv = tl.load(w + d, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * so + d, (wv * y).to(out.dtype.element_ty), mask=m)


def _norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_runs_here(x, weight) and x.dtype in _FLOATS and weight.dtype in _FLOATS and x.dim() >= 1
            and weight.shape == (x.shape[-1],) and 0 < x.shape[-1] <= 65536)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with a unit last stride, copying only when it cannot be viewed so."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(d: int) -> int:
    return 8 if d >= 4096 else 4 if d >= 1024 else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _norm_ok(x, weight):
        return fused.rms_norm(x, weight, eps)
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        o2 = out.view(-1, d)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, o2, o2, x2.stride(0), x2.stride(0), o2.stride(0),
                                         o2.stride(0), float(eps), D=d, BD=triton.next_power_of_2(d),
                                         HAS_RES=False, num_warps=_norm_warps(d))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel: one read of each input, two writes."""
    if (not _norm_ok(x, weight) or not _runs_here(residual) or residual.shape != x.shape
            or residual.dtype != x.dtype):
        return fused.add_rms_norm(x, residual, weight, eps)
    d = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        o2, h2 = out.view(-1, d), h.view(-1, d)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, o2, h2, x2.stride(0), r2.stride(0), o2.stride(0),
                                         h2.stride(0), float(eps), D=d, BD=triton.next_power_of_2(d),
                                         HAS_RES=True, num_warps=_norm_warps(d))
    return out, h


# ---- rotary embedding (rotate-half) ---------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rope_rotate(src, dst, t, c, s, s_t, s_h, o_t, o_h, NH, HALF: tl.constexpr, BH: tl.constexpr,
                     BHALF: tl.constexpr):
        hh = tl.arange(0, BH)[:, None]
        i = tl.arange(0, BHALF)[None, :]
        m = (hh < NH) & (i < HALF)
        p = src + t * s_t + hh * s_h + i
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        q = dst + t * o_t + hh * o_h + i
        tl.store(q, (f1 * c - f2 * s).to(dst.dtype.element_ty), mask=m)
        tl.store(q + HALF, (f2 * c + f1 * s).to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kernel(q, k, v, cos, sin, qo, ko, kc, vc, slots, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, ss_t, oq_t,
                     oq_h, ok_t, ok_h, H, KH, D: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BKH: tl.constexpr,
                     BHALF: tl.constexpr, BD: tl.constexpr, WRITE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BHALF)[None, :]
        c = tl.load(cos + t * sc_t + i, mask=i < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin + t * ss_t + i, mask=i < HALF, other=0.0).to(tl.float32)
        _rope_rotate(q, qo, t, c, s, sq_t, sq_h, oq_t, oq_h, H, HALF, BH, BHALF)
        _rope_rotate(k, ko, t, c, s, sk_t, sk_h, ok_t, ok_h, KH, HALF, BKH, BHALF)
        if WRITE:  # rope_write_kv: the rotated k (computed again: cheaper than a reload) and v at the slot
            slot = tl.load(slots + t).to(tl.int64)
            if slot >= 0:
                row = slot * KH * D
                _rope_rotate(k, kc + row, t, c, s, sk_t, sk_h, 0, D, KH, HALF, BKH, BHALF)
                hh = tl.arange(0, BKH)[:, None]
                d = tl.arange(0, BD)[None, :]
                m = (hh < KH) & (d < D)
                tl.store(vc + row + hh * D + d, tl.load(v + t * sv_t + hh * sv_h + d, mask=m, other=0.0), mask=m)


def _rope_ok(q, k, cos, sin) -> bool:
    return (_runs_here(q, k, cos, sin) and q.dim() == 3 and k.dim() == 3 and q.dtype in _FLOATS and k.dtype == q.dtype
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and q.shape[-1] % 2 == 0
            and k.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0] and cos.shape == (q.shape[0], q.shape[-1] // 2)
            and sin.shape == cos.shape and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
            and sin.stride(-1) == 1)


def _rope_launch(q, k, cos, sin, cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation kernel; with cache = (v, k_cache, v_cache, slots) it also stores the rotated k and v."""
    t, h, d = q.shape
    kh = k.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t:
        v, kc, vc, slots = cache if cache is not None else (k, k, k, k)  # not read without WRITE
        _rope_kernel[(t,)](q, k, v, cos, sin, qo, ko, kc, vc, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), qo.stride(0), qo.stride(1),
                           ko.stride(0), ko.stride(1), h, kh, D=d, HALF=d // 2, BH=triton.next_power_of_2(h),
                           BKH=triton.next_power_of_2(kh), BHALF=triton.next_power_of_2(d // 2),
                           BD=triton.next_power_of_2(d), WRITE=cache is not None, num_warps=4)
    return qo, ko


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by one kernel into fresh contiguous tensors (the reference's contract: inputs are
    left as they are); q/k may be strided views (the split of the fused qkv output), read in place."""
    if not _rope_ok(q, k, cos, sin):
        return fused.rope(q, k, cos, sin)
    return _rope_launch(q, k, cos, sin)


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """`rope` and `write_kv_cache` in one kernel: a program per token rotates its q and k heads and stores
    the rotated k and its v at its slot (one launch per layer fewer in a decode step)."""
    ok = (_rope_ok(q, k, cos, sin) and _runs_here(v, k_cache, v_cache, slot_mapping) and v.shape == k.shape
          and v.dtype == q.dtype and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v.stride(-1) == 1
          and k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[2:] == k.shape[1:]
          and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.shape == (k.shape[0],)
          and not slot_mapping.is_floating_point())
    if not ok:
        q, k = rope(q, k, cos, sin)
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k
    return _rope_launch(q, k, cos, sin, (v, k_cache, v_cache, slot_mapping))


# ---- SwiGLU ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _swiglu_kernel(gu, out, s_in, s_out, N, limit, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < N
        g = tl.load(gu + row * s_in + j, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + row * s_in + N + j, mask=m, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        # silu rounded to the output dtype before the multiply, as the reference's two torch ops round
        a = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + row * s_out + j, (a * u).to(out.dtype.element_ty), mask=m)


_SWIGLU_BLOCK = 1024


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    if not (_runs_here(gate_up) and gate_up.dtype in _FLOATS and gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0):
        return fused_swiglu(gate_up, limit)
    n = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] and n:
        o2 = out.view(-1, n)
        grid = (x2.shape[0], triton.cdiv(n, _SWIGLU_BLOCK))
        _swiglu_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), n, float(limit) if limit is not None else 0.0,
                             HAS_LIMIT=limit is not None, BLOCK=_SWIGLU_BLOCK, num_warps=4)
    return out


def fused_swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """The fallback: the reference itself (flagdeploy.ops.fused has no swiglu of its own)."""
    from flagdeploy.ops import reference

    return reference.swiglu(gate_up, limit)


# ---- KV cache write -------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _write_kv_kernel(k, v, kc, vc, slots, sk_t, sk_h, sv_t, sv_h, KH, D: tl.constexpr, BKH: tl.constexpr,
                         BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        hh = tl.arange(0, BKH)[:, None]
        d = tl.arange(0, BD)[None, :]
        m = (hh < KH) & (d < D)
        if slot >= 0:  # a negative slot (padding) writes nothing
            row = slot * KH * D + hh * D + d
            tl.store(kc + row, tl.load(k + t * sk_t + hh * sk_h + d, mask=m, other=0.0), mask=m)
            tl.store(vc + row, tl.load(v + t * sv_t + hh * sv_h + d, mask=m, other=0.0), mask=m)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    ok = (_runs_here(k, v, k_cache, v_cache, slot_mapping) and k.dim() == 3 and v.shape == k.shape
          and k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[2:] == k.shape[1:]
          and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and k_cache.is_contiguous()
          and v_cache.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
          and slot_mapping.shape == (k.shape[0],) and not slot_mapping.is_floating_point())
    if not ok:
        return fused.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    t, kh, d = k.shape
    if t:
        _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               kh, D=d, BKH=triton.next_power_of_2(kh), BD=triton.next_power_of_2(d), num_warps=4)
    return None


# ---- paged decode attention -----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(q, kc, vc, tables, lens, out, part_o, part_lse, scale_log2, sq_b, sq_h, st_b, so_b,
                             so_h, sc_blk, sc_off, sc_h, G, H, BS, KEYS, S, D: tl.constexpr, BG: tl.constexpr,
                             BN: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, BG)
        d = tl.arange(0, D)
        gm = g < G
        heads = kh * G + g
        qv = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gm[:, None], other=0.0)
        if DOT_F32:  # the interpreter's tl.dot mishandles bf16 operands: float32 there (never on a GPU)
            qv = qv.to(tl.float32)
        lo = sp * KEYS  # this program's keys: [lo, hi) of the sequence's
        hi = tl.minimum(lo + KEYS, tl.load(lens + b))
        m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, D], dtype=tl.float32)
        for start in range(lo, hi, BN):
            n = start + tl.arange(0, BN)
            nm = n < hi
            blk = tl.load(tables + b * st_b + n // BS, mask=nm, other=0).to(tl.int64)
            row = blk * sc_blk + (n % BS).to(tl.int64) * sc_off + kh * sc_h
            kt = tl.load(kc + row[:, None] + d[None, :], mask=nm[:, None], other=0.0)
            vt = tl.load(vc + row[:, None] + d[None, :], mask=nm[:, None], other=0.0)
            if DOT_F32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = tl.dot(qv, tl.trans(kt)) * scale_log2  # [BG, BN], in log2 units
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if SPLIT:  # this split's normalised output and log2-sum-exp; _paged_combine_kernel weighs them
            slot = (b * H + heads) * S + sp
            tl.store(part_o + slot[:, None] * D + d[None, :], o, mask=gm[:, None])
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse + slot, lse, mask=gm)
        else:
            tl.store(out + b * so_b + heads[:, None] * so_h + d[None, :], o.to(out.dtype.element_ty), mask=gm[:, None])

    @triton.jit
    def _paged_combine_kernel(part_o, part_lse, out, so_b, so_h, H, S, D: tl.constexpr, BSPLIT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, BSPLIT)
        sm = sp < S
        d = tl.arange(0, D)
        base = (b * H + h) * S
        lse = tl.load(part_lse + base + sp, mask=sm, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always has keys: the max is finite
        o = tl.load(part_o + (base + sp[:, None]) * D + d[None, :], mask=sm[:, None], other=0.0)
        res = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
        tl.store(out + b * so_b + h * so_h + d, res.to(out.dtype.element_ty))


_LOG2E = 1.4426950408889634
_DECODE_BLOCK_N = 64


def _decode_splits(b: int, kh: int, max_keys: int) -> int:
    """How many programs share one (sequence, kv head)'s keys (flash-decoding): with few sequences,
    b * kh programs would leave most of the GPU idle while each walks the whole context, so long contexts
    are split, up to ~2 programs per SM, each keeping at least _SPLIT_MIN_KEYS keys. From shapes only: the
    block table's width bounds the context, so no host read of the lengths is needed.

    Short contexts are not split: on the H200 at Llama-3-8B shapes and 1 stream over <= 256 keys, the
    split (4 programs of 64 keys per kv head, plus the combine kernel) measured 188.6 tok/s against
    194.7 for one program per kv head (docs/performance.md): the extra launch costs what the split saves."""
    if b * kh >= _SMS or max_keys <= _SPLIT_MIN_KEYS:
        return 1
    return max(1, min(triton.cdiv(max_keys, _SPLIT_MIN_KEYS), triton.cdiv(2 * _SMS, b * kh), 64))


_SPLIT_MIN_KEYS = 256
_SMS = 132  # the H200's; only sets how finely the keys are split


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    ok = (_runs_here(q, k_cache, v_cache, block_tables, context_lens) and q.dim() == 3 and k_cache.dim() == 4
          and q.dtype in _HALF and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
          and v_cache.shape == k_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
          and q.stride(-1) == 1 and q.shape[-1] == k_cache.shape[-1] and _pow2(q.shape[-1]) and q.shape[-1] >= 16
          and q.shape[1] % k_cache.shape[2] == 0 and block_tables.dim() == 2 and block_tables.stride(-1) == 1
          and block_tables.shape[0] == q.shape[0] and context_lens.shape == (q.shape[0],)
          and not block_tables.is_floating_point() and not context_lens.is_floating_point())
    if not ok:
        return fused.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    b, h, d = q.shape
    kh = k_cache.shape[2]
    g = h // kh
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not b:
        return out
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    splits = _decode_splits(b, kh, max_keys)
    keys = triton.cdiv(triton.cdiv(max_keys, splits), _DECODE_BLOCK_N) * _DECODE_BLOCK_N
    splits = triton.cdiv(max_keys, keys)
    part_o = part_lse = out  # unused without a split
    if splits > 1:
        part_o = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, kh, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse, float(scale) * _LOG2E, q.stride(0),
        q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), g, h, k_cache.shape[1], keys, splits, D=d, BG=max(16, triton.next_power_of_2(g)),
        BN=_DECODE_BLOCK_N, SPLIT=splits > 1, DOT_F32=not q.is_cuda, num_warps=4)
    if splits > 1:
        _paged_combine_kernel[(b, h)](part_o, part_lse, out, out.stride(0), out.stride(1), h, splits, D=d,
                                      BSPLIT=triton.next_power_of_2(splits), num_warps=1)
    return out
