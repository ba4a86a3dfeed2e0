"""CUDA graphs for the decode step: one graph per (batch-size bucket, block-table-width bucket),
replayed with the step's inputs copied into static buffers, so a decode step costs one launch instead
of hundreds of small ones. Any model whose decode step is a function of `DecodeInputs` alone (fixed
shapes, no host reads) can be captured: the llama family's paged step and glm5_next's `forward_decode`.

Padded rows (a batch of 3 runs the bucket of 4) read one position of a scratch block that no sequence
owns, write their per-token rows there and (sequence-state models) step a scratch state row, so they
never touch a sequence's cache. The decode step reads every block its table lists (masked past the
context), so the table width is bucketed too (256, 1024, 4096, ... tokens): a step over short contexts
does not pay for `max_model_len` (at 64 sequences and an 8k window that was 12x the step's weight reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # one sequence alone: cuBLAS's GEMV kernels, not a 2-row GEMM
WIDTH_TOKENS = 256  # the narrowest block-table bucket, in tokens; each next one is 4x wider


@dataclass
class DecodeInputs:
    """One decode step of B sequences as device tensors (B and the table width W fix every shape)."""

    ids: torch.Tensor  # [B] the new token of each sequence
    positions: torch.Tensor  # [B] its position
    slots: torch.Tensor  # [B] flat cache row it is written to
    tables: torch.Tensor  # [B, W] block tables (padded with a block the sequence does not read)
    ctx: torch.Tensor  # [B] int32: tokens of the sequence including the new one
    state_slots: torch.Tensor  # [B] the sequence's row of the state pools (sequence-state models)
    rows: torch.Tensor  # [B] arange: every row's logits are wanted

    @classmethod
    def build(cls, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
              state_slots: list[int] | None, device) -> "DecodeInputs":
        """The eager step's inputs (no padding rows; tables padded to the widest with block 0)."""
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        width = max(len(b) for b in tables)
        return cls(t(ids), t(positions), t(slots), t([b + [0] * (width - len(b)) for b in tables]), t(ctx, torch.int32),
                   t(state_slots if state_slots is not None else [0] * len(ids)), torch.arange(len(ids), device=device))


Step = Callable[[DecodeInputs], torch.Tensor]


class DecodeGraphs:
    def __init__(self, step: Step, device, max_batch: int, max_blocks: int, block_size: int, scratch_block: int,
                 scratch_state: int = 0):
        """step: the model's decode step on `DecodeInputs` → logits [B, vocab]."""
        self.step = step
        self.buckets = [b for b in BUCKETS if b < max_batch] + [next(b for b in BUCKETS if b >= max_batch)]
        self.scratch_slot, self.scratch_block, self.scratch_state = scratch_block * block_size, scratch_block, scratch_state
        n = self.buckets[-1]
        z = lambda fill, *shape, dt=torch.int64: torch.full(shape, fill, dtype=dt, device=device)  # noqa: E731
        self.buf = DecodeInputs(ids=z(0, n), positions=z(0, n), slots=z(self.scratch_slot, n),
                                tables=z(scratch_block, n, max_blocks), ctx=z(1, n, dt=torch.int32),
                                state_slots=z(scratch_state, n), rows=torch.arange(n, device=device))
        first = max(1, WIDTH_TOKENS // block_size)
        self.widths = [w for w in (first * 4**i for i in range(16)) if w < max_blocks] + [max_blocks]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _inputs(self, b: int, w: int) -> DecodeInputs:
        d = self.buf
        return DecodeInputs(d.ids[:b], d.positions[:b], d.slots[:b], d.tables[:b, :w], d.ctx[:b], d.state_slots[:b],
                            d.rows[:b])

    def _capture(self, b: int, w: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces and lazy inits happen outside the capture
            for _ in range(2):
                self.step(self._inputs(b, w))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(self._inputs(b, w))
        self.pool = graph.pool()
        self.graphs[(b, w)] = (graph, out)
        log.info("captured the decode step for %d sequences of up to %d blocks", b, w)

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
            state_slots: list[int] | None = None) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences (one new token each)."""
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        width = max(len(t) for t in tables)
        w = next(x for x in self.widths if x >= width)
        if (b, w) not in self.graphs:
            # the warm-up runs before a capture execute for real: on padding rows only, so that they
            # advance no sequence's state (a KDA state must step exactly once per token)
            self._pad(0, b, w)
            self._capture(b, w)
        d, dev = self.buf, self.buf.ids.device
        d.ids[:n] = torch.tensor(ids, device=dev)
        d.positions[:n] = torch.tensor(positions, device=dev)
        d.slots[:n] = torch.tensor(slots, device=dev)
        d.tables[:n, :w].fill_(self.scratch_block)
        d.tables[:n, :width] = torch.tensor([t + [self.scratch_block] * (width - len(t)) for t in tables], device=dev)
        d.ctx[:n] = torch.tensor(ctx, dtype=torch.int32, device=dev)
        if state_slots is not None:
            d.state_slots[:n] = torch.tensor(state_slots, device=dev)
        self._pad(n, b, w)
        graph, out = self.graphs[(b, w)]
        graph.replay()
        return out[:n]

    def _pad(self, start: int, end: int, w: int) -> None:
        """Rows [start, end) become padding: scratch slot, block and state row, a context of one token."""
        d = self.buf
        d.ids[start:end] = 0
        d.positions[start:end] = 0
        d.slots[start:end] = self.scratch_slot
        d.tables[start:end, :w] = self.scratch_block
        d.ctx[start:end] = 1
        d.state_slots[start:end] = self.scratch_state
