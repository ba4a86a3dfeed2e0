"""Owns the model and its caches on the device; turns a scheduled batch into one forward pass.

`PagedRunner` serves models whose per-token k/v live in the engine's block pool (llama);
`SequenceStateRunner` serves models that carry one cache object per sequence (glm5_next).
"""

from __future__ import annotations

import torch

from flagdeploy.models.attention import AttentionMetadata

from .scheduler import ScheduledBatch


class PagedRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str, graphs: dict | None = None):
        """graphs: {"max_batch", "max_model_len"} to replay pure-decode steps as CUDA graphs (cuda only);
        the pool then gets one extra block, never handed out, for the graphs' padded rows."""
        self.model = model
        self.block_size = block_size
        self.device = device
        extra = 1 if graphs else 0
        self.kv_caches = [
            [torch.zeros(s, dtype=model.kv_cache_dtype, device=device)
             for s in model.kv_cache_shape(num_blocks + extra, block_size)]
            for _ in range(model.cfg.num_layers)
        ]
        self.graphs = None
        if graphs:
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, graphs["max_batch"],
                                       -(-graphs["max_model_len"] // block_size), num_blocks, block_size)

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        per_layer = sum(torch.Size(s).numel() for s in model.kv_cache_shape(1, block_size))
        return per_layer * model.cfg.num_layers * torch.empty((), dtype=model.kv_cache_dtype).element_size()

    def release(self, seq) -> None:
        """The blocks are the block manager's; nothing is held here per sequence."""

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Forward one step. Returns logits for the sequences that reach their end, and their indices."""
        # Prefill chunks (more than one new token) first, then single-token rows (decodes).
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] == 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu_q, cu_k, kv_slots = [0], [0], []
        need_cache_read = False
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        num_prefill = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slot(seq.block_table, p) for p in range(start, end))
            if n > 1:
                num_prefill += n
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + end)
                kv_slots.extend(self._slot(seq.block_table, p) for p in range(end))
                need_cache_read |= start > 0
            else:
                tables.append(seq.block_table)
                ctx_lens.append(end)
            if end == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(i)
        if self.graphs is not None and not num_prefill and len(ids) <= self.graphs.max_batch:
            logits = self.graphs.run(ids, pos, slots, tables, ctx_lens)
            return logits[torch.tensor(logits_rows, device=logits.device)], sampled
        dev = self.device
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        width = max((len(b) for b in tables), default=0)
        meta = AttentionMetadata(
            positions=t(pos),
            slot_mapping=t(slots),
            num_prefill_tokens=num_prefill,
            cu_seqlens_q=t(cu_q, torch.int32) if num_prefill else None,
            cu_seqlens_k=t(cu_k, torch.int32) if num_prefill else None,
            prefill_kv_slots=t(kv_slots) if need_cache_read else None,
            block_tables=t([b + [0] * (width - len(b)) for b in tables]) if tables else None,
            context_lens=t(ctx_lens, torch.int32) if tables else None,
            logits_indices=t(logits_rows),
        )
        logits = self.model(t(ids), meta, self.kv_caches)
        return logits, sampled


class SequenceStateRunner:
    """Runs models that carry state per sequence (glm5_next): their per-token rows (MLA latent,
    indexer keys) live in block pools addressed through each sequence's block table, like paged k/v;
    their fixed-size state (KDA conv + recurrent) lives in a cache object per running sequence.

    A sequence whose first token is scheduled (new, or recomputed after preemption) gets a fresh
    cache object, so stale state can never leak into a recompute.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: str):
        self.model = model
        self.device = device
        with torch.device(device):
            self.pools = model.cache_pools(num_blocks, block_size)
        self.caches: dict[int, object] = {}

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        return model.cache_bytes_per_token() * block_size

    def release(self, seq) -> None:
        self.caches.pop(seq.seq_id, None)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        ids: list[int] = []
        cu = [0]
        caches = []
        rows: list[int] = []
        sampled: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed, seq.num_computed + n
            if start == 0:
                self.caches[seq.seq_id] = self.model.new_cache(self.pools, seq.block_table)
            caches.append(self.caches[seq.seq_id])
            ids.extend(seq.token_ids[start:end])
            cu.append(cu[-1] + n)
            if end == seq.num_tokens:
                rows.append(cu[-1] - 1)
                sampled.append(i)
        logits = self.model.forward_packed(torch.tensor(ids, device=self.device), torch.tensor(cu), caches)
        return logits[rows], sampled
