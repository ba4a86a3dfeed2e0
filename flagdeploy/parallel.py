"""Process groups and the collectives tensor / expert parallelism need, on the chip's own library.

The library is data: each backend declares its `collective` (gloo on the CPU, nccl on CUDA, hccl on
Ascend through torch_npu's process group), and `init` starts torch.distributed with it, so the model
code calls `all_reduce` / `all_gather` / `all_to_all` without naming a chip. With one process (or none
initialised) every collective is the identity, so the same model code runs unsplit.

One model replica spans `tp * ep` ranks laid out as a grid, rank = ep_rank * tp + tp_rank:

- the TP group (same ep_rank) splits attention heads, dense MLPs, the vocabulary and each expert's
  intermediate size; row-parallel outputs are summed over it;
- the EP group (same tp_rank) splits the routed experts: each rank holds n_experts / ep of them, and
  tokens travel to the rank that holds their expert and back (all-to-all);
- the control group (gloo, all ranks) carries the step descriptions rank 0's scheduler sends to the
  others, whatever library the tensors travel on.

Data-parallel replicas (`dp`) are separate replicas behind the server's balancer, not ranks here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flagdeploy.ops.registry import active_backend  # where the active backend is kept, not the op package


@dataclass(frozen=True)
class ParallelConfig:
    """How one replica is split: tp x ep ranks (data-parallel replicas are separate processes)."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Ranks (devices) of one replica."""
        return self.tp * self.ep


@dataclass
class _Layout:
    tp: int
    ep: int
    rank: int
    tp_group: object
    ep_group: object
    control: object

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp


_layout: _Layout | None = None


def init(rank: int, world_size: int, init_method: str | None = None, timeout_s: float = 600.0, store=None) -> str:
    """Join the group with the active backend's collective library, meeting through `init_method` (a URL)
    or `store` (a torch.distributed Store); returns the library's name."""
    library = active_backend().collective
    dist.init_process_group(library, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return library


def init_model_parallel(config: ParallelConfig, rank: int, init_method: str | None = None, timeout_s: float = 600.0,
                        store=None) -> None:
    """Join the replica's process group and build its TP, EP and control groups (every rank must call
    this with the same config: group creation is collective)."""
    global _layout
    n = config.world_size
    init(rank, n, init_method, timeout_s, store)
    tp_groups = [dist.new_group(list(range(e * config.tp, (e + 1) * config.tp))) for e in range(config.ep)]
    ep_groups = [dist.new_group(list(range(t, n, config.tp))) for t in range(config.tp)]
    control = dist.new_group(list(range(n)), backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    _layout = _Layout(config.tp, config.ep, rank, tp_groups[rank // config.tp], ep_groups[rank % config.tp], control)


@contextmanager
def simulated(config: ParallelConfig):
    """The layout of the replica's last rank, without a process group: model constructors run their
    split checks (and meta-device shapes) as that rank would. Collectives must not be called inside."""
    global _layout
    saved = _layout
    _layout = _Layout(config.tp, config.ep, config.world_size - 1, None, None, None)
    try:
        yield
    finally:
        _layout = saved


def shutdown() -> None:
    global _layout
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _layout = None


def tp_size() -> int:
    return _layout.tp if _layout else 1


def tp_rank() -> int:
    return _layout.tp_rank if _layout else 0


def tp_group():
    return _layout.tp_group if _layout else None


def ep_size() -> int:
    return _layout.ep if _layout else 1


def ep_rank() -> int:
    return _layout.ep_rank if _layout else 0


def ep_group():
    return _layout.ep_group if _layout else None


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank of the replica (the step descriptions), over the control group."""
    if _layout is None or _layout.tp * _layout.ep == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_layout.control)
    return box[0]


def broadcast_tensor(x: torch.Tensor | None, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> torch.Tensor:
    """Rank 0's tensor `x` on every rank of the replica, over the device library (the others pass None and
    the shape, dtype and device to receive it into): state that rank 0 alone keeps, such as the hidden rows
    its MTP proposer holds, without a trip through the host."""
    if _layout is None or _layout.tp * _layout.ep == 1:
        return x
    if x is None:
        x = torch.empty(shape, dtype=dtype, device=device)
    x = x.contiguous()
    dist.broadcast(x, src=0)
    return x


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a checkpoint tensor: `length` entries from `start` along `dim` of `full`."""

    dim: int
    start: int
    length: int
    full: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The slice of `t`; `t` may already be the slice (a reader that read only this rank's part)."""
        size = t.shape[self.dim]
        if size == self.full:
            return t.narrow(self.dim, self.start, self.length) if self.length != self.full else t
        if size == self.length:
            return t
        raise ValueError(f"has {size} entries along dim {self.dim}; expected {self.full} (or this rank's {self.length})")


def split(n: int, parts: int, index: int, what: str = "entries", flag: str = "--tp") -> tuple[int, int]:
    """(start, length) of share `index` of `n` items split into `parts` equal shares."""
    if n % parts:
        raise ValueError(f"{what}: {n} does not split into {parts} equal shares; pick a {flag} that divides {n}")
    size = n // parts
    return index * size, size


def tp_shard(n: int, dim: int, what: str) -> Shard | None:
    """This TP rank's equal share of `n` rows (dim 0) or columns (dim 1); None without TP."""
    if tp_size() == 1:
        return None
    start, length = split(n, tp_size(), tp_rank(), what)
    return Shard(dim, start, length, n)


def kv_head_shard(num_kv_heads: int, head_dim: int) -> Shard | None:
    """GQA key/value heads on this TP rank: an equal share, or, with fewer KV heads than ranks, the one
    head this rank's query heads read (each KV head then lives on tp / num_kv_heads ranks)."""
    tp = tp_size()
    if tp == 1:
        return None
    full = num_kv_heads * head_dim
    if num_kv_heads % tp == 0:
        return Shard(0, tp_rank() * full // tp, full // tp, full)
    if tp % num_kv_heads == 0:
        head = tp_rank() * num_kv_heads // tp
        return Shard(0, head * head_dim, head_dim, full)
    raise ValueError(f"{num_kv_heads} key/value heads cannot be split over --tp {tp}: pick a tp that divides "
                     f"{num_kv_heads} or a multiple of it")


def vocab_shard(vocab: int) -> Shard | None:
    """This TP rank's rows of the embedding / LM head: ceil(vocab / tp) each, the last one shorter
    (its parameter is padded with zero rows so that every rank's logits have one width)."""
    tp = tp_size()
    if tp == 1:
        return None
    per = -(-vocab // tp)
    start = tp_rank() * per
    return Shard(0, start, max(min(per, vocab - start), 0), vocab)


def padded_vocab(vocab: int) -> int:
    """Rows of this rank's embedding / LM head parameter."""
    return -(-vocab // tp_size())


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
