"""The decode step through torch.compile, for devices where no CUDA graph replays it (the CPU).

On the CPU a small model's decode step is bound by dispatch, not arithmetic: glm5_next's fixed-shape
step is ~800 small torch ops (casts, norms, gates, the Sinkhorn iterations, gathers) at 2-5 us each.
Inductor fuses those chains into a few generated C++ loops and leaves the matmuls to oneDNN; the step
then costs what its matmuls and a handful of loops cost (docs/performance.md, issue 3).

One compiled graph serves every step. The batch and the block-table width are marked dynamic (two
independent sizes: no "duck" merging of dimensions that happen to be equal at the first call), and
neither is ever 1: torch.compile specialises a dimension of size 1 into a graph of its own (a second
compile of a minute or more), so a lone sequence runs with one padding row and a one-block table gets a
second block. Padding rows read and write only a scratch block and step a scratch state row that no
sequence owns, as the CUDA graphs' padding does. Because one graph exists, once it is compiled the
per-call guard checks (a tenth of the step at this size) are skipped: `skip_guard_eval_unsafe` keeps
only the guards that choose between graphs, and there is nothing to choose.
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch
import torch.fx.experimental._config  # noqa: F401  (use_duck_shape, patched below)
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, GuardOnDataDependentSymNode

from .cuda_graphs import DecodeInputs, Step

log = logging.getLogger(__name__)

MIN_DIM = 2  # the smallest batch and table width the graph is run at (see the module docstring)


class CompiledDecode:
    def __init__(self, step: Step, device, block_size: int, scratch_block: int, scratch_state: int = 0):
        """step: the model's decode step on `DecodeInputs` → logits [B, vocab]; scratch_block / scratch_state:
        the pool block and state row reserved for padding."""
        from flagdeploy.loaders.source import cache_dir

        # compiled kernels are kept with the models, so that the next start (of any process) reuses them,
        # unless the user chose a directory (torch writes its /tmp default into the variable on first use)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
        # cpp_wrapper: the generated code that calls the kernels is C++ too, not Python (~10% of this
        # step at glm5_next's small sizes, for a longer first compile)
        # fullgraph: a step that breaks into several graphs (a host read, an op dynamo cannot trace) is
        # refused at warm-up instead of compiled piecewise; the guard-free calls rely on one graph
        self.compiled = torch.compile(_own_code(step), fullgraph=True, options={"cpp_wrapper": True})
        self.device = device
        self.scratch_block, self.scratch_slot, self.scratch_state = scratch_block, scratch_block * block_size, scratch_state
        self.ready = False

    def warm_up(self) -> bool:
        """Compile now (on padding rows only), not inside the first request. False where the step does
        not trace to one graph for every batch and width (then the caller runs it eagerly)."""
        t = time.perf_counter()
        log.warning("compiling the decode step (once; a minute or more on a small CPU, less once cached)")
        try:
            self.run([], [], [], [], [], [])
        except ConstraintViolationError as exc:
            # e.g. glm5_next's indexer pools of 4 tokens over blocks of 2: the pool count is a floor of
            # the width, which the trace fixes to one value
            log.warning("the decode step depends on the batch size or block-table width in a way one compiled "
                        "graph cannot follow (%s); running it eagerly. A --block-size that is a multiple of the "
                        "model's pooling avoids this.", str(exc).splitlines()[0])
            return False
        except (torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode) as exc:
            # e.g. the cpu backend's loop over W8A8 expert banks, which reads the routing on the host
            log.warning("the decode step does not trace to one graph on this backend (%s); running it eagerly.",
                        str(exc).splitlines()[0])
            return False
        log.warning("decode step compiled in %.0f s", time.perf_counter() - t)
        return True

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
            state_slots: list[int]) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences (one new token each)."""
        n = len(ids)
        pad = max(MIN_DIM - n, 0)
        width = max(MIN_DIM, *(len(t) for t in tables)) if tables else MIN_DIM
        table = [t + [self.scratch_block] * (width - len(t)) for t in tables] + [[self.scratch_block] * width] * pad
        # built in inference mode, like everything the (inference-mode) step touches: dynamo refuses a
        # graph that mixes inference tensors with normal ones
        with torch.inference_mode():
            d = DecodeInputs.build(ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad, table,
                                   ctx + [1] * pad, state_slots + [self.scratch_state] * pad, self.device)
            if not self.ready:
                for t in (d.ids, d.positions, d.slots, d.ctx, d.state_slots, d.rows, d.tables):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(d.tables, 1)
                # only those two: the pools, weights and everything else static, whatever other
                # compiles of this source line in the process saw (automatic dynamism would make the
                # block size symbolic after another engine's compile, and a floor of it could then
                # quietly fix the width)
                with torch.fx.experimental._config.patch(use_duck_shape=False), \
                        torch._dynamo.config.patch(automatic_dynamic_shapes=False, automatic_dynamic_local_pgo=False):
                    out = self.compiled(d)
                self.ready = True
            else:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = self.compiled(d)
        return out[:n]


def _own_code(step: Step) -> Step:
    """`step` behind a function with a code object of its own. Dynamo keeps compiled graphs per code
    object, so without this every engine of a process (tests, benchmarks) would add its graph to one
    shared list, and the guard-free calls above rely on each engine's list holding exactly one."""

    def call(d: DecodeInputs) -> torch.Tensor:
        return step(d)

    return types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__)
