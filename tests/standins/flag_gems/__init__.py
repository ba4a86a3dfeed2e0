"""A CPU stand-in for the FlagGems functions flagdeploy's generic backend calls.

Written from FlagGems' documented 5.0.2 signatures as summarised in docs/flaggems-and-vendors.md (the
shared facts file), not from its code: each function computes in plain torch what the real one is
documented to compute, with its argument order and layouts, its in-place writes (fused_add_rms_norm,
reshape_and_cache_flash) and its assertions (rotary cos/sin of width D/2). What it does not model raises
NotImplementedError, never a silent approximation. Nothing here was compared with the real library.

Usage: put tests/standins on sys.path, `import flag_gems`. `CALLS` counts calls per function, so tests can
see which candidate ran; `BROKEN` holds names of functions to compute deliberately wrong answers (tests of
the rule that a failing candidate is never chosen).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

__version__ = "5.0.2+standin"

CALLS: Counter = Counter()
BROKEN: set[str] = set()


def _count(name):
    CALLS[name] += 1
    return name in BROKEN


def _acc(x):
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x, normalized_shape, weight, eps=1e-5):
    broken = _count("rms_norm")
    if list(normalized_shape) != [x.shape[-1]]:
        raise NotImplementedError("stand-in: normalized_shape over the last dim only")
    xf = x.to(_acc(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (y * weight.to(y.dtype)).to(x.dtype)
    return out * 1.5 if broken else out


def fused_add_rms_norm(x, residual, normalized_shape, weight, eps=1e-5):
    """In place on contiguous inputs: x becomes the normed sum, residual the sum; returns (x, residual)."""
    _count("fused_add_rms_norm")
    x, residual = x.contiguous(), residual.contiguous()
    residual.add_(x)
    x.copy_(rms_norm(residual, normalized_shape, weight, eps))
    CALLS["rms_norm"] -= 1
    return x, residual


def silu_and_mul(a, b):
    broken = _count("silu_and_mul")
    out = (F.silu(a.to(_acc(a))) * b.to(_acc(b))).to(a.dtype)
    return out + 1 if broken else out


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, rotary_interleaved=False, inplace=False):
    _count("apply_rotary_pos_emb")
    d = q.shape[-1]
    assert cos.shape[-1] == d // 2 and sin.shape[-1] == d // 2, "cos/sin must have width head_dim / 2"
    if rotary_interleaved or inplace:
        raise NotImplementedError("stand-in: rotate-half, out of place only")
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Caches [num_blocks, block_size, KH, D]; token t goes to slot slot_mapping[t] (negative: skipped)."""
    _count("reshape_and_cache_flash")
    if kv_cache_dtype not in ("auto",):
        raise NotImplementedError("stand-in: kv_cache_dtype 'auto' only (5.0.2 has no fp8 cache)")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def _attend(q, k, v, scale, causal):
    h, kh = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // kh, 1), v.repeat_interleave(h // kh, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:  # bottom-right aligned, as FlashAttention 2
        tq, tk = q.shape[0], k.shape[0]
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, **unmodelled):
    _count("flash_attn_varlen_func")
    if unmodelled or q_v is not None or dropout_p or softcap or alibi_slopes is not None or return_attn_probs \
            or return_softmax_lse or (window_size not in (None, (-1, -1), [-1, -1])):
        raise NotImplementedError("stand-in: plain causal/non-causal varlen and paged attention only")
    assert k.stride() == v.stride()  # as flash_api.mha_varlan_fwd asserts (5.0.2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    res = torch.empty_like(q) if out is None else out
    cq = cu_seqlens_q.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]]
        if block_table is not None:  # paged K/V [num_pages, block_size, KH, D], lengths from seqused_k
            n = int(seqused_k[i])
            bs = k.shape[1]
            pages = block_table[i, : (n + bs - 1) // bs].long()
            ki, vi = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
        else:
            ck = cu_seqlens_k.tolist()
            ki, vi = k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
            if seqused_k is not None:
                ki, vi = ki[: int(seqused_k[i])], vi[: int(seqused_k[i])]
        res[cq[i]:cq[i + 1]] = _attend(qi, ki, vi, scale, causal)
    return res


def argmax(inp, dim=None, keepdim=False):
    _count("argmax")
    return torch.argmax(inp, dim=dim, keepdim=keepdim)


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    _count("embedding")
    return weight[indices]


def mm(a, b):
    _count("mm")
    return (a.to(_acc(a)) @ b.to(_acc(b))).to(a.dtype)


def addmm(bias, a, b, beta=1, alpha=1):
    _count("addmm")
    return (beta * bias.to(_acc(a)) + alpha * (a.to(_acc(a)) @ b.to(_acc(b)))).to(a.dtype)


def outplace_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
    """w1 [E, 2N, K] (gate rows then up), w2 [E, K, N]; silu(gate) * up, then down, weighted and summed."""
    _count("outplace_fused_experts")
    if args or kwargs:
        raise NotImplementedError("stand-in: no quantized or activation options")
    x = hidden_states
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w1[e].float() @ x[t].float()).chunk(2)
            out[t] += w * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
