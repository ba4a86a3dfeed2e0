"""Small construction helpers the glm5_next layers share: an empty frozen parameter, a one-part
Linear, and how tensor parallelism splits a layer's heads. Apart so that the token mixers, the FFNs
and the model can use them without importing one another.
"""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy import parallel
from flagdeploy.parallel import Shard

from ..linear import Linear


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _lin(out_f: int, in_f: int, dtype: torch.dtype, name: str, bias: bool = False) -> Linear:
    return Linear(out_f, in_f, dtype, (name,), bias=bias)


def _local_heads(heads: int, what: str) -> int:
    """How many of `heads` each TP rank holds (a ValueError naming --tp if they do not split evenly)."""
    return parallel.split(heads, parallel.tp_size(), 0, what, "--tp")[1]


def _head_shard(heads: int, per_head: int, what: str) -> Shard | None:
    """This TP rank's whole heads of a tensor laid out head after head (`per_head` rows each, dim 0);
    None without TP. Splitting by heads (not by rows) keeps a head's rows on one rank."""
    if parallel.tp_size() == 1:
        return None
    start, length = parallel.split(heads, parallel.tp_size(), parallel.tp_rank(), what, "--tp")
    return Shard(0, start * per_head, length * per_head, heads * per_head)
