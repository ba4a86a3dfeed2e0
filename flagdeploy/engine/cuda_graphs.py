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

import gc
import logging
from typing import Callable

import torch

from .decode_inputs import DecodeInputs, Step

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # one sequence alone: cuBLAS's GEMV kernels, not a 2-row GEMM
WIDTH_TOKENS = 256  # the narrowest block-table bucket, in tokens; each next one is 4x wider


def capture(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, its outputs) of `fn` captured into memory pool `pool` (None: a new one), after two warm-up
    runs on a side stream (cuBLAS workspaces, Triton compiles and lazy inits happen outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    # Collect cyclic garbage now: a dropped runner's graphs (runner -> graphs -> bound step -> runner) freed
    # by a collection that happens to run inside the capture would free device memory mid-capture and
    # invalidate it (torch no longer collects on entering `torch.cuda.graph`).
    gc.collect()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphs:
    def __init__(self, step: Step, device, max_batch: int, max_blocks: int, block_size: int, scratch_block: int,
                 scratch_state: int = 0, depth: int = 1):
        """step: the model's decode step on `DecodeInputs` → logits [B, vocab] (or a tuple of per-row
        outputs, e.g. (logits, hidden states)).

        depth > 1: speculative verify steps of a sequence-state model (`SequenceStateRunner._verify_step`):
        each of B sequences brings `depth` rows laid out wave-major (every sequence's first row, then every
        second row, ...), and `step(inputs, waves)` steps the KDA states of wave j from rows src[j] into
        dst[j]; buckets count sequences, a bucket of b holds b * depth rows."""
        self.step, self.depth = step, depth
        self.buckets = [b for b in BUCKETS if b < max_batch] + [next(b for b in BUCKETS if b >= max_batch)]
        self.scratch_slot, self.scratch_block, self.scratch_state = scratch_block * block_size, scratch_block, scratch_state
        n = self.buckets[-1] * depth
        # One int64 row per per-sequence input, so that a step's inputs cross to the device in one copy
        # (and its block tables in a second): each copy is a host round trip the GPU waits for.
        self.packed = torch.zeros(5 + 2 * (depth > 1), n, dtype=torch.int64, device=device)
        ids, positions, slots, ctx, state_slots = self.packed[:5]
        self.buf = DecodeInputs(ids=ids, positions=positions, slots=slots,
                                tables=torch.full((n, max_blocks), scratch_block, dtype=torch.int64, device=device),
                                ctx=ctx, state_slots=state_slots, rows=torch.arange(n, device=device))
        first = max(1, WIDTH_TOKENS // block_size)
        self.widths = [w for w in (first * 4**i for i in range(16)) if w < max_blocks] + [max_blocks]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _inputs(self, b: int, w: int) -> DecodeInputs:
        d, r = self.buf, b * self.depth
        return DecodeInputs(d.ids[:r], d.positions[:r], d.slots[:r], d.tables[:r, :w], d.ctx[:r], d.state_slots[:r],
                            d.rows[:r])

    def _forward(self, b: int, w: int) -> torch.Tensor:
        if self.depth == 1:
            return self.step(self._inputs(b, w))
        src, dst = self.packed[5:, : b * self.depth].view(2, self.depth, b)
        return self.step(self._inputs(b, w), [(j * b, (j + 1) * b, src[j], dst[j]) for j in range(self.depth)])

    def _capture(self, b: int, w: int) -> None:
        graph, out = capture(lambda: self._forward(b, w), self.pool)
        self.pool = graph.pool()
        self.graphs[(b, w)] = (graph, out)
        log.info("captured the %s step for %d sequences of up to %d blocks", "verify" if self.depth > 1 else "decode",
                 b, w)

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
            state_slots: list[int] | None = None, waves: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences (one new token each); with depth > 1, the n * depth rows
        of n verifying sequences, wave-major, and `waves` = (src, dst) state rows of each row."""
        n = len(ids) // self.depth
        b = next(x for x in self.buckets if x >= n)
        w = next(x for x in self.widths if x >= max(len(t) for t in tables))
        if (b, w) not in self.graphs:
            # the warm-up runs before a capture execute for real: on padding rows only, so that they
            # advance no sequence's state (a KDA state must step exactly once per token)
            self._load([], [], [], [], [], [], None, b, w)
            self._capture(b, w)
        self._load(ids, positions, slots, tables, ctx, state_slots or [self.scratch_state] * len(ids), waves, b, w)
        graph, out = self.graphs[(b, w)]
        graph.replay()
        if isinstance(out, tuple):  # a step that also returns hidden states: each output the same way
            return tuple(self._rows(o, n, b) for o in out)
        return self._rows(out, n, b)

    def _rows(self, out: torch.Tensor, n: int, b: int) -> torch.Tensor:
        """The real rows of a bucket's output (wave-major, depth waves of n of its b rows each)."""
        if self.depth == 1:
            return out[:n]
        return out.view(self.depth, b, -1)[:, :n].reshape(self.depth * n, -1)

    def _load(self, ids, positions, slots, tables, ctx, state_slots, waves, b: int, w: int) -> None:
        """The bucket's inputs in two copies; rows past the batch (in each wave) are padding (scratch slot,
        block and state row, a context of one token), table entries past a sequence's own blocks the
        scratch block."""
        n, depth, scratch = len(ids) // self.depth, self.depth, self.scratch_block

        def padded(values: list, fill) -> list:
            return [v for j in range(depth) for v in values[j * n : (j + 1) * n] + [fill] * (b - n)]

        rows = [padded(ids, 0), padded(positions, 0), padded(slots, self.scratch_slot), padded(ctx, 1),
                padded(state_slots, self.scratch_state)]
        if depth > 1:
            src, dst = waves if waves is not None else ([], [])
            rows += [padded(src, self.scratch_state), padded(dst, self.scratch_state)]
        self.packed[:, : b * depth].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        table = padded([t + [scratch] * (w - len(t)) for t in tables], [scratch] * w)
        self.buf.tables[: b * depth, :w].copy_(torch.tensor(table, dtype=torch.int64), non_blocking=True)


class StepGraphs:
    """CUDA graphs of a step `step(key, *inputs)` on a few tensors whose shapes `key` fixes, one per key:
    the first call with a key captures the step on static copies of its inputs, later calls copy theirs
    in and replay. For steps that may run twice on the same inputs (the warm-up runs it for real), such as the
    MTP draft step (it rewrites the same cache rows with the same values)."""

    def __init__(self, step: Callable[..., torch.Tensor]):
        self.step = step
        self.graphs: dict[tuple, tuple[list[torch.Tensor], object, torch.Tensor]] = {}
        self.pool = None

    def run(self, key: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(key, [t.clone() for t in inputs])
        static, graph, out = entry
        for s, t in zip(static, inputs):
            s.copy_(t)
        graph.replay()
        return out

    def _capture(self, key: tuple, static: list[torch.Tensor]) -> tuple:
        graph, out = capture(lambda: self.step(key, *static), self.pool)
        self.pool = graph.pool()
        log.info("captured the step %s", key)
        return static, graph, out
