"""Putting a checkpoint tensor into its slot: the whole tensor, or this rank's slice of it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flagdeploy.parallel import Shard


def copy_param(name: str, dst: torch.Tensor, t, shard: Shard | None) -> None:
    """A plain parameter from its checkpoint tensor (this rank's slice of it under TP; a slice shorter
    than the parameter, the last vocabulary shard, fills the leading rows and leaves the zero padding)."""
    if not isinstance(t, torch.Tensor):
        t = t.dequantize(dst.dtype)
    full = list(dst.shape)
    if shard is not None:
        try:
            t = shard.take(t)
        except ValueError as exc:
            raise ValueError(f"weight {name} {exc}") from exc
        full[shard.dim] = shard.full
        dst.narrow(shard.dim, shard.length, dst.shape[shard.dim] - shard.length).zero_()
        dst = dst.narrow(shard.dim, 0, shard.length)
    if tuple(dst.shape) != tuple(t.shape):
        raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the config implies {tuple(full)}")
    dst.copy_(t)


def linear_slots(prefix: str, m, parts: Iterable[str] | None = None) -> dict[str, tuple]:
    """`weight_slots` entries of a Linear's parts (all of them, or `parts` in that order), bias included."""
    return {f"{prefix}{name}.{kind}": (m, name, kind)
            for name in (m.parts if parts is None else parts) for kind in (("weight", "bias") if m.has_bias else ("weight",))}
