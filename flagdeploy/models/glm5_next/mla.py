"""glm5_next's sparse latent attention: NoPE multi-head latent attention (MLA) over the keys the DSA
kpool indexer selects, with the latent and the indexer rows cached per token. Apart from KDA, the
other token mixer, with which it shares no code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flagdeploy import ops
from flagdeploy.ops import glm as glm_ops

from ..linear import column_parallel, row_parallel
from .cache import DecodeBatch, MlaCache, Span
from .common import _head_shard, _lin, _local_heads, _param
from .config import Glm5Config


class DsaIndexer(nn.Module):
    """Per-token indexer key and pool gate (cached), and the query side that picks the pools."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        di = c.index_head_dim
        self.wq_b = _lin(c.index_n_heads * di, c.q_lora_rank, dtype, "wq_b")
        # the three projections of the block input (key, pool gate, head weights) as one matmul, replicated
        parts = {"wk": di, "index_kpool_compress_gate": di, "weights_proj": c.index_n_heads}
        self.in_proj = column_parallel(parts, c.hidden_size, dtype, shards=dict.fromkeys(parts))
        self.in_split = tuple(parts.values())
        self.k_norm_weight = _param(di, dtype=dtype)
        self.k_norm_bias = _param(di, dtype=dtype)
        self.compress_ape = _param(c.index_kpool, di, dtype=dtype)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, caches: list[MlaCache], spans: list[Span]):
        """Per sequence, the selection mask [T_i, S_i] of its new tokens over all its tokens."""
        c = self.c
        keys, gate, weights = self._project(h)
        q = self.wq_b(q_resid).view(h.shape[0], c.index_n_heads, c.index_head_dim)
        masks = []
        for cache, (a, b, start) in zip(caches, spans):
            cache.index_keys.append(keys[a:b])
            cache.index_gate.append(gate[a:b])
            masks.append(glm_ops.dsa_indexer_topk(q[a:b], weights[a:b], cache.index_keys.all(), cache.index_gate.all(),
                                                  self.compress_ape, start, c.index_topk,
                                                  c.index_kpool_always_select_tail))
        return masks

    def decode(self, h: torch.Tensor, q_resid: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor],
               rows: torch.Tensor) -> torch.Tensor:
        """The selection masks [B, S] of B decoding queries; their key / gate rows join the pools first."""
        c, n = self.c, h.shape[0]
        keys, gate, weights = self._project(h)
        q = self.wq_b(q_resid).view(n, c.index_n_heads, c.index_head_dim)
        keys = _write_and_gather(pool["index_keys"], keys, batch.slots, rows)
        gate = _write_and_gather(pool["index_gate"], gate, batch.slots, rows)
        return glm_ops.dsa_indexer_topk_decode(q, weights, keys, gate, self.compress_ape, batch.lengths,
                                               c.index_topk, c.index_kpool_always_select_tail)

    def _project(self, h: torch.Tensor):
        """(normed index keys [T, D], pool gate logits [T, D], per-head weights [T, Hi]) of the block input."""
        keys, gate, weights = self.in_proj(h).split(self.in_split, dim=-1)
        return F.layer_norm(keys, (self.c.index_head_dim,), self.k_norm_weight, self.k_norm_bias, 1e-6), gate, weights


def _write_and_gather(pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Write each sequence's new row at its slot of `pool` [blocks, block_size, D], then read every
    sequence's rows back through its block table (`rows` [B, S] flat pool rows): [B, S, D]."""
    flat = pool.view(-1, pool.shape[-1])
    flat.index_copy_(0, slots, new.to(pool.dtype))
    return flat.index_select(0, rows.flatten()).view(*rows.shape, -1)


class MlaAttention(nn.Module):
    """NoPE multi-head latent attention over the keys the (own or previous layer's) indexer selects."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype, full_indexer: bool):
        super().__init__()
        self.c = c
        hq, dn, dv = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
        # Under TP each rank holds whole heads (q_b and kv_b rows, o_proj columns); the latent side
        # (q_a, kv_a, their norms) is replicated, so every rank caches the full latent and the indexer
        # (which reads q_a's output) picks the same keys on every rank.
        what = "attention heads (num_attention_heads)"
        self.heads = _local_heads(hq, what)
        # q_a and kv_a (both FP8 in the published checkpoint, each ending on a 128-row scale block) as one matmul
        parts = {"q_a_proj": c.q_lora_rank, "kv_a_proj_with_mqa": c.kv_lora_rank}
        self.latent_proj = column_parallel(parts, c.hidden_size, dtype, c.attention_bias, shards=dict.fromkeys(parts))
        self.latent_split = tuple(parts.values())
        self.q_a_norm = _param(c.q_lora_rank, dtype=dtype)
        self.q_b_proj = column_parallel({"q_b_proj": hq * dn}, c.q_lora_rank, dtype,
                                        shards={"q_b_proj": _head_shard(hq, dn, what)})
        self.kv_a_norm = _param(c.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = column_parallel({"kv_b_proj": hq * (dn + dv)}, c.kv_lora_rank, dtype,
                                         shards={"kv_b_proj": _head_shard(hq, dn + dv, what)})
        self.o_proj = row_parallel(c.hidden_size, hq * dv, dtype, "o_proj", c.attention_bias, what=what)
        self.indexer = DsaIndexer(c, dtype) if full_indexer else None
        self.scale = c.qk_nope_head_dim**-0.5

    def forward(self, h: torch.Tensor, caches: list[MlaCache], spans: list[Span], prev_masks: list | None):
        """Returns (output, per-sequence selection masks) so that a following shared layer can reuse them.

        The latent is cached. A prefill re-expands keys and values from it through kv_b; a decode step
        instead absorbs kv_b into the query and the output (attention runs in the latent space), so
        a step costs O(cached tokens x latent rank) rather than a kv_b matmul over every cached token.
        """
        c = self.c
        t = h.shape[0]
        q_a, kv_a = self.latent_proj(h).split(self.latent_split, dim=-1)
        q_resid = ops.rms_norm(q_a, self.q_a_norm, c.rms_norm_eps)
        q = self.q_b_proj(q_resid).view(t, self.heads, c.qk_nope_head_dim)
        latent = ops.rms_norm(kv_a, self.kv_a_norm, c.rms_norm_eps)
        masks = self.indexer(h, q_resid, caches, spans) if self.indexer is not None else prev_masks
        if masks is None:
            raise RuntimeError("a shared DSA layer needs the top-k selection of the full layer before it")
        out = q.new_empty(t, self.heads, c.v_head_dim)
        absorbed = self._absorbed_weights()
        for cache, (a, b, _), mask in zip(caches, spans, masks):
            cache.latent.append(latent[a:b])
            rows = cache.latent.all()
            if b - a == 1 and absorbed is not None:
                w_uk, w_uv = absorbed
                shared = rows.unsqueeze(1).expand(-1, self.heads, -1)  # one latent for all heads
                q_lat = torch.einsum("thd,hdr->thr", q[a:b].to(w_uk.dtype), w_uk)  # an FP8 q_b gives 16 bits
                ctx = glm_ops.sparse_attention(q_lat, shared, shared, mask, self.scale)
                out[a:b] = torch.einsum("thr,hvr->thv", ctx, w_uv)
                continue
            kv = self.kv_b_proj(rows).view(-1, self.heads, c.qk_nope_head_dim + c.v_head_dim)
            k, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            out[a:b] = glm_ops.sparse_attention(q[a:b], k, v, mask, self.scale)
        return self.o_proj(out.reshape(t, -1)), masks

    def decode(self, h: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor], rows: torch.Tensor,
               prev_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences in the latent space (kv_b absorbed, as `forward` decodes one
        sequence); returns (output, selection mask [B, S]) for a following shared layer."""
        c, n = self.c, h.shape[0]
        q_a, kv_a = self.latent_proj(h).split(self.latent_split, dim=-1)
        q_resid = ops.rms_norm(q_a, self.q_a_norm, c.rms_norm_eps)
        q = self.q_b_proj(q_resid).view(n, self.heads, c.qk_nope_head_dim)
        latent = _write_and_gather(pool["latent"], ops.rms_norm(kv_a, self.kv_a_norm, c.rms_norm_eps), batch.slots, rows)
        mask = self.indexer.decode(h, q_resid, batch, pool, rows) if self.indexer is not None else prev_mask
        if mask is None:
            raise RuntimeError("a shared DSA layer needs the top-k selection of the full layer before it")
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.einsum("bhd,hdr->bhr", q.to(w_uk.dtype), w_uk)  # an FP8 q_b gives 16 bits
        ctx = glm_ops.latent_attention_decode(q_lat, latent, mask, self.scale)
        return self.o_proj(torch.einsum("bhr,hvr->bhv", ctx, w_uv).reshape(n, -1)), mask

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """kv_b split per head into its key part [H, Dn, R] and value part [H, Dv, R] (this rank's
        heads under TP). A quantized kv_b is dequantized once for this (kv_lora_rank x heads x (Dn + Dv)
        values, small next to the layer); None if its bundle cannot be (then decode expands like prefill)."""
        w = self.kv_b_proj.weight
        if w is None:
            w = getattr(self, "_kv_b_dense", None)
            if w is None:
                dequantize = getattr(self.kv_b_proj.qweight, "dequantize", None)
                if dequantize is None:
                    return None
                w = self._kv_b_dense = dequantize(self.kv_b_proj.dtype)
        c = self.c
        w = w.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]
