"""Media inside the engine: the images and videos a prompt carries, and the encoder cache.

The server hands the engine a prompt whose placeholder tokens are already expanded (one token per
feature row the model's vision encoder gives) together with one `MediaItem` per image or video. The
engine never looks at pixels itself: when a step computes prompt positions that an item covers, the
runner asks the `EncoderCache` for the item's features and hands the model the rows that replace those
positions' token embeddings. Features depend on an item's own pixels only, so they are cached by the
item's key (the content hash of the medium and how it was processed): the same image in the next request
is encoded once, and a chunked or recomputed (preempted) prefill never encodes twice while the item is
cached. The same key enters the prefix cache's block hashes (block_manager.py), so a block of
placeholder tokens only matches a block that showed the same medium.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(eq=False)
class MediaItem:
    """One image or video of a prompt, as the model's processor prepared it.

    key: equal keys mean equal features (content hash + processing); positions: the prompt positions
    its feature rows replace, in row order; pixel_values / grid_thw: the encoder's input for this item
    alone ([patches, patch values], [1, 3])."""

    kind: str
    key: str
    positions: list[int]
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    _where: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def overlaps(self, start: int, end: int) -> bool:
        return self.positions[0] < end and self.positions[-1] >= start

    def rows_in(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature rows, their offsets from `start`) of the positions in [start, end)."""
        if self._where is None:
            self._where = torch.tensor(self.positions, dtype=torch.long)
        rows = ((self._where >= start) & (self._where < end)).nonzero().flatten()
        return rows, self._where[rows] - start


def media_keys(items: list[MediaItem], start: int, end: int) -> tuple[str, ...]:
    """Keys of the items that cover any position in [start, end): what a prefix-cache block of those
    positions must match besides its token ids."""
    return tuple(item.key for item in items if item.overlaps(start, end))


class EncoderCache:
    """Features of recently seen media by key, least recently used dropped first once more than
    `budget_rows` feature rows are held. `encode(pixel_values, grid_thw)` runs the model's encoder on
    several items at once (their patches and grids concatenated) and returns their rows in order."""

    def __init__(self, encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], budget_rows: int,
                 device: str | torch.device = "cpu"):
        self.encode, self.budget_rows, self.device = encode, budget_rows, device
        self.held: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = 0
        self.encoded = 0  # items run through the encoder

    def features(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each item's features [num_tokens, hidden]; the items not held are encoded together in one call."""
        missing = list({item.key: item for item in items if item.key not in self.held}.values())
        self.hits += len(items) - len(missing)
        if missing:
            out = self.encode(torch.cat([m.pixel_values for m in missing]).to(self.device),
                              torch.cat([m.grid_thw for m in missing]).to(self.device))
            for item, rows in zip(missing, out.split([m.num_tokens for m in missing])):
                if rows.shape[0] != item.num_tokens:
                    raise ValueError(f"the encoder gave {rows.shape[0]} rows for a {item.kind} of {item.num_tokens} "
                                     "placeholder tokens")
                self.held[item.key] = rows
                self.rows += rows.shape[0]
            self.encoded += len(missing)
        found = []
        for item in items:
            self.held.move_to_end(item.key)
            found.append(self.held[item.key])
        self._evict(keep={item.key for item in items})
        return found

    def _evict(self, keep: set[str]) -> None:
        for key in list(self.held):
            if self.rows <= self.budget_rows:
                break
            if key not in keep:
                self.rows -= self.held.pop(key).shape[0]


def step_embeds(cache: EncoderCache, chunks: list[tuple[int, list[MediaItem], int, int]]
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows replacing token embeddings in one packed step: (packed row indices, rows). `chunks`: per
    sequence in the step, (its first packed row, its media, first and end position computed now). None
    when no computed position is a media position."""
    wanted = [(at, item, start, end) for at, items, start, end in chunks for item in items if item.overlaps(start, end)]
    if not wanted:
        return None
    feats = cache.features([item for _, item, _, _ in wanted])
    index, rows = [], []
    for (at, item, start, end), f in zip(wanted, feats):
        sel, offsets = item.rows_in(start, end)
        index.append(offsets + at)
        rows.append(f[sel.to(f.device)])
    return torch.cat(index), torch.cat(rows)
