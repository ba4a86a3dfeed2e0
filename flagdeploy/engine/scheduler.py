"""Which sequences run in the next step, and how many of their tokens: continuous batching.

Every step has a token budget. Running sequences go first (one token each when decoding, the next
chunk when a long prompt is being prefilled), then waiting ones are admitted in arrival order while
budget, sequence slots and cache blocks last. When blocks run out for a running sequence, the most
recently admitted one is preempted: its blocks are freed and it is recomputed later.

Speculation (engine/speculative.py): a decoding sequence that carries drafts may advance by 1 + k tokens.
Drafts are granted last, from what budget, decode rows (`max_draft_rows`) and free blocks are left after
every running sequence and admission got theirs, so a draft never preempts or delays anything; what does not
fit is dropped (k shrinks, possibly to 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step (1 + its drafts when it speculates)
    drafts: list[list[int]] | None = None  # per sequence, the draft tokens verified this step (None: no one)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_draft_rows: int = 0, drafts_beside_prefill: bool = True):
        self.blocks = blocks
        self.max_draft_rows = max_draft_rows  # decode rows a step may reach with drafts (0: never draft)
        # False for runners whose verify rows cannot share a step with a prompt chunk (sequence-state models
        # run such a step through their packed prefill path, where a draft would step the recurrent state)
        self.drafts_beside_prefill = drafts_beside_prefill
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.kv_bound = False  # the last schedule left a sequence waiting (or preempted one) for cache blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def slots(self) -> int:
        """How many sequences can run at once now: the sequence slots, or fewer where the cache's blocks
        are the limit. The server's admission (`AsyncEngine.would_wait`) counts every request beyond these
        as waiting. While the last schedule held a sequence back for blocks (or preempted one), the running
        sequences are all the cache takes; otherwise the cache holds about as many more sequences of the
        running ones' present size (blocks in use, shared prefixes once) as it has room for, so a cache
        that is nearly full does not open every slot in the moment nobody happens to wait."""
        if self.kv_bound and self.waiting:
            return len(self.running)
        used = self.blocks.num_blocks - self.blocks.num_free
        if not self.running or not used:
            return self.max_num_seqs
        fit = len(self.running) * self.blocks.num_blocks // used
        return max(len(self.running), min(self.max_num_seqs, fit))

    def schedule(self) -> ScheduledBatch:
        budget = self.budget
        preemptions, self.kv_bound = self.num_preemptions, False
        seqs: list[Sequence] = []
        counts: list[int] = []
        running = list(self.running)
        while running and budget:
            seq = running.pop(0)
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.ensure_slots(seq, seq.num_computed + n):
                victim = running.pop() if running else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.ensure_slots(seq, seq.num_computed + n):
                # it waits on: give back the cached blocks its prefix match took, or a waiting sequence would
                # pin blocks the running ones need (and, once every running one is preempted, block itself)
                self.blocks.unmatch(seq)
                if not self.running and not seqs:  # nothing will ever free blocks for it
                    raise RuntimeError("KV cache too small for a single sequence; raise --kv-cache-memory")
                self.kv_bound = True
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        self.kv_bound = self.kv_bound or self.num_preemptions > preemptions
        drafts = self._grant_drafts(seqs, counts, budget) if self.max_draft_rows else None
        return ScheduledBatch(seqs, counts, drafts)

    def _grant_drafts(self, seqs: list[Sequence], counts: list[int], budget: int) -> list[list[int]] | None:
        """Extend decoding sequences by their drafts while budget, decode rows and free blocks last."""
        if not self.drafts_beside_prefill and any(n > 1 or seq.num_computed == 0 for seq, n in zip(seqs, counts)):
            self._drop_drafts()
            return None
        rows = sum(1 for n in counts if n == 1)
        bs = self.blocks.block_size
        drafts: list[list[int]] = [[] for _ in seqs]
        granted = False
        for i, seq in enumerate(seqs):
            if counts[i] != 1 or not seq.draft_ids or seq.num_computed + 1 != seq.num_tokens:
                continue
            k = min(len(seq.draft_ids), budget, self.max_draft_rows - rows)
            if k <= 0:
                continue
            room = (len(seq.block_table) + self.blocks.num_free) * bs - seq.num_tokens
            k = min(k, room)
            if k <= 0 or not self.blocks.ensure_slots(seq, seq.num_tokens + k):
                continue
            drafts[i] = seq.draft_ids[:k]
            counts[i] += k
            budget -= k
            rows += k
            granted = True
        self._drop_drafts()
        return drafts if granted else None

    def _drop_drafts(self) -> None:
        """Drafts (or multi-step placeholders) are for one step: a running sequence the budget left out of this
        one must not carry them into a later one."""
        for seq in self.running:
            seq.draft_ids = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.release(seq)
