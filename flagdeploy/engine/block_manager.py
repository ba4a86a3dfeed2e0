"""Paged KV-cache blocks with prefix caching by chained block hashes.

A block holds `block_size` tokens' k/v. A full block is identified by the hash of its tokens (and of the
media whose placeholders it holds) chained with the hash of the block before it, so equal hashes mean
equal prefixes. Freed blocks keep their hash until they are reused for something else (least recently
freed first), so a prompt that comes back later still hits.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _hash(self, seq: Sequence, i: int) -> int:
        prev = self.block_hash[seq.block_table[i - 1]] if i else None
        return hash((prev, seq.block_key(i, self.block_size)))

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hash[block] = None
        self.ref[block] = 1
        return block

    def match_prefix(self, seq: Sequence) -> None:
        """On admission: reuse cached blocks for the longest cached prefix of the prompt.

        Only blocks that end before the last prompt token count, so at least one token is always
        computed and produces the logits to sample from.
        """
        bs = self.block_size
        prev = None
        hits = 0
        for i in range((seq.num_tokens - 1) // bs if self.prefix_caching else 0):
            h = hash((prev, seq.block_key(i, bs)))
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
            seq.block_table.append(block)
            prev = h
            hits += 1
        seq.num_hashed_blocks = hits
        seq.num_computed = seq.num_cached_tokens = hits * bs
        self.prefix_hit_tokens += hits * bs
        self.prefix_queried_tokens += seq.num_tokens

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match_prefix` for a sequence that could not be admitted after all (it matches again later)."""
        if not seq.block_table:
            return
        self.prefix_hit_tokens -= seq.num_cached_tokens
        self.prefix_queried_tokens -= seq.num_tokens
        self.release(seq)
        seq.num_hashed_blocks = seq.num_computed = seq.num_cached_tokens = 0

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for its first `num_tokens` tokens; False (and no change) if they run out."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (taken for drafts that were rejected).
        They were taken fresh by `ensure_slots` and never hashed, so they go straight back to the pool."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref[block] -= 1
            if self.ref[block] == 0:  # unhashed: reused first, before blocks the prefix cache may still hit
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: make this sequence's newly completed blocks findable by later prompts."""
        full = seq.num_computed // self.block_size if self.prefix_caching else 0
        for i in range(seq.num_hashed_blocks, full):
            h = self._hash(seq, i)
            block = seq.block_table[i]
            self.block_hash[block] = h
            self.hash_to_block.setdefault(h, block)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def release(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        seq.block_table = []
