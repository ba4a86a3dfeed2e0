"""CUDA graphs for the paged decode step: one graph per (batch-size bucket, block-table-width bucket),
replayed with the step's inputs copied into static buffers, so a decode step costs one launch instead
of hundreds of small ones.

Padded rows (a batch of 3 runs the bucket of 4) read one position of a scratch block that no sequence
owns and write their k/v there, so they never touch a sequence's cache. The decode attention reads
every block its table lists (masked past the context), so the table width is bucketed too (256,
1024, 4096, ... tokens): a step over short contexts does not pay for `max_model_len` (at 64 sequences
and an 8k window that was 12x the step's weight reads).
"""

from __future__ import annotations

import logging

import torch

from flagdeploy.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # one sequence alone: cuBLAS's GEMV kernels, not a 2-row GEMM
WIDTH_TOKENS = 256  # the narrowest block-table bucket, in tokens; each next one is 4x wider


class DecodeGraphs:
    def __init__(self, model, kv_caches: list, max_batch: int, max_blocks: int, scratch_block: int, block_size: int):
        self.model, self.kv_caches = model, kv_caches
        self.buckets = [b for b in BUCKETS if b < max_batch] + [next(b for b in BUCKETS if b >= max_batch)]
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = self.buckets[-1]
        dev = kv_caches[0][0].device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int64, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        first = max(1, WIDTH_TOKENS // block_size)
        self.widths = [w for w in (first * 4**i for i in range(16)) if w < max_blocks] + [max_blocks]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions[:b], slot_mapping=self.slots[:b], num_prefill_tokens=0,
                                 cu_seqlens_q=None, cu_seqlens_k=None, prefill_kv_slots=None,
                                 block_tables=self.tables[:b, :w], context_lens=self.ctx[:b],
                                 logits_indices=self.rows[:b])

    def _capture(self, b: int, w: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces and lazy inits happen outside the capture
            for _ in range(2):
                self.model(self.ids[:b], self._meta(b, w), self.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.ids[:b], self._meta(b, w), self.kv_caches)
        self.pool = graph.pool()
        self.graphs[(b, w)] = (graph, out)
        log.info("captured the decode step for %d sequences of up to %d blocks", b, w)

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            ctx: list[int]) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences (one new token each)."""
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        width = max(len(t) for t in tables)
        w = next(x for x in self.widths if x >= width)
        if (b, w) not in self.graphs:
            self._capture(b, w)
        dev = self.ids.device
        self.ids[:n] = torch.tensor(ids, device=dev)
        self.positions[:n] = torch.tensor(positions, device=dev)
        self.slots[:n] = torch.tensor(slots, device=dev)
        self.slots[n:b] = self.scratch_slot
        self.tables[:n, :w].fill_(self.scratch_block)
        self.tables[:n, :width] = torch.tensor([t + [self.scratch_block] * (width - len(t)) for t in tables], device=dev)
        self.tables[n:b, :w] = self.scratch_block
        self.ctx[:n] = torch.tensor(ctx, dtype=torch.int32, device=dev)
        self.ctx[n:b] = 1
        graph, out = self.graphs[(b, w)]
        graph.replay()
        return out[:n]
