"""Process groups and the collectives tensor / expert parallelism need, on the chip's own library.

The library is data: each backend declares its `collective` (gloo on the CPU, nccl on CUDA, hccl on
Ascend through torch_npu's process group), and `init` starts torch.distributed with it, so the model
code calls `all_reduce` / `all_gather` / `all_to_all` without naming a chip. With one process (or none
initialised) every collective is the identity, so the same model code runs unsplit.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from flagdeploy import ops


def init(rank: int, world_size: int, init_method: str, timeout_s: float = 600.0) -> str:
    """Join the group with the active backend's collective library; returns the library's name."""
    library = ops.active_backend().collective
    dist.init_process_group(library, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return library


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the group, in place (row-parallel linears: each rank holds a partial product)."""
    if world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (column-parallel outputs, vocab shards)."""
    n = world_size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """Rows of `x` sent to each rank by `send_counts` (in rank order), rows received by `recv_counts`:
    the dispatch and combine of expert parallelism."""
    if world_size(group) == 1:
        return x
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out
