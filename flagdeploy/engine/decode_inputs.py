"""The inputs of one decode step in fixed shapes (`DecodeInputs`) and the step they feed (`Step`): what the
paged runner builds (engine/model_runner.py), what CUDA graphs replay (engine/cuda_graphs.py) and what the
CPU's compiled step runs (engine/compiled_step.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class DecodeInputs:
    """One decode step of B sequences as device tensors (B and the table width W fix every shape)."""

    ids: torch.Tensor  # [B] the new token of each sequence
    positions: torch.Tensor  # [B] its position
    slots: torch.Tensor  # [B] flat cache row it is written to
    tables: torch.Tensor  # [B, W] block tables (padded with a block the sequence does not read)
    ctx: torch.Tensor  # [B] tokens of the sequence including the new one
    state_slots: torch.Tensor  # [B] the sequence's row of the state pools (sequence-state models)
    rows: torch.Tensor  # [B] arange: every row's logits are wanted

    @classmethod
    def build(cls, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
              state_slots: list[int] | None, device) -> "DecodeInputs":
        """The eager step's inputs (no padding rows; tables padded to the widest with block 0)."""
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        width = max(len(b) for b in tables)
        return cls(t(ids), t(positions), t(slots), t([b + [0] * (width - len(b)) for b in tables]), t(ctx),
                   t(state_slots if state_slots is not None else [0] * len(ids)), torch.arange(len(ids), device=device))


Step = Callable[[DecodeInputs], torch.Tensor]
