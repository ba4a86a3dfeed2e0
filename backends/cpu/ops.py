"""CPU overrides: the same semantics as flagdeploy.ops.reference, through torch's fused kernels."""

from __future__ import annotations

import functools
import itertools
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
import yaml

from flagdeploy.ops import fused, glm, reference
from flagdeploy.ops.registry import OPS, in_prefill_step, in_verify_step, prompt_rows, tracing
from flagdeploy.ops.weights import Int4Weight, Int8Weight, W8A8Weight, stripped

from . import native

from flagdeploy.ops.fused import (  # noqa: F401  (torch's fused kernels, shared with other backends)
    attention_prefill, rope, write_kv_cache,
)


TUNE_FILE = Path(__file__).with_name("tune.yaml")


def tune_table(flags: frozenset[str], path: Path = TUNE_FILE) -> dict:
    """The first of tune.yaml's `machines` whose `cpu_flags` this CPU has. The crossovers move with the
    instruction set, not only with the core count: without AVX-512 BF16 a bf16 matmul is emulated (~6x
    slower than float32 on a 2-core AVX2 EPYC), so the few-row packed kernels win up to far more rows and
    the dense copy is better kept in float32."""
    for machine in yaml.safe_load(path.read_text())["machines"]:
        if set(machine["cpu_flags"]) <= flags:
            return {k: v for k, v in machine.items() if k not in ("name", "cpu_flags")}
    raise RuntimeError(f"{path} has no entry for a CPU with flags {' '.join(sorted(flags)) or '(none)'}; its last "
                       "entry should need no flags")


TUNE = tune_table(native.cpu_flags())
SERVE = yaml.safe_load(TUNE_FILE.read_text())["serve"]
if "amx_min_rows" in TUNE["linear_w4a16"]:
    native.use_amx_from(TUNE["linear_w4a16"]["amx_min_rows"])


def server_threads(cores: int) -> int:
    """The kernels' threads in a server process on `cores` cores: one core in every `reserve_one_core_in` left to
    the server's event loop and the engine's Python (tune.yaml's `serve`, with what it was measured on)."""
    return max(1, cores - cores // SERVE["reserve_one_core_in"])


def rms_norm(x, weight, eps):
    """Eagerly, the backend's one-pass kernel (native.rms_norm: ~7 us a decode row where torch's composite
    norm costs 40-70 us, ~60 times a token for a small llama); inside a compiled step torch's, which
    inductor fuses with its neighbours."""
    if not tracing() and native.normalizes(x, weight):
        return native.rms_norm(x, weight, eps)
    return fused.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """As `rms_norm`, the sum in the residual's dtype: a bf16 sublayer output into a float32 residual stream
    (a weight-only quantized model's) widened and added in float32 as torch's add does, in the same pass.
    Inside a compiled step torch adds first, as the fused override does."""
    if not tracing() and (residual.dtype == x.dtype or (x.dtype, residual.dtype) == (torch.bfloat16, torch.float32)) \
            and residual.shape == x.shape and native.normalizes(residual, weight):
        return native.add_rms_norm(x, residual, weight, eps)
    h = x + residual
    return rms_norm(h, weight, eps), h


def swiglu(gate_up, limit=None):
    """Eagerly, the backend's one-pass kernel (native.swiglu) for a llama MLP's rows; with a clamp (GLM,
    gpt-oss), more than two dims, or inside a compiled step (inductor fuses torch's ops), the reference."""
    if limit is None and not tracing() and native.gates(gate_up):
        return native.swiglu(gate_up)
    return reference.swiglu(gate_up, limit)


def argmax(logits):
    """The backend's kernel (native.argmax_rows: rows in parallel, ~10x torch's max-with-indices at 16 rows) where it
    takes the logits, else torch's."""
    if native.argmaxes(logits):
        return native.argmax_rows(logits)
    return reference.argmax(logits)


def sample_probs(logits, temperature, top_k, top_p, min_p):
    """The backend's kernel (native.sample_probs: rows in parallel, no sort of the vocabulary) where it takes the
    logits, else the reference."""
    if native.samples(logits):
        return native.sample_probs(logits, temperature, top_k, top_p, min_p)
    return reference.sample_probs(logits, temperature, top_k, top_p, min_p)


def draw(probs, u):
    """The backend's kernel (native.draw: rows in parallel, block by block) where it takes the rows, else the
    reference."""
    if native.samples(probs):
        return native.draw(probs, u)
    return reference.draw(probs, u)


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """Eagerly, the backend's one-pass kernel (native.rope_write_kv: a few us a decode layer where torch's
    rope and two index_copy_ cost ~100 us); inside a compiled step torch's ops, which inductor fuses."""
    if not tracing() and native.rotates(q, k, v, k_cache, v_cache):
        return native.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    q, k = rope(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Eagerly, while each sequence reads at most `native_max_keys` cache slots: the backend's own kernel
    (`native.paged_decode_attention`: one call for every row, each row's result independent of the others,
    so speculative verify rows equal lone decode rows bitwise). Past that, or where it is not built, three
    forms of one computation, by where it runs and how many keys the step reads (`python
    benchmarks/cpu_attention.py`). Inside a compiled step: two plain reductions in float32, which inductor
    turns into loops that read the gathered keys once (its lowering of a masked SDPA of one query row per
    sequence costs 3-6x more). Eagerly: torch's fused SDPA while the keys are few, and past that, for
    16-bit caches, two batched matmuls in the cache's dtype with the softmax in float32 (the fused kernel's
    cost grows ~1 us per key and sequence, the matmuls' mostly fixed: at 16 sequences of ~100 keys, ~0.9 ms
    against ~0.35 ms per layer). float32 caches keep SDPA: the dense float32 mode answers a sequence the
    same alone and batched. Query heads are grouped under their key head, so nothing is repeated."""
    if tracing():
        k, v, live = _gathered(k_cache, v_cache, block_tables, context_lens)  # [B, L, KH, D] x2, [B, L]
        s = (_grouped(q, k.shape[2]).float().unsqueeze(1) * k.float().unsqueeze(3)).sum(-1) * scale  # [B, L, KH, G]
        p = s.masked_fill(~live[:, :, None, None], float("-inf")).softmax(1)
        return (p.unsqueeze(-1) * v.float().unsqueeze(3)).sum(1).flatten(1, 2).to(q.dtype)
    if block_tables.shape[1] * k_cache.shape[1] <= TUNE["paged_attention_decode"]["native_max_keys"] and \
            native.attends(k_cache):
        # every row by one form whatever its neighbours: batched, alone and verify rows agree bitwise
        return native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if in_verify_step() and q.shape[0] > 1:
        return _rows_alone(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _eager_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def _rows_alone(q, k_cache, v_cache, block_tables, context_lens, scale):
    """A speculative verify step: each row computed as a lone decode row of its sequence would be (its own
    blocks only, the form its own key count picks, SDPA unmasked), because the forms round differently
    in 16-bit caches (masked SDPA over a padded table differs from the unmasked one by up to 4e-3 in bf16)
    and greedy verification must reproduce the unspeculated tokens exactly. Costs one small call per row."""
    bs = k_cache.shape[1]
    out = []
    for r, n in enumerate(context_lens.tolist()):
        w = -(-n // bs)
        out.append(paged_attention_decode(q[r : r + 1], k_cache, v_cache, block_tables[r : r + 1, :w],
                                          context_lens[r : r + 1], scale))
    return torch.cat(out)


def _eager_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    tune = TUNE["paged_attention_decode"]
    if (block_tables.numel() * k_cache.shape[1] <= tune["sdpa_max_keys"]
            or not _listed(k_cache.dtype, tune["matmul_dtypes"])):
        return fused.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_matmuls(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_matmuls(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The eager form past `sdpa_max_keys`: scores and weighted sum as batched matmuls in the cache's dtype,
    the softmax in float32 (also what `ops tune` and benchmarks/cpu_attention.py time against SDPA)."""
    k, v, live = _gathered(k_cache, v_cache, block_tables, context_lens)
    s = torch.matmul(_grouped(q, k.shape[2]).to(k.dtype), k.permute(0, 2, 3, 1)).float() * scale  # [B, KH, G, L]
    p = s.masked_fill(~live[:, None, None, :], float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(p, v.transpose(1, 2)).flatten(1, 2).to(q.dtype)


def _listed(dtype: torch.dtype, names: list[str]) -> bool:
    """Whether a tune-table list of dtype names ("bfloat16", ...) holds `dtype`."""
    return str(dtype).removeprefix("torch.") in names


def _gathered(k_cache, v_cache, block_tables, context_lens):
    """Each sequence's keys and values [B, L, KH, D] (L: the table's width in slots), and which of them
    are its own [B, L]."""
    b = block_tables.shape[0]
    idx = block_tables.reshape(-1).long()
    k, v = (c.index_select(0, idx).view(b, -1, *c.shape[2:]) for c in (k_cache, v_cache))
    return k, v, torch.arange(k.shape[1], device=k.device)[None, :] < context_lens[:, None]


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, H, D] as [B, KH, H / KH, D]: the query heads that share each key head."""
    b, h, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, d)


# ---- weight-only quantized linears: packed kernels for few rows, a dense copy past that ---------------

# oneDNN can lay a bf16 weight out for its AMX kernels once, instead of on every call: 1.5-2x faster
# at 16 rows (benchmarks/cpu_linear.py). The layout works for any row count; 16 is only a hint.
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()

# Prepared weight-only bundles by key, for `prepared_linear` (weak: an engine's weights go with it)
_PREPARED: weakref.WeakValueDictionary[int, Int4Weight | Int8Weight] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _keyed(w):
    key = next(_KEYS)
    w.prepared["key"] = key
    _PREPARED[key] = w
    return w


def _dense_copy(w) -> torch.Tensor:
    """The dense copy prompt rows and large batches multiply, in the tune table's dtype (bf16 where the CPU
    has bf16 matmuls, else float32), laid out once for oneDNN. Its matmul is row-invariant: a row's result
    does not depend on how many rows share the call (MKL's float32 GEMM takes another path below ~6 rows and
    rounds differently), so a prompt's tail after a prefix-cache hit computes what the whole prompt did."""
    dtype = getattr(torch, TUNE["weight_only_dense"]["dtype"])
    dense = w.dequantize(dtype)
    if torch.backends.mkldnn.is_available() and (dtype == torch.float32 or ONEDNN_BF16):
        return torch.ops.mkldnn._reorder_linear_weight(dense, 16)
    return dense


def _dense_mm(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x @ dense.T as bf16, whichever dtype the copy is in."""
    x = x.to(dense.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], "") if dense.is_mkldnn else F.linear(x, dense)
    return y.to(torch.bfloat16)


def _copy_beside_own_kernel(op: str, w) -> dict:
    """The dense copy kept beside the backend's own packed kernel's layout, unless the tune table says that
    kernel takes every step, prompts too (`dense_copy: false`: on AVX2 it beat the float32 copy at every row count,
    and the copy was 8x a 4-bit weight's bytes). Beside torch's kernels a copy is always kept."""
    return {"dense": _dense_copy(w)} if TUNE[op]["dense_copy"] else {}


def prepare_w4a16(w: Int4Weight):
    """The packed layout of the kernel that multiplies few rows (the backend's own int4 x int8 kernel where
    it builds, else torch's int4 GEMV) and, where the tune table keeps one, a dense copy for more rows."""
    if native.available() and native.fits(w):
        nib, dm = native.pack_q4(w)
        return _keyed(stripped(w, nib=nib, dm=dm, **_copy_beside_own_kernel("linear_w4a16", w)))
    if w.in_features % w.group_size or w.out_features % 16:
        return w  # neither packed kernel's tiling fits: stay canonical, run the reference
    packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
    sz = torch.stack((w.scales, w.zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return _keyed(stripped(w, packed=packed, scales_zeros=sz, dense=_dense_copy(w)))


def packed_w4a16(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """The few-row kernel of a prepared bundle. The backend's own kernel carries the activations as two int8
    parts per block of 32 (~15 bits: no rounding beyond its bf16 output's), or one where `q8_activations` set
    the bundle's "parts" to 1; torch's kernel multiplies in bf16."""
    p = w.prepared
    if "nib" in p:
        return native.q4_linear(x, p["nib"], p["dm"], p.get("parts", 2))
    return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p["packed"], w.group_size, p["scales_zeros"])


def _w4a16(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Decode rows up to `packed_max_m` take the packed kernel; prompt tokens always the dense copy, so that
    a prompt computes the same however much of it a prefix-cache hit skipped (the two kernels round
    differently: a cached prompt's first token drifted 0.16 in logprob when its last few tokens took the
    packed one). A bundle without a dense copy takes the packed kernel for every row, which holds the same."""
    if "dense" not in w.prepared:
        return packed_w4a16(x, w)
    packed, dense = functools.partial(packed_w4a16, w=w), w.prepared["dense"]
    m = TUNE["linear_w4a16"]["packed_max_m"]
    return _by_prompt_rows(x, lambda r: _dense_mm(r, dense), lambda r: _decode_rows(r, packed, dense, m))


def _by_prompt_rows(x: torch.Tensor, prompt, decode) -> torch.Tensor:
    """The leading rows of `x` that are prompt tokens (`ops.prefill_step`) through `prompt`, the decode rows after
    them through `decode`, as a step of decodes alone computes them."""
    k = prompt_rows(x.shape[0]) if in_prefill_step() else 0
    if k == 0:
        return decode(x)
    if k == x.shape[0]:
        return prompt(x)
    return torch.cat([prompt(x[:k]), decode(x[k:])])


def _decode_rows(x: torch.Tensor, packed, dense: torch.Tensor, m: int) -> torch.Tensor:
    """Decode rows of a bundle with a dense copy: the packed kernel up to `m` (`packed_max_m`) rows, the copy past
    them, except in a speculative verify step (e.g. 1 + K rows through the int8 LM head): the packed kernel in
    chunks of at most `m` rows, as plain decode rows of a small batch take it; the kernel is row-invariant (each
    row's result does not depend on the others), so verified tokens equal unspeculated ones."""
    if x.shape[0] <= m:
        return packed(x)
    if in_verify_step():
        return torch.cat([packed(c) for c in x.split(m)])
    return _dense_mm(x, dense)


def q8_activations(model) -> int:
    """The model's linears on the backend's own kernels (int4; int8, 5- and 6-bit: the LM head, a Q4_K_M file's
    Q6_K and Q5_0) take their activations as one int8 part per block of 32, llama.cpp's Q8 precision, instead of two
    (~15 bits): `serve --q8-activations`. Half the int4 kernel's products, and on AVX2 twice the rows a pass: a
    few-row step ~1.25x faster there (docs/performance.md, issue 54's twenty-fifth pass); the int8 kernel's products
    4 a vpdpbusd instead of 2 a vpdpwssd where the CPU has VNNI; at answers that may change. Returns how many weights
    took it (0: none is on those kernels)."""
    from flagdeploy.models.linear import Linear

    count = 0
    for m in model.modules():
        if isinstance(m, Linear):
            for bundle in m.bundles():
                p = getattr(bundle, "prepared", None)
                if isinstance(p, dict) and ("nib" in p or "w8" in p):
                    p["parts"] = 1
                    count += 1
    return count


def linear_w4a16(x, w: Int4Weight, bias=None):
    if w.prepared is None:  # left canonical by prepare_w4a16
        return reference.linear_w4a16(x, w, bias)
    y = prepared_linear(x, w.prepared["key"]) if _rows_unknown(x) else _w4a16(x, w)
    return y + bias.to(y.dtype) if bias is not None else y


def prepare_w8a16(w: Int8Weight):
    """The backend's own int8 kernel's layout where it builds (per channel, or per group of 16 or 32: a GGUF's
    Q6_K, Q8_0 / Q5_0 linears), else for per-channel weights torch's int8 GEMV's; and a dense copy for more rows.
    Other group sizes, or groups without the kernel: the dense copy only."""
    if native.available() and native.fits_q8(w):
        w8, d = native.pack_q8(w)
        return _keyed(stripped(w, w8=w8, d=d, **_copy_beside_own_kernel("linear_w8a16", w)))
    if w.group_size:
        return _keyed(stripped(w, dense=_dense_copy(w)))
    return _keyed(stripped(w, q=w.q, scales=w.scales.to(torch.bfloat16), dense=_dense_copy(w)))


def packed_w8a16(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The few-row kernel of a prepared per-channel bundle. The backend's own kernel carries the activations
    as ~15-bit integers (csrc/q8_linear.cpp), or as one int8 part where `q8_activations` set "parts" to 1; torch's
    multiplies in bf16."""
    p = w.prepared
    if "w8" in p:
        return native.q8_linear(x, p["w8"], p["d"], p.get("parts", 2))
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), p["q"], p["scales"])


def _w8a16(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    p = w.prepared
    if "dense" not in p:  # the backend's own kernel takes every row (see _w4a16)
        return packed_w8a16(x, w)
    if "w8" not in p and "q" not in p:
        return _dense_mm(x, p["dense"])
    packed, dense = functools.partial(packed_w8a16, w=w), p["dense"]
    m = TUNE["linear_w8a16"]["packed_max_m"]
    # a prompt's rows: the packed kernel up to `m` of them, as before a prompt arrived beside decodes
    return _by_prompt_rows(x, lambda r: packed(r) if r.shape[0] <= m else _dense_mm(r, dense),
                           lambda r: _decode_rows(r, packed, dense, m))


def linear_w8a16(x, w: Int8Weight, bias=None):
    y = prepared_linear(x, w.prepared["key"]) if _rows_unknown(x) else _w8a16(x, w)
    return y + bias.to(y.dtype) if bias is not None else y


def _rows_unknown(x: torch.Tensor) -> bool:
    """Whether a compile trace is of a step whose row count is only known at run time, where the kernel
    must be picked inside `prepared_linear`. The one-row graph (a lone sequence's) calls the packed kernel
    directly: the opaque op costs ~8 us a call. (A dynamic size is at least 2 to the tracer, so `!= 1`
    holds there without a guard.)"""
    return tracing() and x.shape[0] != 1


if hasattr(torch.ops.flagdeploy_cpu, "prepared_linear"):  # the op's weight table is this module's own
    raise ImportError(f"the cpu backend's ops were imported a second time, as {__name__}: a second copy would "
                      "register prepared_linear against an empty weight table of its own. Import them as "
                      "flagdeploy.backends.cpu.ops (the installed name), not through the repository's backends/.")


@torch.library.custom_op("flagdeploy_cpu::prepared_linear", mutates_args=())
def prepared_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """`linear_w4a16` / `linear_w8a16` (no bias) on the prepared bundle `_PREPARED[key]`, as one op that
    torch.compile does not look into: a compiled step keeps the eager step's choice of kernel by row
    count, made at run time, and oneDNN's laid-out weight (an opaque tensor dynamo cannot trace) stays
    out of the graph."""
    w = _PREPARED[key]
    return _w4a16(x, w) if isinstance(w, Int4Weight) else _w8a16(x, w)


@prepared_linear.register_fake
def _(x, key):
    return x.new_empty(x.shape[0], _PREPARED[key].out_features, dtype=torch.bfloat16)


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference's W8A8 arithmetic with the int32 accumulation in oneDNN (`_int_mm`, exact)."""
    qx, sx = reference.dynamic_quant(x.to(reference.a16_dtype(x.dtype)))
    return (torch._int_mm(qx, q.t()).float() * sx[:, None] * scales.float()).to(reference.a16_dtype(x.dtype))


def linear_w8a8_dynamic(x, w: W8A8Weight, bias=None):
    y = _int8_mm(x, w.q, w.scales)
    return y + bias.to(y.dtype) if bias is not None else y


# ---- GLM-5.3-Flash ops ---------------------------------------------------------------------------


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """The reference with its Sinkhorn (20 iterations of three tiny ops on [T, N, N]) run by numpy on the
    same memory: the same arithmetic in the same order, bit for bit, at half torch's per-op dispatch cost,
    which is what a decode step's 16 calls of it are made of."""
    pre, post, comb = glm.hc_gates(streams, fn, base, scale, norm_eps, hc_eps)
    if comb.is_contiguous() and not comb.requires_grad and comb.dtype in (torch.float32, torch.float64):
        c = comb.numpy()
        c /= c.sum(-2, keepdims=True) + hc_eps
        for _ in range(sinkhorn_iters - 1):
            c /= c.sum(-1, keepdims=True) + hc_eps
            c /= c.sum(-2, keepdims=True) + hc_eps
    else:
        glm.sinkhorn_(comb, sinkhorn_iters, hc_eps)
    return glm.hc_collapse(streams, pre, post, comb)


def prepare_linear(w: torch.Tensor) -> torch.Tensor:
    """A dense weight [N, K] stored column-major (a view of a [K, N] buffer) where the tune table says
    MKL's GEMM reads it faster at decode's few rows: many outputs from few inputs. The same [N, K] tensor
    for every reader; only its strides change."""
    t = TUNE["linear"]
    if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] >= t["column_major_min_out"]
            and w.shape[1] <= t["column_major_max_in"]):
        return w.t().contiguous().t()
    return w


def _relaid(t: torch.Tensor, order: tuple[int, ...]) -> nn.Parameter:
    """`t` with its memory in dimension order `order`, indexed as before."""
    return nn.Parameter(t.permute(*order).contiguous().permute(*(order.index(d) for d in range(t.dim()))),
                        requires_grad=False)


def prepare_moe_banks(banks):
    """Dense banks in the layout `dense_experts`' two matmuls read without a copy: down [E, H, I] of an
    [H, E, I] buffer (its rows, [H, E * I], take all experts' weighted SwiGLU outputs at once); gate_up
    [E, 2I, H] as stored ([E * 2I, H] rows: what oneDNN's bf16 kernel reads fastest) or, for the dtypes
    the tune table lists (MKL's float32 GEMM), as a view of an [H, E, 2I] buffer (one column-major
    weight, see `prepare_linear`). Still [E, 2I, H] / [E, H, I] tensors for the reference and every other
    reader. Banks too large for the dense path (or quantized) stay as they are."""
    gate_up, down = banks
    dense = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    t = TUNE["moe_experts"]
    if dense and gate_up.shape[0] <= t["dense_max_token_experts"]:
        if _listed(gate_up.dtype, t["column_major_gate_up"]):
            gate_up = _relaid(gate_up, (2, 0, 1))
        down = _relaid(down, (1, 0, 2))
    return gate_up, down


def moe_experts(x, routing, gate_up, down, limit, top_k=None):
    """Few tokens (decode): every expert on every token, weighted by the (mostly zero) routing, in two
    matmuls over all experts at once — far fewer ops than the reference's per-expert gather/scatter loop,
    which more tokens (prefill) and many experts still use (as one opaque op: `looped_experts`), where
    computing unpicked experts would waste real work. W8A8 expert banks run integer matmuls per picked
    expert; W8A16 banks the reference."""
    if isinstance(gate_up, W8A8Weight) and isinstance(down, W8A8Weight):
        return _moe_experts_w8a8(x, routing, gate_up, down, limit)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return OPS["moe_experts"].reference(x, routing, gate_up, down, limit)
    if x.shape[0] * gate_up.shape[0] > TUNE["moe_experts"]["dense_max_token_experts"]:
        return looped_experts(x, routing, gate_up, down, limit)
    return dense_experts(x, routing, gate_up, down, limit)


@torch.library.custom_op("flagdeploy_cpu::looped_experts", mutates_args=())
def looped_experts(x: torch.Tensor, routing: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   limit: float | None) -> torch.Tensor:
    """The reference's per-expert loop (only the picked experts, each on its own tokens) as one op that
    torch.compile does not look into: the loop reads the routing on the host, which would otherwise
    break a compiled decode step into pieces (GLM-5.3-Flash's 288 experts at any batch)."""
    return OPS["moe_experts"].reference(x, routing, gate_up, down, limit)


@looped_experts.register_fake
def _(x, routing, gate_up, down, limit):
    return torch.empty_like(x)


def dense_experts(x, routing, gate_up, down, limit=None):
    """sum_e routing[:, e] * down_e(swiglu(gate_up_e x)) as x [T, H] @ [H, E * 2I], the routing-weighted
    SwiGLU [T, E * I] @ [E * I, H] (the weighting moved before down: it is linear). Both weights are views
    of banks laid out by `prepare_moe_banks` (copies of others)."""
    (t, h), (e, i2) = x.shape, gate_up.shape[:2]
    w = gate_up.dtype  # bfloat16 banks under float32 activations: bf16 matmuls (AMX), the rest in x's dtype
    gate, up = F.linear(x.to(w), gate_up.reshape(e * i2, h)).to(x.dtype).view(t, e, i2).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    act = (F.silu(gate) * up * routing.to(x.dtype)[..., None]).reshape(t, e * (i2 // 2))
    return F.linear(act.to(w), down.permute(1, 0, 2).reshape(h, e * (i2 // 2))).to(x.dtype)


def _moe_experts_w8a8(x, routing, gate_up: W8A8Weight, down: W8A8Weight, limit):
    """The reference's per-expert loop with integer matmuls: x is quantised once for every expert
    (its per-token scale does not depend on the expert)."""
    out = torch.zeros_like(x)
    qx, sx = reference.dynamic_quant(x.to(reference.a16_dtype(x.dtype)))
    for e in (routing != 0).any(0).nonzero().flatten().tolist():
        rows = (routing[:, e] != 0).nonzero().flatten()
        h = torch._int_mm(qx[rows], gate_up.q[e].t()).float() * sx[rows, None] * gate_up.scales[e].float()
        gate, up = h.to(reference.a16_dtype(x.dtype)).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        y = _int8_mm(F.silu(gate) * up, down.q[e], down.scales[e])
        out.index_add_(0, rows, (y * routing[rows, e, None]).to(out.dtype))
    return out
