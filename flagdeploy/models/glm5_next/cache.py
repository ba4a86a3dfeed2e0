"""What a glm5_next sequence carries between steps: KDA state (own tensors or a row of the engine's
state pools), MLA / indexer per-token rows (one tensor or the engine's block pools), the fixed-shape
`DecodeBatch` and the packed-step `Span`. Apart because both the layers and the engine's runner use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import Glm5Config


@dataclass
class KdaState:
    """A KDA layer's per-sequence state: the last K-1 conv inputs and the recurrent matrix (float32)."""

    conv: torch.Tensor | None = None  # [K-1, 3 * heads * head_dim]
    recurrent: torch.Tensor | None = None  # [heads, head_dim, head_dim]


def _pool_row(key: str) -> property:
    """A view of this state's row of pool `key`; assigning copies into the row."""
    return property(lambda self: self._pool[key][self.slot],
                    lambda self, value: self._pool[key][self.slot].copy_(value))


class PooledKdaState:
    """A KDA state held as one row (`slot`) of the engine's state pools [max_seqs, ...], so that a decode
    step can gather and scatter every sequence's state by row index (`KdaAttention.decode`). Reads are
    views of the row; assignments copy into it. A new sequence's row is zeroed (`reset`): a zero state is
    what a fresh `KdaState` means."""

    conv = _pool_row("conv")
    recurrent = _pool_row("recurrent")

    def __init__(self, pool: dict[str, torch.Tensor], slot: int):
        self._pool, self.slot = pool, slot

    def reset(self) -> None:
        self._pool["conv"][self.slot].zero_()
        self._pool["recurrent"][self.slot].zero_()


class TokenRows:
    """One sequence's per-token rows of one cached quantity (latent, indexer key, pool gate), grown a
    step at a time and read back whole. Standalone they live in one tensor; inside the engine they live
    in pages of a shared pool (`PagedTokenRows`)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def append(self, new: torch.Tensor) -> None:
        self.rows = new if self.rows is None else torch.cat([self.rows, new])

    def all(self) -> torch.Tensor:
        return self.rows


class PagedTokenRows(TokenRows):
    """Rows in the engine's block pool: `pool` [num_blocks, block_size, D] shared by all sequences, and
    the sequence's own block table (the block manager's live list, grown before each step)."""

    def __init__(self, pool: torch.Tensor, block_table: list[int], length: int = 0):
        super().__init__()
        self.pool, self.table, self.length = pool, block_table, length

    def _slots(self, start: int, end: int) -> torch.Tensor:
        bs = self.pool.shape[1]
        pos = torch.arange(start, end, device=self.pool.device)
        blocks = torch.tensor(self.table[: -(-end // bs)], dtype=torch.long, device=self.pool.device)
        return blocks[pos // bs] * bs + pos % bs

    def append(self, new: torch.Tensor) -> None:
        end = self.length + new.shape[0]
        self.pool.view(-1, self.pool.shape[-1]).index_copy_(0, self._slots(self.length, end), new.to(self.pool.dtype))
        self.length = end

    def all(self) -> torch.Tensor:
        return self.pool.view(-1, self.pool.shape[-1]).index_select(0, self._slots(0, self.length))


@dataclass
class MlaCache:
    """An indexed layer's per-token cache: the normalised latent, and the indexer key / pool gate."""

    latent: TokenRows = field(default_factory=TokenRows)  # [S, kv_lora_rank]
    index_keys: TokenRows = field(default_factory=TokenRows)  # [S, index_head_dim] (full indexer layers only)
    index_gate: TokenRows = field(default_factory=TokenRows)  # [S, index_head_dim]


@dataclass
class Glm5SequenceCache:
    """Everything one sequence carries between steps; `length` counts the tokens already seen."""

    layers: list[KdaState | MlaCache]
    length: int = 0

    @classmethod
    def empty(cls, cfg: Glm5Config) -> "Glm5SequenceCache":
        return cls([KdaState() if lt == "linear_attention" else MlaCache() for lt in cfg.layer_types])

    @classmethod
    def paged(cls, cfg: Glm5Config, pools: dict[int, dict[str, torch.Tensor]], block_table: list[int],
              state_slot: int, length: int = 0):
        """A view of one sequence in the engine's pools: per-token rows through its block table, KDA
        state in row `state_slot`, `length` tokens already cached (the engine builds one each step)."""
        return cls([PooledKdaState(pools[i], state_slot) if lt == "linear_attention" else
                    MlaCache(**{k: PagedTokenRows(pool, block_table, length) for k, pool in pools[i].items()})
                    for i, lt in enumerate(cfg.layer_types)], length)


@dataclass
class DecodeBatch:
    """One decode step of B sequences (one new token each) in shapes fixed by B and the block-table
    width W alone: every per-sequence quantity is a device tensor and nothing is read back to the host,
    so the step can be captured once as a CUDA graph and replayed (`forward_decode`)."""

    pools: dict[int, dict[str, torch.Tensor]]  # the engine's pools (`cache_pools`)
    state_slots: torch.Tensor  # [B] each sequence's row of the KDA state pools
    slots: torch.Tensor  # [B] flat pool row (block * block_size + offset) of the new token
    block_tables: torch.Tensor  # [B, W]
    lengths: torch.Tensor  # [B] tokens of the sequence including the new one
    # A speculative verify step (rows of one sequence at consecutive positions): the KDA layers step the rows
    # in waves (first, end, source state rows, target state rows) — rows [first, end) step from the source
    # rows' states into the target rows, wave after wave. None: every row steps its `state_slots` row.
    waves: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None


# One sequence of a packed step: its rows [start, end) in the flattened token dimension, and how many of
# its tokens the cache already holds (the position of its first new token).
Span = tuple[int, int, int]
