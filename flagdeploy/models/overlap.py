"""An independent branch of a layer on a second CUDA stream, so that two memory-bound chains share the GPU.

At decode sizes a MoE layer's routed experts (a router and five FP8 expert launches) and its shared expert
(two matmuls) each leave most of the GPU idle, one after the other. `start` runs the branch on a side
stream that first waits for everything already queued (its input included); `finish` makes the caller's
stream wait for the branch and hands back its result. Inside CUDA graph capture the two streams become
two parallel paths of the graph. On other devices `start` simply runs the branch.

Memory: the branch's tensors are allocated on the side stream. Its output is used on the main stream only
after `finish` and freed there; the side stream's next work waits for the main stream again (`start`),
so no block is reused while a stream still reads it.
"""

from __future__ import annotations

from typing import Callable

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


Branch = tuple  # (the branch's result, the stream it runs on; None where it already ran)


def start(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Branch:
    if not x.is_cuda:
        return fn(x), None
    side = _SIDE.get(x.device)
    if side is None:
        side = _SIDE[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        return fn(x), side


def finish(branch: Branch) -> torch.Tensor:
    value, stream = branch
    if stream is not None:
        torch.cuda.current_stream(value.device).wait_stream(stream)
    return value
