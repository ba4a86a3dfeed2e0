"""Owns the model and its caches on the device; turns a scheduled batch into one forward pass.

`PagedRunner` serves models whose per-token k/v live in the engine's block pool (llama);
`SequenceStateRunner` serves models that also carry a fixed-size state per sequence (glm5_next).

A step is two halves: `plan` (rank 0: the scheduled batch becomes a step of plain lists, picklable)
and `execute` (every rank of a tensor/expert-parallel replica: the step becomes one forward pass).
One process runs both; several run `execute` in lock-step (flagdeploy/engine/lockstep.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from flagdeploy import ops
from flagdeploy.errors import ConfigError
from flagdeploy.models.attention import AttentionMetadata
from flagdeploy.models.linear import Linear
from flagdeploy.ops.weights import Int4Weight, Int8Weight, PiecewiseWeight

from .compiled_step import CompiledDecode
from .cuda_graphs import DecodeGraphs
from .decode_inputs import DecodeInputs
from .multimodal import EncoderCache, step_embeds
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

# feature rows the encoder cache holds (a 1024 x 1024 image gives 1,369 rows; at GLM-5.3-Flash's width
# of 4096 in bfloat16, 32k rows are 256 MiB)
ENCODER_CACHE_ROWS = 32768


@dataclass
class PagedStep:
    """One step of a paged model: prefill rows first, then one row per decoding sequence."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    num_prefill: int
    cu_q: list[int]
    cu_k: list[int]
    kv_slots: list[int] | None  # set when a prefill reads keys already in the cache
    tables: list[list[int]]
    ctx_lens: list[int]
    logits_rows: list[int]
    verify: bool = False  # some sequence has several decode rows (its last token and its drafts)
    # media features replacing token embeddings: (packed row indices, rows), encoded on rank 0 when it plans
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class StateStep:
    """One step of a sequence-state model: per sequence (id, state row, block table, new tokens, first
    position). `chains`: for a speculating sequence (index into `seqs`), the state rows its 1 + k new tokens
    step into, one per token: row j starts from row j - 1's state (the first from the sequence's state row)."""

    seqs: list[tuple[int, int, list[int], list[int], int]]
    rows: list[int]
    chains: dict[int, list[int]] | None = None
    # media features replacing token embeddings: (packed row indices, rows), encoded on rank 0 when it plans
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


def _encoder_cache(model, device: str) -> EncoderCache | None:
    """For a model with a vision encoder: its features by content, `ENCODER_CACHE_ROWS` rows at most."""
    if "image" not in getattr(model, "input_modalities", ()):
        return None
    return EncoderCache(model.encode_media, ENCODER_CACHE_ROWS, device)


BACKGROUND_COMPILE_MAX_FROZEN = 0.1  # of the machine's memory: dense weights a default compile may copy


def _background_compile_fits(model) -> bool:
    """Whether serve's default compiles the decode step (in the background): a compiled step freezes dense
    float weights into itself, a second copy, so a model whose dense linears exceed a tenth of the machine's
    memory is not compiled unless asked (`--compile`); a weight-only quantized one (a GGUF) copies none."""
    dense = sum(m.weight.nbytes for m in model.modules()
                if isinstance(m, Linear) and m.qweight is None and isinstance(m.weight, torch.Tensor))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if dense <= BACKGROUND_COMPILE_MAX_FROZEN * memory:
        return True
    log.info("not compiling the decode step: its frozen copy of %.1f GiB of dense weights would not fit beside "
             "them comfortably; --compile compiles it anyway", dense / 2**30)
    return False


def _weight_only(model) -> bool:
    """Whether every linear of `model` runs a weight-only quantized kernel (4- or 8-bit weights, 16-bit
    activations): a GGUF served with `--weight-format auto`."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return bool(linears) and all(isinstance(m.qweight, (Int4Weight, Int8Weight, PiecewiseWeight)) for m in linears)


class _Runner:
    """What the engine calls; subclasses provide `plan`, `execute` and `drop`."""

    model: object
    device: str
    compiling: threading.Thread | None = None  # the decode step compiling in the background (engine/compiled_step.py)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Forward one step. Returns logits for the sequences that reach their end, and their indices."""
        step, sampled = self.plan(batch)
        return self.execute(step), sampled

    def release(self, seq) -> None:
        self.drop(seq.seq_id)

    def can_take(self, seq) -> bool:
        """Whether `import_seq` can take one more sequence now (a state row free, where the model has state)."""
        return True

    @staticmethod
    def state_bytes(model, max_seqs: int, spec_tokens: int = 0) -> int:
        """Memory the runner holds per running sequence whatever its length, times `max_seqs`."""
        return 0

    def score(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence (prompt logprobs), outside the engine's caches."""
        with ops.prefill_step():
            return self.model.score(torch.tensor(ids, device=self.device))


class PagedRunner(_Runner):
    def __init__(self, model, num_blocks: int, block_size: int, device: str, graphs: dict | None = None,
                 compile: bool = False, max_seqs: int = 256):
        """graphs: {"max_batch", "max_model_len"} to replay pure-decode steps as CUDA graphs (cuda only);
        compile: run them through torch.compile instead (engine/compiled_step.py). Either way the pool gets
        one extra block, never handed out, for padded rows."""
        self.model = model
        self.block_size = block_size
        self.device = device
        extra = 1 if graphs or compile else 0
        self.kv_caches = _paged_caches(model, num_blocks + extra, block_size, device)
        self.graphs = None
        if graphs:
            self.graphs = DecodeGraphs(self._decode, device, graphs["max_batch"],
                                       -(-graphs["max_model_len"] // block_size), block_size, num_blocks)
        self.compiled = (CompiledDecode(self._decode, device, block_size, num_blocks, max_seqs=max_seqs,
                                        weight_only=_weight_only(model))
                         if compile and not graphs else None)
        # the backend's own whole decode step (the cpu backend's C++ llama step): the eager step's kernels
        # without the interpreter between them, from the first request on
        native = ops.active_backend().decode_step
        self.native = native(model, self.kv_caches, block_size) if native is not None and not graphs else None
        self.encoder = _encoder_cache(model, device)

    def _decode(self, d: DecodeInputs, kv_caches: list | None = None) -> torch.Tensor:
        """The pure-decode step on `DecodeInputs` (what the CUDA graphs capture and torch.compile traces), over the
        runner's caches or `kv_caches`."""
        meta = AttentionMetadata(positions=d.positions, slot_mapping=d.slots, num_prefill_tokens=0, cu_seqlens_q=None,
                                 cu_seqlens_k=None, prefill_kv_slots=None, block_tables=d.tables, context_lens=d.ctx,
                                 logits_indices=d.rows)
        return self.model.forward_step(d.ids, meta, self.kv_caches if kv_caches is None else kv_caches)

    def score(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence (prompt logprobs), outside the engine's caches. Where the
        backend's decode step takes a prompt of this length as rows (`plan`), the scoring pass does too, over a
        scratch cache laid out as the engine's: each position's logits are then, bit for bit, what the engine
        computes for that prefix's last row, so a prompt logprob equals the logprob its token got when generated."""
        n = len(ids)
        if self.native is None or not self.native.takes_prompt(n):
            return super().score(ids)
        bs, blocks = self.block_size, -(-n // self.block_size)
        caches = _paged_caches(self.model, blocks + 1, bs, self.device)  # block 0 the padding block, as the engine's
        table = list(range(1, blocks + 1))
        rows = DecodeInputs.build(ids, list(range(n)), [self._slot(table, p) for p in range(n)], [table] * n,
                                  list(range(1, n + 1)), None, self.device)
        with torch.inference_mode(), ops.verify_step():
            return self._decode(rows, caches)

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        per_layer = sum(torch.Size(s).numel() for s in model.kv_cache_shape(1, block_size))
        return per_layer * model.cfg.num_layers * torch.empty((), dtype=model.kv_cache_dtype).element_size()

    def drop(self, seq_id: int) -> None:
        """The blocks are the block manager's; nothing is held here per sequence."""

    # ---- prefill-decode disaggregation (engine/kv_transfer.py) -------------------------------------------

    def export_seq(self, seq) -> tuple[list[torch.Tensor], list[int]]:
        """The cache blocks holding `seq`'s computed tokens (every layer's k and v), and their ids."""
        blocks = seq.block_table[: -(-seq.num_computed // self.block_size)]
        idx = torch.tensor(blocks, device=self.device)
        return [c.index_select(0, idx) for layer in self.kv_caches for c in layer], blocks

    def transfer_shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((num_blocks, *c.shape[1:]), c.dtype) for layer in self.kv_caches for c in layer]

    def import_seq(self, seq, tensors: list[torch.Tensor]) -> None:
        """Write what `export_seq` gave on another instance into `seq`'s own blocks."""
        caches = [c for layer in self.kv_caches for c in layer]
        idx = torch.tensor(seq.block_table[: tensors[0].shape[0]], device=self.device)
        for c, t in zip(caches, tensors, strict=True):
            c.index_copy_(0, idx, t.to(c.device))

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def plan(self, batch: ScheduledBatch) -> tuple[PagedStep, list[int]]:
        """The step's inputs as lists, and which of the batch's sequences get a token sampled.

        A sequence with drafts (speculative verify) becomes 1 + k decode rows over its block table, row j at
        position p + j with context length p + j + 1: every layer writes all rows' k/v into the cache before
        attention reads it, so each row sees exactly the keys a plain decode of that token would, and is
        computed by the same code (no prefill path). All its rows are logits rows. So are the prompt tokens of a
        sequence the backend's own decode step takes as rows (`takes_prompt`: they then compute what decode rows
        compute, whatever part of the prompt the prefix cache held), its last prompt row the logits row."""
        drafts = batch.drafts or [[] for _ in batch.seqs]
        # a prompt's chunk: more than one token, or one of the prompt's own (a chunk the step's token budget cut to
        # one, a cached prompt's last token), which a prefill computes as it computes the prompt's other tokens
        prompt = [n > 1 or s.num_computed < s.num_prompt_tokens for s, n in zip(batch.seqs, batch.num_new_tokens)]
        rows = [bool(d) or (p and not s.media and self.native is not None and self.native.takes_prompt(s.num_tokens))
                for s, p, d in zip(batch.seqs, prompt, drafts)]
        # Prefill chunks (a prompt's, not taken as rows) first, then decode rows.
        order = sorted(range(len(batch.seqs)), key=lambda i: rows[i] or not prompt[i])
        step = PagedStep([], [], [], 0, [0], [0], [], [], [], [])
        need_cache_read = False
        sampled: list[int] = []
        media = []
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed, seq.num_computed + n
            if seq.media and not drafts[i]:
                media.append((len(step.ids), seq.media, start, end))
            # a verify step's rows: the last real token, then the drafts (not in token_ids until accepted)
            step.ids.extend([seq.token_ids[start], *drafts[i]] if drafts[i] else seq.token_ids[start:end])
            step.positions.extend(range(start, end))
            step.slots.extend(self._slot(seq.block_table, p) for p in range(start, end))
            if rows[i]:
                for p in range(start, end):
                    step.tables.append(list(seq.block_table))
                    step.ctx_lens.append(p + 1)
                step.verify = True  # rows of one sequence, each as a decode row computes it
                if drafts[i]:
                    step.logits_rows.extend(range(len(step.ids) - n, len(step.ids)))
                    sampled.append(i)
                elif end == seq.num_tokens:
                    step.logits_rows.append(len(step.ids) - 1)
                    sampled.append(i)
                continue
            if prompt[i]:
                step.num_prefill += n
                step.cu_q.append(step.cu_q[-1] + n)
                step.cu_k.append(step.cu_k[-1] + end)
                step.kv_slots.extend(self._slot(seq.block_table, p) for p in range(end))
                need_cache_read |= start > 0
            else:
                step.tables.append(list(seq.block_table))
                step.ctx_lens.append(end)
            if end == seq.num_tokens:
                step.logits_rows.append(len(step.ids) - 1)
                sampled.append(i)
        if not need_cache_read:
            step.kv_slots = None
        if media:
            step.embeds = step_embeds(self.encoder, media)
        return step, sampled

    @property
    def default_steps(self) -> int:
        """Decode steps per engine step where --num-scheduler-steps is not given: the backend's own decode step's
        (1 where it has no multi-step form)."""
        return getattr(self.native, "default_steps", 1)

    def takes_steps(self, batch: ScheduledBatch) -> bool:
        """Whether `run_steps` runs this batch: the backend's own decode step has a multi-step form and takes its
        sequences and block tables (each step one decode row a sequence)."""
        steps = getattr(self.native, "serves_steps", None)
        return steps is not None and steps(len(batch.seqs), max(len(seq.block_table) for seq in batch.seqs))

    def run_steps(self, batch: ScheduledBatch, settings: tuple[torch.Tensor, ...],
                  uniforms: list[list[float]]) -> list[list[int]]:
        """Several decode steps in one call (multi-step scheduling): each decoding sequence of `batch` takes
        1 + len(its drafts) steps from its last token, the drafts only placeholders for the cache slots the scheduler
        granted; returns each sequence's new tokens, chosen as the sampler chooses them (`settings`: the rows'
        sampling; `uniforms[i]`: sequence i's uniform at each step, none for a greedy one)."""
        ids, positions, ctx, counts, slots, tables = [], [], [], [], [], []
        for seq, drafts in zip(batch.seqs, batch.drafts):
            p = seq.num_computed
            ids.append(seq.token_ids[p])
            positions.append(p)
            ctx.append(p + 1)
            counts.append(1 + len(drafts))
            slots.append([self._slot(seq.block_table, q) for q in range(p, p + 1 + len(drafts))])
            tables.append(list(seq.block_table))
        return self.native.run_steps(ids, positions, ctx, counts, slots, tables, settings, uniforms)

    def execute(self, step: PagedStep) -> torch.Tensor:
        """Logits of the step's `logits_rows`."""
        if not step.num_prefill and step.embeds is None:
            n = len(step.ids)
            # a verify step through a compiled step or graph: its attention has one fixed form for every row
            # already; the opaque weight-only linears still read the mark (backends/cpu/ops.py)
            with ops.verify_step() if step.verify else contextlib.nullcontext():
                if self.compiled is not None and self.compiled.serves(n):
                    logits = self.compiled.run(step.ids, step.positions, step.slots, step.tables, step.ctx_lens,
                                               [0] * n)
                    return take_rows(logits, step.logits_rows)
                if self.native is not None and self.native.serves(n, max(len(t) for t in step.tables), step.verify):
                    return self.native.run(step.ids, step.positions, step.slots, step.tables, step.ctx_lens,
                                           verify=step.verify, logits_rows=step.logits_rows)
                if self.graphs is not None and n <= self.graphs.max_batch:
                    with torch.inference_mode():
                        logits = self.graphs.run(step.ids, step.positions, step.slots, step.tables, step.ctx_lens)
                    return take_rows(logits, step.logits_rows)
        dev = self.device
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        width = max((len(b) for b in step.tables), default=0)
        meta = AttentionMetadata(
            positions=t(step.positions),
            slot_mapping=t(step.slots),
            num_prefill_tokens=step.num_prefill,
            cu_seqlens_q=t(step.cu_q, torch.int32) if step.num_prefill else None,
            cu_seqlens_k=t(step.cu_k, torch.int32) if step.num_prefill else None,
            prefill_kv_slots=t(step.kv_slots) if step.kv_slots is not None else None,
            block_tables=t([b + [0] * (width - len(b)) for b in step.tables]) if step.tables else None,
            context_lens=t(step.ctx_lens, torch.int32) if step.tables else None,
            logits_indices=t(step.logits_rows),
        )
        # a prefill beside decode rows (plain, verify or prompt rows): the prompt chunks lead, each mark for its rows
        leading = {len(step.ids): step.num_prefill,
                   len(step.logits_rows): sum(r < step.num_prefill for r in step.logits_rows)}
        with ops.prefill_step(leading) if step.num_prefill else contextlib.nullcontext(), \
                ops.verify_step() if step.verify else contextlib.nullcontext():
            return self.model(t(step.ids), meta, self.kv_caches, embeds=step.embeds)


class SequenceStateRunner(_Runner):
    """Runs models that carry state per sequence (glm5_next): their per-token rows (MLA latent,
    indexer keys) live in block pools addressed through each sequence's block table, like paged k/v;
    their fixed-size state (KDA conv + recurrent) in state pools, one row per running sequence, assigned
    when rank 0 plans the sequence's first step (so every rank of a replica uses the same row) and given
    back when the sequence finishes or aborts (a preempted sequence keeps its rows and restarts them zeroed).

    A step of decodes only runs the model's `forward_decode` (fixed shapes; replayed as a CUDA graph on a
    GPU); a step with a prefill chunk runs `forward_packed` over per-step views of the pools. A sequence
    whose first token is scheduled (new, or recomputed after preemption) starts from a zeroed state row.

    Speculation (`spec_tokens` = K > 0): a recurrent state cannot be truncated, so each sequence owns 1 + K
    state rows. A verify step of 1 + k tokens steps them as a chain, token j from the state token j - 1 left
    in row j - 1 into row j (a copy of the row, then the ordinary in-place update: every backend's decode
    ops stay as they are). The next step starts from the row of the last accepted token: rows are selected,
    never copied back, and a rejected draft's state is simply never read again.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: str, max_seqs: int,
                 graphs: dict | None = None, compile: bool = False, spec_tokens: int = 0):
        """graphs: {"max_model_len"} to replay decode steps as CUDA graphs (cuda only); compile: run them
        through torch.compile instead (engine/compiled_step.py). Either way the pools get one extra block
        and one extra state row, never handed out, for padding rows."""
        self.model, self.device, self.block_size = model, device, block_size
        self.group = 1 + spec_tokens  # state rows per sequence
        rows = max_seqs * self.group
        extra = 1 if graphs or compile or spec_tokens else 0  # (a verify step pads short chains with it too)
        with torch.device(device):
            self.pools = model.cache_pools(num_blocks + extra, block_size, rows + extra)
        self.scratch_block, self.scratch_state = num_blocks, rows
        self.free_rows = list(range(rows - 1, -1, -1))
        self.state_rows: dict[int, list[int]] = {}  # running sequence → its rows; [0] holds its state now
        # a sequence's last verify step: (position of its first row, the rows its tokens stepped into)
        self.verified: dict[int, tuple[int, list[int]]] = {}
        self.keep_hidden = False  # record the final hidden states of every row (an MTP proposer reads them)
        self.last_hidden: dict[int, tuple[int, torch.Tensor]] = {}  # seq id → (first position, hidden [n, H])
        self.batched_decode = model.can_decode_batched()
        self.graphs = self.verify_graphs = None
        if graphs and self.batched_decode:
            width = -(-graphs["max_model_len"] // block_size)
            self.graphs = DecodeGraphs(self._decode, device, max_seqs, width, block_size, num_blocks, rows)
            if spec_tokens:
                self.verify_graphs = DecodeGraphs(self._verify, device, max_seqs, width, block_size, num_blocks, rows,
                                                  depth=self.group)
        self.encoder = _encoder_cache(model, device)
        self.compiled = None
        if compile and self.batched_decode and not self.graphs:
            self.compiled = CompiledDecode(self._decode, device, block_size, num_blocks, scratch_state=rows,
                                           max_seqs=max_seqs, weight_only=_weight_only(model))

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        return model.cache_bytes_per_token() * block_size

    @staticmethod
    def state_bytes(model, max_seqs: int, spec_tokens: int = 0) -> int:
        return model.state_bytes_per_seq() * (max_seqs * (1 + spec_tokens) + 1)  # + the graphs' scratch row

    def drop(self, seq_id: int) -> None:
        self.free_rows.extend(self.state_rows.pop(seq_id, ()))
        self.verified.pop(seq_id, None)
        self.last_hidden.pop(seq_id, None)

    # ---- prefill-decode disaggregation (engine/kv_transfer.py) -------------------------------------------

    def _pools(self):
        """(pool, per sequence?) in a fixed order: per-token block pools, and the per-sequence state rows
        of the layers the model names (`state_pool_layers`: KDA's conv and recurrent state)."""
        state = self.model.state_pool_layers()
        return [(t, layer in state) for layer, pools in sorted(self.pools.items()) for _, t in sorted(pools.items())]

    def export_seq(self, seq) -> tuple[list[torch.Tensor], list[int]]:
        """Everything `seq` needs to continue elsewhere: its blocks of every per-token pool (the MLA latent,
        the indexer rows, the MTP layer's rows) and its state row of every state pool."""
        blocks = seq.block_table[: -(-seq.num_computed // self.block_size)]
        idx = torch.tensor(blocks, device=self.device)
        row = self._rows_of(seq)[0]
        return [t[row: row + 1].clone() if per_seq else t.index_select(0, idx) for t, per_seq in self._pools()], blocks

    def can_take(self, seq) -> bool:
        return seq.seq_id in self.state_rows or len(self.free_rows) >= self.group

    def transfer_shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((1 if per_seq else num_blocks, *t.shape[1:]), t.dtype) for t, per_seq in self._pools()]

    def import_seq(self, seq, tensors: list[torch.Tensor]) -> None:
        row = self._rows_of(seq)[0]  # takes the sequence's state rows
        idx = None
        for (t, per_seq), data in zip(self._pools(), tensors, strict=True):
            if per_seq:
                t[row: row + 1].copy_(data)
            else:
                if idx is None:
                    idx = torch.tensor(seq.block_table[: data.shape[0]], device=self.device)
                t.index_copy_(0, idx, data.to(t.device))

    def _rows_of(self, seq) -> list[int]:
        """The sequence's state rows, the one holding its state first: after a verify step, the row of its
        last accepted token (accepted = positions computed since that step's first row, less one)."""
        rows = self.state_rows.get(seq.seq_id)
        if rows is None:
            rows = self.state_rows[seq.seq_id] = [self.free_rows.pop() for _ in range(self.group)]
        last = self.verified.pop(seq.seq_id, None)
        if last is not None and seq.num_computed > 0:  # (0: preempted since; it restarts from a zeroed row)
            first, chain = last
            current = chain[seq.num_computed - first - 1]
            rows.remove(current)
            rows.insert(0, current)
        return rows

    def plan(self, batch: ScheduledBatch) -> tuple[StateStep, list[int]]:
        drafts = batch.drafts or [[] for _ in batch.seqs]
        seqs, rows, sampled, chains, count, media = [], [], [], {}, 0, []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed, seq.num_computed + n
            if seq.media and not drafts[i]:
                media.append((count, seq.media, start, end))
            state = self._rows_of(seq)
            if drafts[i]:  # a verify step: the last real token, then the drafts; every row is a logits row
                new = [seq.token_ids[start], *drafts[i]]
                chains[i] = state[: len(new)]
                self.verified[seq.seq_id] = (start, chains[i])
                rows.extend(range(count, count + n))
                sampled.append(i)
            else:
                new = seq.token_ids[start:end]
            seqs.append((seq.seq_id, state[0], list(seq.block_table), new, start))
            count += n
            if not drafts[i] and end == seq.num_tokens:
                rows.append(count - 1)
                sampled.append(i)
        embeds = step_embeds(self.encoder, media) if media else None
        return StateStep(seqs, rows, chains or None, embeds), sampled

    def execute(self, step: StateStep) -> torch.Tensor:
        if self.batched_decode and step.embeds is None and all(start > 0 and (len(new) == 1 or i in (step.chains or ()))
                                                               for i, (_, _, _, new, start) in enumerate(step.seqs)):
            if step.chains:
                return self._verify_step(step)
            return take_rows(self._decode_step(step), step.rows)
        ids: list[int] = []
        cu = [0]
        caches = []
        for _, row, table, new, start in step.seqs:
            caches.append(self.model.engine_cache(self.pools, table, row, start))
            ids.extend(new)
            cu.append(cu[-1] + len(new))
        prompt = any(len(new) > 1 or start == 0 for _, _, _, new, start in step.seqs)
        with ops.prefill_step() if prompt else contextlib.nullcontext():
            logits = self.model.forward_packed(torch.tensor(ids, device=self.device), torch.tensor(cu), caches,
                                               return_hidden=self.keep_hidden, embeds=step.embeds)
        if self.keep_hidden:
            logits, hidden = logits
            self._record_hidden(step, hidden, list(range(len(ids))))
        return take_rows(logits, step.rows)

    def _record_hidden(self, step: StateStep, hidden: torch.Tensor, order: list[int]) -> None:
        """`hidden[order[r]]` is packed row r's (sequence-major order) final hidden state."""
        self.last_hidden = {}
        at = 0
        index = torch.tensor(order, dtype=torch.long, device=hidden.device)
        for seq_id, _, _, new, start in step.seqs:
            self.last_hidden[seq_id] = (start, hidden.index_select(0, index[at : at + len(new)]))
            at += len(new)

    def _decode_step(self, step: StateStep) -> torch.Tensor:
        bs = self.block_size
        ids = [new[0] for _, _, _, new, _ in step.seqs]
        positions = [start for *_, start in step.seqs]
        slots = [table[p // bs] * bs + p % bs for (_, _, table, _, _), p in zip(step.seqs, positions)]
        tables = [table for _, _, table, _, _ in step.seqs]
        ctx = [p + 1 for p in positions]
        state_rows = [row for _, row, _, _, _ in step.seqs]
        if self.compiled is not None and not self.keep_hidden and self.compiled.serves(len(ids)):
            return self.compiled.run(ids, positions, slots, tables, ctx, state_rows)
        with torch.inference_mode():
            if self.graphs is not None and len(ids) <= self.graphs.max_batch:
                out = self.graphs.run(ids, positions, slots, tables, ctx, state_rows)
            else:
                out = self._decode(DecodeInputs.build(ids, positions, slots, tables, ctx, state_rows, self.device))
        if not self.keep_hidden:
            return out
        self._record_hidden(step, out[1], list(range(len(ids))))
        return out[0]

    def _verify_step(self, step: StateStep) -> torch.Tensor:
        """A decode step where some sequences carry drafts: every token is a decode row (its per-token rows
        written before attention reads them, context up to itself), ordered by draft position — all
        sequences' first rows, then all second rows, ... (`waves`) — so that the KDA layers step each
        position's rows together, from the state rows the previous position's rows wrote. Every wave has a
        row for every sequence: a shorter chain (fewer drafts, or none) is padded with rows of the scratch
        block and state row, so the step has one shape per batch size (replayed as a CUDA graph on a GPU)."""
        bs, n = self.block_size, len(step.seqs)
        depth = max(len(new) for *_, new, _ in step.seqs)
        graphs = self.verify_graphs if self.verify_graphs is not None and n <= self.verify_graphs.max_batch else None
        if graphs is not None:
            depth = self.group
        pad = (0, 0, self.scratch_block * bs, [self.scratch_block], 1, self.scratch_state, self.scratch_state)
        rows = []  # (id, position, slot, table, context, source state row, target state row)
        for j in range(depth):
            for i, (_, state, table, new, start) in enumerate(step.seqs):
                chain, p = step.chains.get(i, [state]), start + j
                rows.append(pad if j >= len(new) else (new[j], p, table[p // bs] * bs + p % bs, table, p + 1,
                                                        chain[max(j - 1, 0)], chain[j]))
        ids, positions, slots, tables, ctx, src, dst = (list(c) for c in zip(*rows))
        # packed row r (sequence-major, as `plan` counted them) → its row in this step
        order = [j * n + i for i, (*_, new, _) in enumerate(step.seqs) for j in range(len(new))]
        with torch.inference_mode(), ops.verify_step():
            if graphs is not None:
                out = graphs.run(ids, positions, slots, tables, ctx, dst, (src, dst))
            else:
                t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
                d = DecodeInputs.build(ids, positions, slots, tables, ctx, dst, self.device)
                out = self._verify(d, [(j * n, (j + 1) * n, t(src[j * n : (j + 1) * n]), t(dst[j * n : (j + 1) * n]))
                                       for j in range(depth)])
        logits, hidden = out if self.keep_hidden else (out, None)
        if hidden is not None:
            self._record_hidden(step, hidden, order)
        return take_rows(logits, [order[r] for r in step.rows])

    # What the CUDA graphs capture (and the eager steps run). `keep_hidden` is set before the first step, so
    # a captured step returns the hidden states exactly when the proposer wants them.

    def _verify(self, d: DecodeInputs, waves: list):
        """The verify step on `DecodeInputs` and its KDA waves: logits, or (logits, hidden)."""
        return self.model.forward_decode(d.ids, self.pools, d.state_slots, d.slots, d.tables, d.ctx, waves=waves,
                                         return_hidden=self.keep_hidden)

    def _decode(self, d: DecodeInputs):
        """The pure-decode step on `DecodeInputs`: logits, or (logits, hidden)."""
        return self.model.forward_decode(d.ids, self.pools, d.state_slots, d.slots, d.tables, d.ctx,
                                         return_hidden=self.keep_hidden)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero-filled cache pool. On the CPU from calloc (numpy's zeros): the OS hands over zero pages as
    they are first touched, where torch.zeros writes every byte up front (the default 2 GiB pool was ~1.5 s
    of a server's start, and all of it resident before any request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _paged_caches(model, num_blocks: int, block_size: int, device: str) -> list[list[torch.Tensor]]:
    """Each layer's zeroed cache pools of `num_blocks` blocks (the engine's, or a scoring pass's scratch)."""
    return [[_zeroed(s, model.kv_cache_dtype, device) for s in model.kv_cache_shape(num_blocks, block_size)]
            for _ in range(model.cfg.num_layers)]


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a view where the rows are a run (every row, or one: a verify step's first row), else a copy.
    On the CPU the copy is numpy's, not torch's: torch's gather of a row as wide as a vocabulary opens an
    OpenMP region, whose worker then spins for milliseconds on the core the kernels' own thread pool needs
    (csrc/thread_pool.h). Measured, 2-core AVX-512 EPYC, two threads, cpu_speculative.py: one such gather a
    verify step took ngram from 2.35x to 1.71x speculation off. On a GPU: one index tensor, no host loop."""
    start = rows[0] if rows else 0
    if rows == list(range(start, start + len(rows))):
        return logits.narrow(0, start, len(rows))
    if logits.device.type != "cpu":
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    raw = logits.contiguous().view(torch.uint8).numpy()  # bytes per row: any dtype, bf16 included
    return torch.from_numpy(raw[rows]).view(logits.dtype)


def build_runner(model, config, keep_hidden: bool = False) -> tuple[_Runner, int, int]:
    """The runner for `model` under an EngineConfig: (runner, number of cache blocks, bytes per block).
    Every rank of a parallel replica calls this with the same config and gets the same block count.

    keep_hidden: a proposer drafts from the target's final hidden states (`--speculative mtp`). The
    compiled decode step returns logits only and verify steps never run through it, so such a runner
    compiles nothing (not even in the background: `decode_step_compiled` stays 0); `--compile` is then
    reported as unused and every step runs eagerly (CUDA graphs on a GPU)."""
    from flagdeploy.models import has_sequence_state

    cls = SequenceStateRunner if has_sequence_state(model) else PagedRunner
    per_block = cls.bytes_per_block(model, config.block_size)
    spec = config.speculative
    spec_tokens = spec.num_speculative_tokens if spec is not None and spec.enabled else 0
    state = cls.state_bytes(model, config.max_num_seqs, spec_tokens)
    if state >= config.kv_cache_memory:
        raise ConfigError(
            f"The per-sequence state of --max-num-seqs {config.max_num_seqs} sequences takes {state / 2**30:.2f} GiB, "
            f"all of the {config.kv_cache_memory / 2**30:.2f} GiB KV cache. Lower --max-num-seqs or raise "
            f"--kv-cache-memory."
        )
    num_blocks = max((config.kv_cache_memory - state) // per_block, 1)
    min_blocks = -(-config.max_model_len // config.block_size)
    if num_blocks < min_blocks:
        raise ConfigError(
            f"A KV cache of {config.kv_cache_memory / 2**30:.2f} GiB holds {num_blocks * config.block_size} tokens, "
            f"less than one sequence of --max-model-len {config.max_model_len}. Raise --kv-cache-memory or lower "
            f"--max-model-len."
        )
    # CUDA graphs replay one process's decode step; with collectives inside they are not captured (yet)
    graphs = None
    if config.cuda_graphs and config.device == "cuda" and config.tp * config.ep == 1:
        graphs = {"max_batch": config.max_num_seqs, "max_model_len": config.max_model_len}
    compile = config.compile if config.compile is not None else _background_compile_fits(model)
    compile = compile and config.tp * config.ep == 1 and not keep_hidden
    if cls is SequenceStateRunner:
        runner = SequenceStateRunner(model, num_blocks, config.block_size, config.device, config.max_num_seqs, graphs,
                                     compile, spec_tokens)
    else:
        runner = PagedRunner(model, num_blocks, config.block_size, config.device, graphs, compile, config.max_num_seqs)
    if keep_hidden:
        runner.keep_hidden = True  # (before the first step: a captured graph returns what it asks for)
    if spec_tokens and not getattr(runner, "batched_decode", True):
        raise ConfigError(f"--speculative {spec.method} needs the batched decode step, which this checkpoint's MLA "
                         "kv_b weights do not allow (they cannot be absorbed); serve it with --speculative off.")
    compiled = getattr(runner, "compiled", None)
    if compiled is not None and config.compile is None and getattr(runner, "native", None) is not None:
        runner.compiled = None  # the backend's own step serves decode already: nothing to compile by default
    elif compiled is not None and config.compile is None:  # eager now, the graphs once compiled and faster
        runner.compiled = None
        runner.compiling = compiled.warm_up_in_background(lambda c: setattr(runner, "compiled", c))
    elif compiled is not None:
        if not compiled.warm_up():
            runner.compiled = None
    elif config.compile and keep_hidden:
        log.warning("--compile is not used with --speculative %s: the draft layer reads the target's hidden states, "
                    "which the compiled decode step does not return, and verify steps do not run through it. "
                    "Running eagerly.", spec.method)
    elif config.compile:
        log.warning("--compile is not used here: it compiles the decode step of one process without CUDA graphs "
                    "(tensor/expert parallel ranks and CUDA-graph devices run their own step). Running eagerly.")
    return runner, num_blocks, per_block
