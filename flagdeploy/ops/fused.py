"""Overrides built from torch's own fused kernels (SDPA, fused RMSNorm, index_copy): device-agnostic, so
every backend whose torch device has those kernels (cpu, cuda, ...) shares them instead of copying them.
Same semantics as `flagdeploy.ops.reference`; checked against it like any override."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import tracing


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    h = x + residual
    return rms_norm(h, weight, eps), h


def rope(q, k, cos, sin):
    """q and k rotated together: one pass of elementwise ops instead of two."""
    h = q.shape[1]
    x = torch.cat((q, k), dim=1).to(cos.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(q.dtype)
    return out[:, :h], out[:, h:]


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    """Per sequence, one SDPA call in the shape the fast kernels take: [1, heads, T, D], on the GPU with
    the kv heads repeated to the query heads (with 3-D inputs and `enable_gqa`, torch 2.11 on the H200
    fell back to the math kernel, which materialises T x T scores: 8x slower than transformers at 8k)."""
    out = torch.empty_like(q)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    group = q.shape[1] // k.shape[1]
    for i in range(len(bq) - 1):
        qi = q[bq[i] : bq[i + 1]].transpose(0, 1).unsqueeze(0)
        ki = k[bk[i] : bk[i + 1]].transpose(0, 1).unsqueeze(0)
        vi = v[bk[i] : bk[i + 1]].transpose(0, 1).unsqueeze(0)
        gqa = {}
        if group > 1 and q.is_cuda:
            ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
        elif group > 1:  # the CPU kernels take GQA as it is (repeating would only add copies)
            gqa = {"enable_gqa": True}
        tq, tk = qi.shape[2], ki.shape[2]
        if tq == tk:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, **gqa)
        else:  # queries are the last tq positions: causal mask aligned bottom-right
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, **gqa)
        out[bq[i] : bq[i + 1]] = o[0].transpose(0, 1)
    return out


def _recorded(x: torch.Tensor) -> bool:
    """Whether this call is being recorded for replay (a CUDA graph capture or a torch.compile trace),
    where a host read of a tensor's value has no place."""
    return tracing() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """All sequences at once: gather each one's blocks, mask past its length, one batched SDPA."""
    b = q.shape[0]
    idx = block_tables.reshape(-1).long()  # index_select: ~3x faster than fancy indexing here
    k = k_cache.index_select(0, idx).view(b, -1, *k_cache.shape[2:]).transpose(1, 2)  # [B, KH, L, D]
    v = v_cache.index_select(0, idx).view(b, -1, *v_cache.shape[2:]).transpose(1, 2)
    if b == 1 and not _recorded(q):  # one sequence: its first n keys are exactly its keys, no mask needed
        n = int(context_lens[0])  # a host read: never inside a capture or a trace (the masked form below is)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k[:, :, :n], v[:, :, :n], scale=scale, enable_gqa=True)
        return o.squeeze(2)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, :] < context_lens[:, None]).view(b, 1, 1, -1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
