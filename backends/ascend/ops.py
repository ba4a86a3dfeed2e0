"""Ascend overrides: each op through the public torch_npu function documented for it.

Every call follows /work/shared/docs/ascend-torch-npu.md (ADOC; section numbers in brackets). torch_npu is
imported inside the ops, never at module import, because the op registry imports every installed backend
on every machine. Arguments after `*` are passed by name (ADOC rule 1), and every argument whose default
is a documented trap is passed explicitly; the docstrings say which.

Where the chip's op does not take a dtype (FIA takes fp16/bf16 queries only) or its documented semantics
differ from the reference, the override hands the call to the reference, so a float32 model still runs.
"""

from __future__ import annotations

import functools
import importlib

import torch

from flagdeploy.ops import reference
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Int8Weight, W8A8Weight, stripped

ACL_FORMAT_FRACTAL_NZ = 29  # ADOC rule 5 (ND is 2)
_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _npu():
    """torch_npu, imported on first use (the backend package must import on machines without it)."""
    return importlib.import_module("torch_npu")


def _ref(name: str):
    return OPS[name].reference


# ---- norms [1.1] ------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm -> (y, rstd). epsilon is passed: its default 1e-6 is not the model's eps.
    gamma must have x's dtype; a weight of another dtype would change the reference's output dtype,
    so that (rare) case stays on the reference."""
    if x.dtype not in _FLOAT or weight.dtype != x.dtype:
        return _ref("rms_norm")(x, weight, eps)
    y, _rstd = _npu().npu_rms_norm(x, weight, epsilon=eps)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """npu_add_rms_norm -> (y, rstd, x_sum); the op returns x_sum third, the reference second."""
    if x.dtype not in _FLOAT or weight.dtype != x.dtype or residual.dtype != x.dtype:
        return _ref("add_rms_norm")(x, residual, weight, eps)
    y, _rstd, h = _npu().npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, h


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm in float32, then the sigmoid gate: the reference keeps float32 throughout (no rounding
    between the norm and the gate), so the op is called in float32, which it takes."""
    if x.dtype not in _FLOAT:
        return _ref("gated_rms_norm")(x, gate, weight, eps)
    y, _ = _npu().npu_rms_norm(x.float(), weight.float(), epsilon=eps)
    return (y * gate.float().sigmoid()).to(x.dtype)


# ---- rope [1.2] ---------------------------------------------------------------------------------------


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """npu_rotary_mul, rotary_mode='half' (NeoX rotate-half, the reference's layout).

    q and k go through one call as BSND [T, 1, H+KH, D]. cos/sin must be shaped like x: the reference's
    half-width tables [T, D/2] are repeated to the full D and viewed [T, 1, 1, D] (VA's shape), in x's
    dtype. npu_apply_rotary_pos_emb is not used: on A2/A3 it takes only D in {64, 128} and works in place.
    """
    if q.dtype not in _FLOAT:
        return _ref("rope")(q, k, cos, sin)
    h = q.shape[1]
    x = torch.cat((q, k), dim=1).unsqueeze(1)
    c = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, None, :]
    s = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, None, :]
    out = _npu().npu_rotary_mul(x, c, s, rotary_mode="half").squeeze(1)
    return out[:, :h], out[:, h:]


# ---- swiglu [1.3] -------------------------------------------------------------------------------------


def _clamp_halves(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The GLM clamp (gate <= limit, |up| <= limit) applied before npu_swiglu. npu_clipped_swiglu is not
    a match: its documented defaults (alpha=1.702, bias=1.0, interleaved=True) are GPT-OSS's formula and
    ADOC gives no formula that would let us set it to silu(gate)*up exactly."""
    if limit is None:
        return gate_up
    i = gate_up.shape[-1] // 2
    return torch.cat((gate_up[..., :i].clamp(max=limit), gate_up[..., i:].clamp(min=-limit, max=limit)), dim=-1)


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """npu_swiglu(x, dim=-1): the first half is the gate, as in [gate | up] packing."""
    if gate_up.dtype not in _FLOAT:
        return _ref("swiglu")(gate_up, limit)
    return _npu().npu_swiglu(_clamp_halves(gate_up, limit), dim=-1)


# ---- attention [1.4] ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _causal_mask(device: str) -> torch.Tensor:
    """The compressed 2048x2048 mask sparse_mode 2/3 require: int8 upper triangle, 1 = masked (VA)."""
    return torch.triu(torch.ones(2048, 2048, device=device), diagonal=1).to(torch.int8)


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    """FIA in TND: q [T, N, D], k/v [T_kv, N_kv, D] packed.

    - actual_seq_lengths / actual_seq_lengths_kv: CUMULATIVE ends (cu[1:]), as TND requires (rule 3);
    - num_heads and num_key_value_heads always: defaults 1 and 0 (= num_heads) mis-shape GQA;
    - scale always: the default 1.0 silently gives wrong attention;
    - sparse_mode=3 (rightDown causal) with the 2048 mask: queries are the LAST positions of their
      sequence, exactly the reference's bottom-right alignment for a chunk after a cached prefix.
    Query dtype must be fp16/bf16 (ADOC), so float32 stays on the reference.
    """
    if q.dtype not in _HALF:
        return _ref("attention_prefill")(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    out, _lse = _npu().npu_fused_infer_attention_score(
        q, k, v,
        atten_mask=_causal_mask(str(q.device)),
        actual_seq_lengths=cu_seqlens_q[1:].tolist(),
        actual_seq_lengths_kv=cu_seqlens_k[1:].tolist(),
        num_heads=q.shape[1],
        num_key_value_heads=k.shape[1],
        scale=scale,
        input_layout="TND",
        sparse_mode=3,
    )
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """FIA in BSND with a paged cache: q [B, 1, N, D] (S_q = 1 takes the decode branch).

    - key/value: the cache [num_blocks, block_size, N_kv, D] viewed [num_blocks, block_size, N_kv*D],
      the only paged shape BSND accepts;
    - block_table int32 and block_size (any value <= 512 for decode);
    - actual_seq_lengths_kv: PER-REQUEST lengths, mandatory with a block_table (rule 3);
    - num_heads, num_key_value_heads, scale always; sparse_mode=0 and no mask (the new token sees all).
    """
    nb, bs, kh, d = k_cache.shape
    if q.dtype not in _HALF or bs > 512:
        return _ref("paged_attention_decode")(q, k_cache, v_cache, block_tables, context_lens, scale)
    out, _lse = _npu().npu_fused_infer_attention_score(
        q.unsqueeze(1),
        k_cache.view(nb, bs, kh * d),
        v_cache.view(nb, bs, kh * d),
        block_table=block_tables.to(torch.int32),
        block_size=bs,
        actual_seq_lengths_kv=context_lens.tolist(),
        num_heads=q.shape[1],
        num_key_value_heads=kh,
        scale=scale,
        input_layout="BSND",
        sparse_mode=0,
    )
    return out.squeeze(1)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """npu_scatter_pa_kv_cache with cache_mode="Norm": ND caches [num_blocks, block_size, N_kv, D]. The
    default cache_mode is "PA_NZ" (NZ caches), so it is always passed. Inputs must be contiguous. float32
    is not in the op's documented dtypes, so float32 caches stay on the reference."""
    if k_cache.dtype not in _HALF:
        return _ref("write_kv_cache")(k, v, k_cache, v_cache, slot_mapping)
    _npu().npu_scatter_pa_kv_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, cache_mode="Norm")


# ---- quantized linears [1.7] --------------------------------------------------------------------------


def prepare_w8a8(w: W8A8Weight) -> W8A8Weight:
    """Weight transposed to (K, N), then cast to FRACTAL_NZ (29), as VA stores W8A8_DYNAMIC weights
    (rule 5); the per-channel scale kept float32 (bf16 output takes fp32 or bf16; fp16 output only fp32)."""
    return stripped(w, **_w8a8_layout(w.q, w.scales))


def _w8a8_layout(q: torch.Tensor, scales: torch.Tensor) -> dict:
    q_kn = q.transpose(-1, -2).contiguous()
    return {"q_kn": _npu().npu_format_cast(q_kn, ACL_FORMAT_FRACTAL_NZ), "scale": scales.float().contiguous()}


def linear_w8a8_dynamic(x: torch.Tensor, w: W8A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """npu_dynamic_quant (per-token int8) + npu_quant_matmul(pertoken_scale=..., output_dtype=bf16|fp16).
    output_dtype is always passed: the default output is int8 (needing an int64 scale). The bias is added
    after the op: ADOC does not give its dtype for this path."""
    a = reference.a16_dtype(x.dtype)
    if a not in _HALF:
        return _ref("linear_w8a8_dynamic")(x, w, bias)
    p = w.prepared if isinstance(w.prepared, dict) and "q_kn" in w.prepared else _w8a8_layout(w.q, w.scales)
    npu = _npu()
    x2 = x.to(a).reshape(-1, x.shape[-1])
    qx, sx = npu.npu_dynamic_quant(x2)
    y = npu.npu_quant_matmul(qx, p["q_kn"], p["scale"], pertoken_scale=sx, output_dtype=a)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + bias.to(y.dtype) if bias is not None else y


def prepare_w8a16(w: Int8Weight) -> Int8Weight:
    """Weight (K, N) int8, ND (npu_weight_quant_batchmatmul takes ND or NZ; ND needs no padding rules);
    scales transposed to (N,) or (K/g, N), kept float32 and cast to the activation dtype per call."""
    return stripped(w, q_kn=w.q.t().contiguous(), scale=w.scales.float().t().contiguous())


def linear_w8a16(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """npu_weight_quant_batchmatmul(x, W_kn, antiquant_scale, antiquant_group_size=g): x in 16 bits
    (float32 activations run in bf16, as the reference's A16 linears do); antiquant_scale in x's dtype."""
    a = reference.a16_dtype(x.dtype)
    if a not in _HALF:
        return _ref("linear_w8a16")(x, w, bias)
    p = w.prepared if isinstance(w.prepared, dict) and "q_kn" in w.prepared else \
        {"q_kn": w.q.t().contiguous(), "scale": w.scales.float().t().contiguous()}
    x2 = x.to(a).reshape(-1, x.shape[-1])
    y = _npu().npu_weight_quant_batchmatmul(x2, p["q_kn"], p["scale"].to(a), antiquant_group_size=w.group_size)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + bias.to(y.dtype) if bias is not None else y


# ---- MoE [1.6] ----------------------------------------------------------------------------------------


def moe_router(x, weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """Router logits in float32 (x @ W^T, as the reference), then npu_moe_gating_top_k with norm_type=1
    (sigmoid), bias = the correction bias (selection only), group_select_mode=1 (groups ranked by the sum
    of their two best biased scores), renorm=0 (the only value supported: with norm_type=1 the op divides
    by the sum + eps itself), routed_scaling_factor and eps=1e-20 as the reference.

    Reference instead when the op's fixed behaviour differs: norm_topk_prob False (the op always
    renormalises sigmoid weights), groups of one expert (top-2 sum undefined), more than 2048 experts.
    """
    e = weight.shape[0]
    if (not norm_topk_prob or x.dtype not in _FLOAT or e > 2048 or e % n_group or e // n_group < 2):
        return _ref("moe_router")(x, weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                                  routed_scaling_factor)
    logits = x.float() @ weight.float().t()
    y, idx, _ = _npu().npu_moe_gating_top_k(
        logits, top_k, bias=correction_bias.float(), k_group=topk_group, group_count=n_group,
        group_select_mode=1, renorm=0, norm_type=1, routed_scaling_factor=routed_scaling_factor, eps=1e-20,
    )
    return torch.zeros_like(logits).scatter_(1, idx.long(), y.float()).to(x.dtype)


def prepare_moe_banks(banks):
    """(gate_up, down) in the layout npu_grouped_matmul reads: weight [E, K, N] (a W8A8 bank also cast to
    NZ, scales [E, N] float32). Dense banks stay as they are and are transposed as a view per call."""
    return tuple(stripped(w, **_w8a8_layout(w.q, w.scales)) if isinstance(w, W8A8Weight) else w for w in banks)


def _bank(w):
    """(weight [E, K, N], scale [E, N] or None) from a dense or W8A8 bank, prepared or not."""
    if isinstance(w, torch.Tensor):
        return w.transpose(1, 2), None
    p = w.prepared if isinstance(w.prepared, dict) and "q_kn" in w.prepared else _w8a8_layout(w.q, w.scales)
    return p["q_kn"], p["scale"]


def _gmm(x, bank, counts, row_scale, out_dtype):
    """npu_grouped_matmul with split_item=2 (one output tensor), group_type=0 (split on M) and
    group_list_type=1 (per-expert counts, as init_routing_v2 returns them with expert_tokens_num_type=1)."""
    w, scale = _bank(bank)
    kwargs = {}
    if scale is not None:  # W8A8: per-channel weight scale, per-token activation scale, 16-bit output
        kwargs = {"scale": [scale], "per_token_scale": [row_scale], "output_dtype": out_dtype}
    return _npu().npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1,
                                     **kwargs)[0]


def moe_experts(x, routing, gate_up, down, limit, top_k=None):
    """npu_moe_init_routing_v2 -> npu_grouped_matmul (gate_up) -> clamp + npu_swiglu -> npu_grouped_matmul
    (down) -> npu_moe_token_unpermute(probs = routing weights), as VA's A2/A3 path.

    The dense [T, E] routing becomes per-token expert ids (int32, as init_routing requires) and weights;
    tokens with fewer picks than the widest row get zero-weight padding picks, which add exactly zero.
    With `top_k` given the width is known without reading the routing back (graph capture).
    W8A8 banks quantise the routed tokens in init_routing (quant_mode=1: per-row int8 + fp32 scale, the
    reference's per-token dynamic quantisation) and the SwiGLU output with npu_dynamic_quant. quant_mode
    is always passed: older op docs give it a default of 0 (static int8). W8A16 (Int8Weight) banks stay on
    the reference: ADOC documents no per-group antiquant form of the grouped matmul.
    """
    quant = isinstance(gate_up, W8A8Weight) and isinstance(down, W8A8Weight)
    dense = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if not (quant or dense) or x.dtype not in _FLOAT or (dense and gate_up.dtype != x.dtype):
        return _ref("moe_experts")(x, routing, gate_up, down, limit)
    t, e = routing.shape
    k = (top_k if top_k is not None else int((routing != 0).sum(-1).max())) if t else 0
    if k == 0:
        return torch.zeros_like(x)
    ids = torch.sort((routing != 0).to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
    probs = routing.gather(1, ids)
    npu = _npu()
    act = reference.a16_dtype(x.dtype) if quant else x.dtype
    hx, row_idx, counts, row_scale = npu.npu_moe_init_routing_v2(
        x.to(act), ids.to(torch.int32), active_num=t * k, expert_num=e, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=1 if quant else -1,
    )
    h = npu.npu_swiglu(_clamp_halves(_gmm(hx, gate_up, counts, row_scale, act), limit), dim=-1)
    if quant:
        h, h_scale = npu.npu_dynamic_quant(h)
        y = _gmm(h, down, counts, h_scale, act)
    else:
        y = _gmm(h, down, counts, None, act)
    out = npu.npu_moe_token_unpermute(y.to(x.dtype), row_idx, probs=probs.to(x.dtype))
    return out.to(x.dtype)
