"""Reference implementations of the hot ops: the specification every backend is checked against.

Plain torch, written for clarity over speed; each runs on any torch device and in any float dtype
(float64 included, which is how the references themselves are checked). Shapes use T for tokens of
a flattened batch, H / KH for query / key-value heads, D for head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import OpSpec, Tolerance, register_op
from .weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight, fp8_quant_groups, fp8_to_float

# Per-dtype tolerances against a float64 run of the same reference: float32 is tight; half types
# carry ~3 significant digits and accumulate over the reduction dimension.
_TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
}


# Weight-only "A16" linears run their activations in 16 bits even in a float32 model (that is what the
# packed kernels take), so float32 gets the 16-bit tolerance there.
_TOL_A16 = {**_TOL, torch.float32: _TOL[torch.bfloat16]}
# W8A8 quantises those 16-bit activations per token to int8; the float64 reference quantises the unrounded
# float32 values, and about one activation in eight lies near enough to a step boundary that the two pick
# neighbouring codes. Each such flip moves an output by (token scale x weight); at a hidden size of 4096 that
# is an error of ~0.011 rms, and the largest of a 256 x 4096 output reaches 0.05 (`ops check --model
# glm-5.3-flash` failed at 0.04-0.046). bf16 inputs are exact in float64: the same codes, the same tolerance.
_TOL_A8 = {**_TOL_A16, torch.float32: Tolerance(atol=8e-2, rtol=3e-2)}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


# ---- linear / embedding -----------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias, weight stored [out, in] as in HF checkpoints."""
    y = x @ weight.t()
    return y + bias if bias is not None else y


def a16_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit activation type of the weight-only ("A16") linears: fp16 stays fp16, float32 and
    bf16 run in bf16; float64 stays float64 so that the specification itself can be checked."""
    return dtype if dtype in (torch.float16, torch.float64) else torch.bfloat16


def linear_w4a16(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int4 linear (group-wise scales and zeros); activations in and out in 16 bits.

    The output stays 16-bit: the next op (rope, swiglu, the residual add) takes it as it is, so a
    float32 model pays no cast back per linear.
    """
    a = a16_dtype(x.dtype)
    return linear(x.to(a), weight.dequantize(a), None if bias is None else bias.to(a))


def linear_w8a16(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8 linear (per-channel or per-group scales); activations in and out in 16 bits."""
    a = a16_dtype(x.dtype)
    return linear(x.to(a), weight.dequantize(a), None if bias is None else bias.to(a))


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (`npu_dynamic_quant`'s "pertoken"): (q int8, scale float32 [...]) with
    scale = absmax / 127 over the last dim, so that x ~ q * scale[..., None]."""
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def linear_w8a8_dynamic(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Int8 x int8 linear with dynamic per-token activation scales, done as the chip does it: quantise
    the 16-bit activations per token, accumulate the integer products exactly (an int32 accumulator;
    here float64, which holds every such sum exactly), then scale by token and channel scales.
    Activations in and out in 16 bits, as the W8A16 linears."""
    a = a16_dtype(x.dtype)
    qx, sx = dynamic_quant(x.to(a))
    acc = qx.double() @ weight.q.double().t()
    y = acc.to(sx.dtype) * sx[..., None] * weight.scales.to(sx.dtype)
    return (y if bias is None else y + bias.to(y.dtype)).to(a)


def linear_fp8_block(x: torch.Tensor, weight: Fp8BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 x FP8 with block scales, as FP8 matrix units run DeepSeek/GLM-style checkpoints: activations
    quantised to e4m3 per token and group of block[1] input channels at run time, weights per block, the
    products of the decoded values accumulated in float32 (float64 in the spec check). 16-bit out."""
    a = a16_dtype(x.dtype)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    qx, sx = fp8_quant_groups(x, weight.block[1])  # from float32 values: the same codes whatever x's dtype
    xd = fp8_to_float(qx).to(acc) * sx.to(acc).repeat_interleave(weight.block[1], -1)[:, : x.shape[-1]]
    y = xd @ weight.dequantize(acc).t()
    return (y if bias is None else y + bias.to(acc)).to(a)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `x` over the ranks of `group` (the tensor-parallel group), in place; the identity on one rank."""
    from flagdeploy import parallel  # torch.distributed is loaded only by what runs on several ranks

    return parallel.all_reduce(x, group)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """A row-parallel linear: each rank holds a slice of the input features, so the partial products
    are summed over `group` before the (full) bias is added once. One op so that a backend can run
    the matmul and the all-reduce as one kernel (Ascend's npu_mm_all_reduce_base)."""
    y = all_reduce(linear(x, weight), group)
    return y + bias if bias is not None else y


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids]


# ---- norms ------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in at least float32, cast back: what Llama/Qwen/GLM reference code does."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual step fused as one op."""
    h = x + residual
    return rms_norm(h, weight, eps), h


# ---- rotary embedding -------------------------------------------------------------------------------


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the rotate-half (GPT-NeoX / HF Llama) layout.

    q [T, H, D], k [T, KH, D]; cos/sin [T, D/2], already gathered for each token's position (once per
    step, by the model, rather than once per layer).
    """
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        xf1, xf2 = x1.to(c.dtype), x2.to(c.dtype)
        return torch.cat((xf1 * c - xf2 * s, xf2 * c + xf1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def rope_tables(head_dim: int, max_pos: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos/sin tables for `rope`, computed in float64 so every run dtype starts from the same angles."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64, device=device), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


# ---- activations ------------------------------------------------------------------------------------


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up with gate_up = [gate | up] on the last dim; `limit` clamps like GLM/gpt-oss."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


# ---- sampling -------------------------------------------------------------------------------------------


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's tokens: logits [R, V] -> [R] int64, each row's first index of its largest value (its
    first NaN where it has one), as torch's max(-1).indices."""
    return logits.max(-1).indices


def sample_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """A sampled request's next-token distribution, row by row: logits [R, V] and each row's settings [R]
    (temperature > 0; top_k 0, top_p 1 and min_p 0 are off) -> probabilities [R, V], float32 (float64 for
    float64 logits). Temperature first, then min_p (relative to the likeliest token, after temperature: vLLM's
    order), then top_k (ties with the k-th value stay), then top_p over what is left (in descending order, ties
    by index; the token that crosses top_p stays), renormalised. A row with nothing to draw from (NaN logits,
    every token masked) comes back NaN."""
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.to(dt) / temperature.to(dt)[:, None]
    top = rows.max(-1, keepdim=True).values
    floor = torch.where(min_p[:, None] > 0, top + min_p.to(dt).clamp_min(1e-30).log()[:, None], float("-inf"))
    rows = rows.masked_fill(rows < floor, float("-inf"))
    k = top_k.clamp(0, rows.shape[-1])
    if k.numel() and int(k.max()) > 0:
        kth = rows.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).clamp_min(0)[:, None])
        rows = rows.masked_fill((rows < kth) & (k[:, None] > 0), float("-inf"))
    probs = rows.softmax(-1)
    if bool((top_p < 1).any()):
        sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_p.cumsum(-1) - sorted_p < top_p.to(dt)[:, None]) | (top_p[:, None] >= 1)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(~keep, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn by the inverse of each row's cumulative distribution: probs [R, V] (non-negative, any
    scale) and one uniform [R] (float64, in [0, 1)) a row -> [R] int64, the first index whose running sum (in
    float64, index order) passes u times the row's total; -1 where a row has nothing to draw from (a non-finite
    entry, or all zero)."""
    p = probs.double()
    sums = p.cumsum(-1)
    total = sums[:, -1]
    at = torch.searchsorted(sums, (u.to(p) * total)[:, None], right=True).clamp(max=p.shape[-1] - 1)
    # u * total rounded up to the total lands past the end: the row's last token that can be drawn
    index = torch.arange(p.shape[-1], device=p.device).expand_as(p)
    last = torch.where(p > 0, index, -1).cummax(-1).values.gather(-1, at)[:, 0]
    ok = torch.isfinite(p).all(-1) & (total > 0)
    return torch.where(ok, last, -1)


# ---- attention --------------------------------------------------------------------------------------


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Tq, H, D], k/v [Tk, KH, D]; causal aligned bottom-right (q are the last Tq)."""
    h, kh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kh, dim=1)
    v = v.repeat_interleave(h // kh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over a packed batch of sequences (varlen).

    Sequence i owns q[cu_q[i]:cu_q[i+1]] and k/v[cu_k[i]:cu_k[i+1]]; when it has more keys than
    queries (a cached prefix, a later prefill chunk) its queries are the last positions.
    """
    out = torch.empty_like(q)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bq) - 1):
        out[bq[i] : bq[i + 1]] = _attend(q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]], scale, True)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query token per sequence against its paged cache.

    q [B, H, D]; caches [num_blocks, block_size, KH, D]; block_tables [B, W] with W the most blocks any
    of these sequences uses (shorter rows padded with any valid block id); context_lens [B] counts the
    keys, the new token's own included.
    """
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        blocks = block_tables[i, : (n + bs - 1) // bs]
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out[i] = _attend(q[i : i + 1], k, v, scale, False)[0]
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token t's k/v at flat slot slot_mapping[t] (block * block_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of q and k, then `write_kv_cache` of the rotated k and v; returns the rotated (q, k).

    One op so that a backend can do both in one pass over the step's keys (one kernel per layer fewer
    in a decode step); a backend without such a kernel runs its own rope and cache write (`composite`).
    """
    q, k = rope(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _rope_write_kv_composite(impl):
    rope_fn, write_fn = impl("rope"), impl("write_kv_cache")

    def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        q, k = rope_fn(q, k, cos, sin)
        write_fn(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    return rope_write_kv


# ---- declarations with their random-input makers ----------------------------------------------------


def _linear_inputs(dtype, device, g):
    return (_randn(g, 5, 64, dtype=dtype, device=device), _randn(g, 48, 64, dtype=dtype, device=device, scale=0.1),
            _randn(g, 48, dtype=dtype, device=device)), {}


def _all_reduce_inputs(dtype, device, g):
    return (_randn(g, 5, 48, dtype=dtype, device=device),), {"group": None}


def _linear_all_reduce_inputs(dtype, device, g):
    args, _ = _linear_inputs(dtype, device, g)
    return args, {"group": None}


def _w4_inputs(dtype, device, g):
    n, k, gs = 48, 64, 32
    w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8).to(device),
                   _randn(g, n, k // gs, dtype=torch.float32, device=device, scale=0.02).abs(),
                   _randn(g, n, k // gs, dtype=torch.float32, device=device, scale=0.02), gs, n, k)
    return (_randn(g, 5, k, dtype=dtype, device=device), w, _randn(g, n, dtype=dtype, device=device)), {}


def _w8_inputs(dtype, device, g):
    w = Int8Weight.quantize(_randn(g, 48, 64, dtype=torch.float32, device=device, scale=0.1))
    return (_randn(g, 5, 64, dtype=dtype, device=device), w, None), {}


def _w8a8_inputs(dtype, device, g):
    w = W8A8Weight.quantize(_randn(g, 48, 64, dtype=torch.float32, device=device, scale=0.1))
    return (_randn(g, 5, 64, dtype=dtype, device=device), w, _randn(g, 48, dtype=dtype, device=device)), {}


def _fp8_inputs(dtype, device, g):
    w = Fp8BlockWeight.quantize(_randn(g, 48, 64, dtype=torch.float32, device=device, scale=0.1), (16, 32))
    return (_randn(g, 5, 64, dtype=dtype, device=device), w, _randn(g, 48, dtype=dtype, device=device)), {}


def _embedding_inputs(dtype, device, g):
    return (torch.randint(0, 100, (7,), generator=g).to(device), _randn(g, 100, 32, dtype=dtype, device=device)), {}


def _norm_inputs(dtype, device, g):
    return (_randn(g, 6, 96, dtype=dtype, device=device), _randn(g, 96, dtype=dtype, device=device), 1e-5), {}


def _add_norm_inputs(dtype, device, g):
    x, w, eps = _norm_inputs(dtype, device, g)[0]
    return (x, _randn(g, 6, 96, dtype=dtype, device=device), w, eps), {}


def _rope_inputs(dtype, device, g):
    cos, sin = rope_tables(32, 64, 10000.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
    pos = torch.randint(0, 64, (9,), generator=g).to(device)
    return (_randn(g, 9, 4, 32, dtype=dtype, device=device), _randn(g, 9, 2, 32, dtype=dtype, device=device), cos[pos], sin[pos]), {}


def _swiglu_inputs(dtype, device, g):
    return (_randn(g, 5, 64, dtype=dtype, device=device, scale=3.0),), {"limit": 7.0}


def _argmax_inputs(dtype, device, g):
    x = _randn(g, 5, 1000, dtype=dtype, device=device)
    x[1, 7] = x[1, 600] = x[1].max() + 1  # equal maxima: the first
    x[2, 300] = x[2, 900] = float("nan")  # NaNs: the first
    x[3] = float("-inf")  # a row masked to nothing: index 0
    return (x,), {}


def _sample_probs_inputs(dtype, device, g):
    logits = _randn(g, 6, 1000, dtype=dtype, device=device, scale=3.0)
    logits[5, 10] = logits[5, 20] = logits[5].max() + 1  # tied likeliest tokens under top_k 1
    settings = [  # temperature, top_k, top_p, min_p
        (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.5, 5, 0.8, 0.05), (1.0, 1000, 0.5, 0.0),
        (1.0, 1, 1.0, 0.1)]
    t, k, p, m = zip(*settings)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    return (logits, f32(t), torch.tensor(k, device=device), f32(p), f32(m)), {}


def _draw_inputs(dtype, device, g):
    probs = torch.rand(5, 1000, generator=g, dtype=torch.float64)
    probs[1, :500] = 0  # zeros are never drawn
    probs[2] = 0
    probs[2, 777] = 0.25  # one token, any scale
    probs[3, 999] = 0  # u near 1: the last token that can be drawn
    u = torch.tensor([0.0, 0.3, 0.5, 1 - 2 ** -40, 0.71], dtype=torch.float64, device=device)
    return (probs.to(dtype=dtype, device=device), u), {}


_EXACT = {dtype: Tolerance(atol=0.5, rtol=0.0) for dtype in _TOL}  # indices: any difference is a whole one
# probabilities computed in float32 from the same logits (bf16 logits are exact in float32 and float64)
_PROBS = {dtype: Tolerance(atol=1e-6, rtol=1e-4) for dtype in _TOL}


def _prefill_inputs(dtype, device, g):
    lq, lk = [3, 1, 6], [3, 4, 9]  # plain prefill, a decode-like row, a chunk after a cached prefix
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)
    return (_randn(g, sum(lq), 4, 16, dtype=dtype, device=device), _randn(g, sum(lk), 2, 16, dtype=dtype, device=device),
            _randn(g, sum(lk), 2, 16, dtype=dtype, device=device), cu(lq), cu(lk), 0.25), {}


def _decode_inputs(dtype, device, g):
    nb, bs = 12, 4
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[:4], perm[4:8], perm[8:12]]).to(device=device, dtype=torch.int32)
    lens = torch.tensor([5, 16, 1], dtype=torch.int32, device=device)
    return (_randn(g, 3, 4, 16, dtype=dtype, device=device), _randn(g, nb, bs, 2, 16, dtype=dtype, device=device),
            _randn(g, nb, bs, 2, 16, dtype=dtype, device=device), tables, lens, 0.25), {}


def _rope_write_kv_inputs(dtype, device, g):
    (q, k, cos, sin), _ = _rope_inputs(dtype, device, g)  # 9 tokens, 2 kv heads of 32
    caches = [torch.zeros(3, 4, 2, 32, dtype=dtype, device=device) for _ in range(2)]
    slots = torch.tensor([3, 0, 11, 9, 7, 1, 2, 4, 5], device=device)
    return (q, k, _randn(g, 9, 2, 32, dtype=dtype, device=device), cos, sin, *caches, slots), {}


def _write_kv_inputs(dtype, device, g):
    slots = torch.tensor([3, 0, 11, 9, 7], device=device)
    return (_randn(g, 5, 2, 8, dtype=dtype, device=device), _randn(g, 5, 2, 8, dtype=dtype, device=device),
            torch.zeros(3, 4, 2, 8, dtype=dtype, device=device), torch.zeros(3, 4, 2, 8, dtype=dtype, device=device), slots), {}


for _spec in (
    OpSpec("linear", linear, _TOL, _linear_inputs, linear.__doc__),
    OpSpec("all_reduce", all_reduce, _TOL, _all_reduce_inputs, all_reduce.__doc__),
    OpSpec("linear_all_reduce", linear_all_reduce, _TOL, _linear_all_reduce_inputs, linear_all_reduce.__doc__),
    OpSpec("linear_w4a16", linear_w4a16, _TOL_A16, _w4_inputs, linear_w4a16.__doc__),
    OpSpec("linear_w8a16", linear_w8a16, _TOL_A16, _w8_inputs, linear_w8a16.__doc__),
    OpSpec("linear_w8a8_dynamic", linear_w8a8_dynamic, _TOL_A8, _w8a8_inputs, linear_w8a8_dynamic.__doc__),
    OpSpec("linear_fp8_block", linear_fp8_block, _TOL_A16, _fp8_inputs, linear_fp8_block.__doc__),
    OpSpec("embedding", embedding, _TOL, _embedding_inputs, "Row lookup in an embedding table."),
    OpSpec("rms_norm", rms_norm, _TOL, _norm_inputs, rms_norm.__doc__),
    OpSpec("add_rms_norm", add_rms_norm, _TOL, _add_norm_inputs, add_rms_norm.__doc__),
    OpSpec("rope", rope, _TOL, _rope_inputs, rope.__doc__),
    OpSpec("swiglu", swiglu, _TOL, _swiglu_inputs, swiglu.__doc__),
    OpSpec("argmax", argmax, _EXACT, _argmax_inputs, argmax.__doc__),
    OpSpec("sample_probs", sample_probs, _PROBS, _sample_probs_inputs, sample_probs.__doc__),
    OpSpec("draw", draw, _EXACT, _draw_inputs, draw.__doc__),
    OpSpec("attention_prefill", attention_prefill, _TOL, _prefill_inputs, attention_prefill.__doc__),
    OpSpec("paged_attention_decode", paged_attention_decode, _TOL, _decode_inputs, paged_attention_decode.__doc__),
    OpSpec("write_kv_cache", write_kv_cache, _TOL, _write_kv_inputs, write_kv_cache.__doc__, writes=(2, 3)),
    OpSpec("rope_write_kv", rope_write_kv, _TOL, _rope_write_kv_inputs, rope_write_kv.__doc__, writes=(5, 6),
           composite=_rope_write_kv_composite),
):
    register_op(_spec)
