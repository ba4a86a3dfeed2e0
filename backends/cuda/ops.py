"""CUDA overrides. Norms, rope, SwiGLU, KV writes and decode attention are Triton kernels in
`triton_decode.py` (one kernel per op, for the decode graphs); prefill attention is torch's SDPA (FlashAttention
for 16-bit inputs), shared with the cpu backend (`flagdeploy/ops/fused.py`); here: int8 x int8 matmuls through cuBLASLt
(`_int_mm`), weight-only linears on a dense 16-bit copy made once at load (cuBLAS beats dequantising per
call), MoE experts through one grouped GEMM on Hopper (`_grouped_mm`) instead of a loop per expert (FP8
expert banks: Triton kernels reading them as stored, `triton_moe.py`), and FP8 block-scaled linears on
Hopper's FP8 tensor cores (cuBLASLt block scaling through `F.scaled_mm`: activations 1x128, weights
128x128, as DeepSeek/GLM checkpoints are quantised). GLM-5.3-Flash's decode-step kernels: mHC in
`triton_mhc.py`, the router in `triton_router.py`, KDA's gates and recurrence here; decode-sized 16-bit
matmuls of tuned shapes in `triton_gemv.py`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from flagdeploy.ops import glm, reference
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight, fp8_quant_groups, stripped

from . import triton_decode, triton_gemv, triton_moe, triton_router
from .triton_decode import _runs_here

log = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)
_INT_MM_MIN_ROWS = 17  # cuBLASLt's int8 GEMM wants more than 16 rows: decode batches are padded up


def linear(x, weight, bias=None):
    """Decode-sized rows against a weight shape in triton_gemv.TUNED: the Triton kernel measured faster there;
    with a bias, 16-bit inputs of one dtype: one cuBLASLt GEMM whose epilogue adds the bias (`F.linear`:
    addmm's bias epilogue; the reference's separate add is a second pass over the output, 20-27% of the
    vision tower's kernel time at 5k rows); anything else cuBLAS (the reference's matmul).

    The epilogue adds the bias to the float32 accumulator and rounds once, where the reference rounds the
    product, then the sum: closer to the float64 specification, not bitwise equal to the reference."""
    cfg = triton_gemv.TUNED.get(tuple(weight.shape)) if weight.dim() == 2 else None
    if cfg is not None and triton_gemv.supports(x, weight) and (bias is None or bias.dtype == weight.dtype):
        return triton_gemv.skinny_linear(x, weight, bias, cfg)
    if (bias is not None and x.dtype in _HALF and weight.dtype == x.dtype and bias.dtype == x.dtype
            and weight.dim() == 2 and bias.dim() == 1 and x.is_cuda and weight.is_cuda and bias.is_cuda):
        return F.linear(x, weight, bias)
    return OPS["linear"].reference(x, weight, bias)


def prepare_dense(w: Int4Weight | Int8Weight):
    return stripped(w, dense=w.dequantize(torch.bfloat16))


def linear_w4a16(x, w: Int4Weight, bias=None):
    y = F.linear(x.to(torch.bfloat16), w.prepared["dense"])
    return y + bias.to(y.dtype) if bias is not None else y


linear_w8a16 = linear_w4a16


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    a = reference.a16_dtype(x.dtype)
    qx, sx = reference.dynamic_quant(x.to(a))
    m = qx.shape[0]
    if m < _INT_MM_MIN_ROWS:
        qx = torch.cat([qx, qx.new_zeros(_INT_MM_MIN_ROWS - m, qx.shape[1])])
    acc = torch._int_mm(qx, q.t())[:m]
    return (acc.float() * sx[:, None] * scales.float()).to(a)


def linear_w8a8_dynamic(x, w: W8A8Weight, bias=None):
    if w.in_features % 8 or w.out_features % 8:  # cuBLASLt int8 alignment
        return reference.linear_w8a8_dynamic(x, w, bias)
    y = _int8_mm(x, w.q, w.scales)
    return y + bias.to(y.dtype) if bias is not None else y


def _grouped_ok(x: torch.Tensor, gate_up, down) -> bool:
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and x.dtype == torch.bfloat16
            and gate_up.dtype == down.dtype == x.dtype and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and all(d % 8 == 0 for d in (*gate_up.shape[1:], *down.shape[1:])))


def moe_experts(x, routing, gate_up, down, limit, top_k=None):
    """Tokens sorted by expert, one grouped GEMM for gate/up and one for down, then weighted back.

    With `top_k` the (token, expert) rows are each token's top_k routing entries (zero-weight ones add
    nothing): a fixed count, so the step reads nothing back and can be captured in a CUDA graph;
    otherwise the routing's nonzeros. FP8 banks: the Triton kernels of `triton_moe` for decode-sized
    batches (the picked experts read once, as stored), a loop of blockwise-FP8 GEMMs per expert above."""
    if isinstance(gate_up, Fp8BlockWeight) and isinstance(down, Fp8BlockWeight):
        if triton_moe.supports(x, gate_up, down, top_k) and x.shape[0] * top_k <= _FP8_KERNEL_MAX_PAIRS:
            return triton_moe.moe_fp8_experts(x, routing, gate_up, down, limit, top_k)
        return _fp8_expert_loop(x, routing, gate_up, down, limit)
    if not _grouped_ok(x, gate_up, down):
        if top_k is not None and _gather_ok(x, gate_up, down, top_k):
            return _experts_by_gather(x, routing, gate_up, down, limit, top_k)
        return OPS["moe_experts"].reference(x, routing, gate_up, down, limit)
    if top_k is not None:
        exp = routing.abs().topk(top_k, dim=-1).indices.flatten()
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
    else:
        tok, exp = routing.nonzero(as_tuple=True)  # one row per (token, picked expert), sorted by token
    order = exp.argsort(stable=True)
    tok, exp = tok[order], exp[order]
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device).index_add_(
        0, exp, torch.ones_like(exp, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    y = torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(1, 2), offs=offs)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * routing[tok, exp, None].float())
    return out.to(x.dtype)


_FP8_KERNEL_MAX_PAIRS = 512  # (token, expert) pairs: beyond, an expert's weights would be read many times over


def _fp8_expert_loop(x, routing, gate_up: Fp8BlockWeight, down: Fp8BlockWeight, limit):
    """The reference's per-expert loop on the FP8 tensor cores (prefill with FP8 experts), summed in float32."""
    return glm.experts_loop(x, routing, gate_up, down, limit, lambda v, bank, e: linear_fp8_block(v, bank.expert(e)),
                            torch.float32)


def _gather_ok(x, gate_up, down, top_k) -> bool:
    """Few enough tokens that a copy of each picked expert's weights is small (decode of small models)."""
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dtype == x.dtype
            and x.shape[0] * top_k * (gate_up[0].numel() + down[0].numel()) <= 1 << 26)


def _experts_by_gather(x, routing, gate_up, down, limit, top_k):
    """Each token's top_k experts as batched matrix-vector products on gathered weights: fixed shapes,
    no host reads (capturable), for the dtypes and sizes the grouped GEMM does not take."""
    t, k = x.shape[0], top_k
    picked = routing.abs().topk(k, dim=-1).indices  # [T, k]
    weight = routing.gather(1, picked)
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
    gate, up = torch.bmm(gate_up[picked.flatten()], rows).squeeze(-1).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    y = torch.bmm(down[picked.flatten()], (F.silu(gate) * up).unsqueeze(-1)).view(t, k, -1)
    return (y.float() * weight.float().unsqueeze(-1)).sum(1).to(x.dtype)


_FP8_NATIVE = {"ok": hasattr(F, "scaled_mm")}  # cleared, with a log line, if this torch/cuBLAS refuses blockwise FP8


def linear_fp8_block(x, w: Fp8BlockWeight, bias=None):
    """cuBLASLt wants the token count a multiple of 4, the activation scales outer-dim-major and the
    weight scales' K-block count a multiple of 4: pad both (zeros do not change the product)."""
    if not _FP8_NATIVE["ok"] or w.block != (128, 128) or w.in_features % 128 or w.out_features % 128:
        return reference.linear_fp8_block(x, w, bias)
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    qx, sx = fp8_quant_groups(xp, 128)
    s = w.scale_inv.float()
    s = F.pad(s, (0, -s.shape[1] % 4)) if s.shape[1] % 4 else s
    try:
        y = F.scaled_mm(qx, w.q.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128, s.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)[:m]
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.warning("blockwise FP8 GEMM unavailable (%s); linear_fp8_block runs the reference", exc)
        _FP8_NATIVE["ok"] = False
        return reference.linear_fp8_block(x, w, bias)
    return y + bias.to(y.dtype) if bias is not None else y


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None


# ---- KDA: the gated delta rule token by token, state kept in registers ----------------------------------
# The reference's decode step is ~30 small kernels per layer (casts, the q/k L2 norms, the state update as
# einsums); here one program per (head, block of value channels) reads its slice of the float32 state
# once, runs every token, and writes it back.

if triton is not None:

    @triton.jit
    def _kda_recurrent_kernel(q, k, v, g, beta, state_in, out, state_out, T, H,
                              DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        h = tl.program_id(0)
        vb = tl.program_id(1)
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        vm = dv < DV
        s_ptr = h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(state_in + s_ptr, mask=vm[None, :], other=0.0).to(tl.float32)
        for t in range(T):
            row = t * H + h
            qt = tl.load(q + row * DK + dk).to(tl.float32)
            kt = tl.load(k + row * DK + dk).to(tl.float32)
            qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
            kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
            vt = tl.load(v + row * DV + dv, mask=vm, other=0.0).to(tl.float32)
            gt = tl.load(g + row * DK + dk).to(tl.float32)
            bt = tl.load(beta + row).to(tl.float32)
            s = s * tl.exp(gt)[:, None]
            pred = tl.sum(kt[:, None] * s, axis=0)
            s = s + kt[:, None] * ((vt - pred) * bt)[None, :]
            o = tl.sum(qt[:, None] * s, axis=0)
            tl.store(out + row * DV + dv, o.to(out.dtype.element_ty), mask=vm)
        tl.store(state_out + s_ptr, s.to(state_out.dtype.element_ty), mask=vm[None, :])


def kda_recurrent(q, k, v, g, beta, state):
    """The reference's recurrence (float32 state and maths), one kernel for all heads and tokens."""
    dk, dv = q.shape[-1], v.shape[-1]
    if (triton is None or not q.is_cuda or q.dtype == torch.float64 or dk & (dk - 1) or dk > 256
            or (state is not None and state.dtype == torch.float64)):
        return OPS["kda_recurrent"].reference(q, k, v, g, beta, state)
    t, h = q.shape[0], q.shape[1]
    if state is None:
        state = torch.zeros(h, dk, dv, dtype=torch.float32, device=q.device)
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    new_state = torch.empty(state.shape, dtype=state.dtype, device=state.device)
    bv = min(triton.next_power_of_2(dv), 32)
    _kda_recurrent_kernel[(h, triton.cdiv(dv, bv))](q, k, v, g, beta, state, out, new_state, t, h,
                                                     DK=dk, DV=dv, BV=bv, num_warps=4)
    return out, new_state


def kda_chunk(q, k, v, g, beta, state, chunk_size=64):
    """Prefill through the token-by-token kernel above: on the H200 12-15x faster than the chunked reference
    at 256-8192 tokens, same outputs (benchmarks/cuda_kda_prefill.py; the reference materialises an
    [H, L, L, Dk] decay per chunk in torch ops). A chunked Triton form would be faster still; not written."""
    return kda_recurrent(q, k, v, g, beta, state)


# ---- KDA decode: the gates in one kernel, the recurrence on the state pool's rows in place ---------------
# In torch the gates are ~7 kernels per layer (cast, bias add, exp, multiply, sigmoid, scale; beta's sigmoid)
# and the state rows a gather and a scatter around the recurrence: ~10 us per KDA layer at one token.

if triton is not None:

    @triton.jit
    def _kda_gates_kernel(f, b, dt_bias, a_log, g, beta, HD, H, s_f, s_b, lower,
                          D: tl.constexpr, HAS_LOWER: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        blk = tl.program_id(1)
        c = blk * BLOCK + tl.arange(0, BLOCK)
        m = c < HD
        raw = tl.load(f + t * s_f + c, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + c, mask=m,
                                                                                  other=0.0).to(tl.float32)
        rate = tl.exp(tl.load(a_log + c // D, mask=m, other=0.0).to(tl.float32))
        if HAS_LOWER:
            gv = lower * tl.sigmoid(rate * raw)
        else:
            gv = -rate * tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(tl.minimum(raw, 20.0))))
        tl.store(g + t * HD + c, gv.to(g.dtype.element_ty), mask=m)
        hh = tl.arange(0, BH)
        hm = (hh < H) & ((hh * 0 + blk) == 0)  # the first block writes beta
        bv = tl.load(b + t * s_b + hh, mask=hm, other=0.0).to(tl.float32)
        tl.store(beta + t * H + hh, tl.sigmoid(bv).to(beta.dtype.element_ty), mask=hm)

    @triton.jit
    def _kda_update_kernel(q, k, v, g, beta, pool, slots, out, H, s_q, s_k, s_v, s_pool,
                           DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        n = bh // H
        h = bh % H
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        vm = dv < DV
        s_ptr = pool + tl.load(slots + n).to(tl.int64) * s_pool + h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(s_ptr, mask=vm[None, :], other=0.0).to(tl.float32)
        qt = tl.load(q + n * s_q + h * DK + dk).to(tl.float32)
        kt = tl.load(k + n * s_k + h * DK + dk).to(tl.float32)
        qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
        kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        vt = tl.load(v + n * s_v + h * DV + dv, mask=vm, other=0.0).to(tl.float32)
        gt = tl.load(g + bh * DK + dk).to(tl.float32)
        bt = tl.load(beta + bh).to(tl.float32)
        s = s * tl.exp(gt)[:, None]
        pred = tl.sum(kt[:, None] * s, axis=0)
        s = s + kt[:, None] * ((vt - pred) * bt)[None, :]
        tl.store(out + bh * DV + dv, tl.sum(qt[:, None] * s, axis=0).to(out.dtype.element_ty), mask=vm)
        tl.store(s_ptr, s.to(pool.dtype.element_ty), mask=vm[None, :])


def kda_gates(f, b, dt_bias, a_log, lower_bound):
    """One kernel for the forget gate and beta of T tokens (the reference's maths in float32)."""
    heads = a_log.shape[0]
    hd = f.shape[-1] if f.dim() == 2 else 0
    ok = (_runs_here(f, b, dt_bias, a_log) and f.dtype != torch.float64 and f.dim() == 2 and b.dim() == 2
          and b.shape == (f.shape[0], heads) and dt_bias.shape == (hd,) and hd % heads == 0
          and f.stride(-1) == 1 and b.stride(-1) == 1 and dt_bias.is_contiguous() and a_log.is_contiguous()
          and dt_bias.dtype != torch.float64 and b.dtype != torch.float64)
    if not ok:
        return OPS["kda_gates"].reference(f, b, dt_bias, a_log, lower_bound)
    t = f.shape[0]
    g = torch.empty(t, heads, hd // heads, dtype=torch.promote_types(f.dtype, dt_bias.dtype), device=f.device)
    beta = torch.empty(t, heads, dtype=b.dtype, device=b.device)
    if t:
        block = min(1024, triton.next_power_of_2(hd))
        _kda_gates_kernel[(t, triton.cdiv(hd, block))](
            f, b, dt_bias, a_log, g, beta, hd, heads, f.stride(0), b.stride(0),
            float(lower_bound) if lower_bound is not None else 0.0, D=hd // heads, HAS_LOWER=lower_bound is not None,
            BLOCK=block, BH=triton.next_power_of_2(heads))
    return g, beta


def kda_recurrent_update(q, k, v, g, beta, state_pool, state_slots):
    """One kernel: a program per (sequence, head, block of value channels) reads its slice of the state row,
    steps it once and writes it back in place (no gather / scatter of the rows)."""
    n = q.shape[0] if q.dim() == 3 else 0
    dk, dv = q.shape[-1], v.shape[-1]
    ok = (_runs_here(q, k, v, g, beta, state_pool, state_slots) and q.dtype != torch.float64 and q.dim() == 3
          and not dk & (dk - 1) and dk <= 256 and k.shape == q.shape and v.shape[:2] == q.shape[:2]
          and g.shape == q.shape and beta.shape == q.shape[:2] and state_pool.dim() == 4
          and state_pool.shape[1:] == (q.shape[1], dk, dv) and state_pool.dtype == torch.float32
          and state_pool[0].is_contiguous() and g.is_contiguous() and beta.is_contiguous()
          and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v)))
    if not ok:
        return OPS["kda_recurrent_update"].reference(q, k, v, g, beta, state_pool, state_slots)
    heads = q.shape[1]
    out = torch.empty(n, heads, dv, dtype=v.dtype, device=v.device)
    if n:
        bv = min(triton.next_power_of_2(dv), 32)
        _kda_update_kernel[(n * heads, triton.cdiv(dv, bv))](
            q, k, v, g, beta, state_pool, state_slots, out, heads, q.stride(0), k.stride(0), v.stride(0),
            state_pool.stride(0), DK=dk, DV=dv, BV=bv, num_warps=4)
    return out


# ---- KDA's short conv, one decode token per sequence, state rows updated in place ----------------------

if triton is not None:

    @triton.jit
    def _conv_update_kernel(x, w, pool, slots, y, C, s_x, s_row, s_tap, KW: tl.constexpr, BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = c < C
        row = pool + tl.load(slots + b).to(tl.int64) * s_row
        xv = tl.load(x + b * s_x + c, mask=m, other=0.0)
        acc = xv.to(tl.float32) * tl.load(w + c * KW + (KW - 1), mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(KW - 1):
            tap = tl.load(row + j * s_tap + c, mask=m, other=0.0)
            acc += tap.to(tl.float32) * tl.load(w + c * KW + j, mask=m, other=0.0).to(tl.float32)
            if j > 0:  # the window moves on by one: tap j becomes tap j - 1
                tl.store(row + (j - 1) * s_tap + c, tap, mask=m)
        tl.store(row + (KW - 2) * s_tap + c, xv.to(pool.dtype.element_ty), mask=m)
        tl.store(y + b * C + c, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=m)


def causal_conv1d_update(x, weight, state_pool, state_slots):
    """One kernel: a program per (sequence, channel block) reads its state row, writes the output and the
    shifted state back (the reference gathers, concatenates, reduces and scatters: ~8 kernels)."""
    ok = (_runs_here(x, weight, state_pool, state_slots) and x.dtype != torch.float64 and x.dim() == 2 and weight.dim() == 2
          and weight.shape[0] == x.shape[1] and weight.shape[1] >= 2 and weight.is_contiguous()
          and state_pool.dim() == 3 and state_pool.shape[1:] == (weight.shape[1] - 1, x.shape[1])
          and state_pool.stride(-1) == 1 and x.stride(-1) == 1 and state_pool.dtype == x.dtype)
    if not ok:
        return OPS["causal_conv1d_update"].reference(x, weight, state_pool, state_slots)
    b, c = x.shape
    y = torch.empty(b, c, dtype=x.dtype, device=x.device)  # rows of c, whatever x's row stride
    if b:
        block = min(1024, triton.next_power_of_2(c))
        _conv_update_kernel[(b, triton.cdiv(c, block))](x, weight, state_pool, state_slots, y, c, x.stride(0),
                                                         state_pool.stride(0), state_pool.stride(1),
                                                         KW=weight.shape[1], BC=block, num_warps=4)
    return y


# ---- sparse attention over one shared latent (absorbed MLA decode) -------------------------------------


def sparse_attention(q, k, v, mask, scale):
    """When keys and values are one latent broadcast over heads (MLA decode: `expand`, stride 0), attend
    to it directly instead of materialising a float32 copy per head, as the reference would."""
    shared = k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.dim() == 3 and k.stride(1) == 0
    if not (shared and q.is_cuda and q.dtype != torch.float64):
        return OPS["sparse_attention"].reference(q, k, v, mask, scale)
    lat = k[:, 0].float()  # [S, R]
    scores = torch.einsum("thr,sr->hts", q.float(), lat) * scale
    probs = scores.masked_fill((mask == 0).unsqueeze(0), float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hts,sr->thr", probs, lat).to(q.dtype)


# ---- sigmoid router, one group (GLM-5.3-Flash: n_group = topk_group = 1) -------------------------------

ROUTER_KERNEL_TOKENS = 64  # up to this many tokens (decode): triton_router's two kernels, which read the weight per token


def moe_router(x, weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """With one expert group the group ranking selects everything: skip it (fewer kernels, same result)."""
    if n_group != 1 or not x.is_cuda or x.dtype == torch.float64:
        return OPS["moe_router"].reference(x, weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                                           routed_scaling_factor)
    if x.shape[0] <= ROUTER_KERNEL_TOKENS and triton_router.supports(x, weight, correction_bias, top_k, n_group):
        return triton_router.moe_router(x, weight, correction_bias, top_k, norm_topk_prob, routed_scaling_factor)
    scores = torch.mm(x.float(), weight.float().t()).sigmoid_()
    chosen = (scores + correction_bias.float()).topk(top_k, dim=-1).indices
    w = scores.gather(1, chosen)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return torch.zeros_like(scores).scatter_(1, chosen, w * routed_scaling_factor).to(x.dtype)


# ---- DSA indexer: a context within the top-k budget selects everything --------------------------------


def dsa_indexer_topk(q, head_weights, keys, gate, ape, q_start, index_topk, select_tail):
    """While a sequence has no more complete pools than the top-k keeps (index_topk / kpool of them, e.g.
    up to 2,048 tokens for GLM-5.3-Flash), every visible pool is selected whatever the scores: the mask
    is then plain causal (with the tail) or the complete pools before the query (without), so the
    scoring is skipped. Longer contexts run the reference."""
    p = ape.shape[0]
    s_len = keys.shape[0]
    if not q.is_cuda or q.dtype == torch.float64 or index_topk // p < s_len // p:
        return OPS["dsa_indexer_topk"].reference(q, head_weights, keys, gate, ape, q_start, index_topk, select_tail)
    pos = torch.arange(q_start, q_start + q.shape[0], device=q.device)
    cols = torch.arange(s_len, device=q.device)
    end = pos + 1 if select_tail else (pos + 1) // p * p  # selected: columns [0, end)
    return (cols[None, :] < end[:, None]).to(q.dtype)


# ---- KDA's gated RMS norm in one kernel ----------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gated_rms_norm_kernel(x, gate, weight, out, eps, D: tl.constexpr, BD: tl.constexpr):
        r = tl.program_id(0)
        d = tl.arange(0, BD)
        m = d < D
        xv = tl.load(x + r * D + d, mask=m, other=0.0).to(tl.float32)
        gv = tl.load(gate + r * D + d, mask=m, other=0.0).to(tl.float32)
        wv = tl.load(weight + d, mask=m, other=0.0).to(tl.float32)
        y = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps) * wv * tl.sigmoid(gv)
        tl.store(out + r * D + d, y.to(out.dtype.element_ty), mask=m)


def gated_rms_norm(x, gate, weight, eps):
    """The reference's float32 maths, one program per row."""
    if triton is None or not x.is_cuda or x.dtype == torch.float64 or gate.shape != x.shape:
        return OPS["gated_rms_norm"].reference(x, gate, weight, eps)
    d = x.shape[-1]
    xc, gc = x.contiguous(), gate.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // d if d else 0
    if rows:
        _gated_rms_norm_kernel[(rows,)](xc, gc, weight.contiguous(), out, float(eps), D=d,
                                        BD=triton.next_power_of_2(d))
    return out


# ---- RMSNorm over short rows: many rows per program --------------------------------------------------
# triton_decode's kernel runs one program per row: right for hidden-size rows, but per-head norms (the
# vision tower's q/k norms: 64 channels, 16 heads x 5k-8k patches = 90k-130k rows) then leave each program
# a few loads' work and 3 ms of the image's 19 ms in launching blocks (H200: 32 us a call; here 6.5 us).
# Here a program takes a [BR, D] tile, with the per-row kernel's maths (float32 sum over the row, rounded
# to the input dtype before the weight multiply; the sum's order differs, so not bitwise the same), and BR
# depends only on D, so a row's result never depends on how many rows came with it.

_SHORT_ROW = 128  # rows up to this width take the tiled kernel

if triton is not None:

    @triton.jit
    def _rms_norm_rows_kernel(x, w, out, rows, sx, so, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
        d = tl.arange(0, BD)[None, :]
        m = (r < rows) & (d < D)
        h = tl.load(x + r * sx + d, mask=m, other=0.0)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / D + eps)
        y = (hf * inv[:, None]).to(h.dtype).to(tl.float32)  # the reference casts back before the weight multiply
        wv = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(out + r * so + d, (wv * y).to(out.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of at most `_SHORT_ROW` channels: the tiled kernel above, reading rows that are evenly strided
    in place (the q or k heads of a fused projection's output); wider rows: triton_decode's kernel."""
    d = x.shape[-1] if x.dim() else 0
    if d > _SHORT_ROW or not triton_decode._norm_ok(x, weight):
        return triton_decode.rms_norm(x, weight, eps)
    x2 = triton_decode._rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows = x2.shape[0]
    if rows:
        bd = triton.next_power_of_2(d)
        br = max(1, 2048 // bd)
        _rms_norm_rows_kernel[(triton.cdiv(rows, br),)](x2, weight, out, rows, x2.stride(0), d, float(eps), D=d, BD=bd,
                                                        BR=br, num_warps=4)
    return out
