"""Paged attention for a mixed batch: the runner's metadata plus the op calls every model shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flagdeploy import ops


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map onto sequences and cache slots.

    Tokens of prefill sequences come first (`num_prefill_tokens` of them), then one token per decoding
    sequence. `prefill_kv_slots` is set when some prefill sequence has keys already in the cache (a
    prefix-cache hit or an earlier chunk): the prefill then reads its keys back from the cache.
    """

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot per token
    num_prefill_tokens: int
    cu_seqlens_q: torch.Tensor | None  # [P+1] prefill sequences
    cu_seqlens_k: torch.Tensor | None
    prefill_kv_slots: torch.Tensor | None  # [sum k] or None
    block_tables: torch.Tensor | None  # [D, max_blocks] decoding sequences
    context_lens: torch.Tensor | None  # [D]
    logits_indices: torch.Tensor  # rows whose next token is sampled


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KH, D] → [T, H, D]. This step's k/v are already in the cache (the model
    wrote them with `ops.rope_write_kv`): decode rows read them from there, prefill rows from k/v."""
    p = meta.num_prefill_tokens
    parts = []
    if p:
        if meta.prefill_kv_slots is not None:
            kk = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, meta.prefill_kv_slots)
            vv = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, meta.prefill_kv_slots)
        else:
            kk, vv = k[:p], v[:p]
        parts.append(ops.attention_prefill(q[:p], kk, vv, meta.cu_seqlens_q, meta.cu_seqlens_k, scale))
    if q.shape[0] > p:
        parts.append(ops.paged_attention_decode(q[p:], k_cache, v_cache, meta.block_tables, meta.context_lens, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
