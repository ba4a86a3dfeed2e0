"""The decode step through torch.compile, for devices where no CUDA graph replays it (the CPU).

On the CPU a small model's decode step is bound by dispatch, not arithmetic: glm5_next's fixed-shape
step is ~800 small torch ops (casts, norms, gates, the Sinkhorn iterations, gathers) at 2-5 us each.
Inductor fuses those chains into a few generated C++ loops and leaves the matmuls to oneDNN; the step
then costs what its matmuls and a handful of loops cost (docs/performance.md, issue 3).

One compiled graph serves every step of two or more sequences. The batch and the block-table width are
marked dynamic (two independent sizes: no "duck" merging of dimensions that happen to be equal at the
first call), and neither is ever 1 there: torch.compile specialises a dimension of size 1, so a
one-block table gets a second block. A lone sequence has a graph of its own, compiled at start-up too,
with the batch fixed at 1 (padding it to two rows would cost a second row in every GEMV, ~15% of a
small model's step on the CPU). Padding rows read and write only a scratch block and step a scratch
state row that no sequence owns, as the CUDA graphs' padding does. Each graph sits behind a code object
of its own, so once it is compiled the per-call guard checks (a tenth of the step at this size) are
skipped: `skip_guard_eval_unsafe` keeps only the guards that choose between a code object's graphs, and
each has one.

By default (`serve` without --compile/--no-compile) this happens on a thread of its own while the engine
serves with its eager step, and the runner takes the graphs once they are compiled and measured faster:
ready at once, fast a minute or two later (`warm_up_in_background`). The ops ask `ops.tracing()`, not
torch's process-wide `is_compiling()` flag, which the compile would hold for the serving thread too.

The graphs are used only for batch sizes where they beat the eager step: after compiling, the warm-up
times both on padding rows at 1 row (the one-row graph) and at 2, 4, 8, ... rows and keeps the batched
graph up to the largest size where it won (`max_batch`); other steps run eagerly. (In the batched graph
the llama family's weight-only linears run as one opaque op that picks its kernel by row count at run
time, as the eager step does, so there the graphs win at every size; the measurement keeps a backend
whose graph would lose from being slowed.)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable

import torch

from flagdeploy.ops import active_backend
from flagdeploy.ops.check import fastest

from .decode_inputs import DecodeInputs, Step

log = logging.getLogger(__name__)

QUIET_AUTOTUNE = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
BACKGROUND_SWITCH_S = 2e-5  # the interpreter's GIL switch interval while the step compiles in the background
MIN_DIM = 2  # the smallest batch and table width the graph is run at (see the module docstring)


class CompiledDecode:
    def __init__(self, step: Step, device, block_size: int, scratch_block: int, scratch_state: int = 0,
                 max_seqs: int = 256, weight_only: bool = False):
        """step: the model's decode step on `DecodeInputs` → logits [B, vocab]; scratch_block / scratch_state:
        the pool block and state row reserved for padding; max_seqs: the largest batch the engine runs;
        weight_only: every linear of the model runs a weight-only quantized kernel (see `inductor_config`)."""
        self.compiled: dict[int, Callable] = {}  # rows -> torch.compile'd step, made by `warm_up` (`_compilers`)
        self.step, self.device, self.max_seqs = step, device, max_seqs
        # the backend's inductor settings per graph, and quiet autotuning (inductor writes each autotuned
        # matmul's timings to stderr otherwise). The backend's "weight_only_one_row" entries add to the rest
        # for the one-row graph of a weight-only quantized model: there every matmul is a packed GEMV, which
        # the cpu backend autotunes (a few shapes, seconds each); autotuning a dense model's every shape
        # would make its compile more than twice as long.
        settings = dict(active_backend().compile_config)
        one_row = settings.pop("weight_only_one_row", {})
        self.inductor_config = {MIN_DIM: {**QUIET_AUTOTUNE, **settings},
                                1: {**QUIET_AUTOTUNE, **settings, **(one_row if weight_only else {})}}
        self.scratch_block, self.scratch_slot, self.scratch_state = scratch_block, scratch_block * block_size, scratch_state
        self.ready: set[int] = set()  # the graphs compiled so far
        self.max_batch = 0  # the largest batch the graphs serve (set by `warm_up`); larger ones run eagerly
        self.one_row = False  # whether a lone sequence runs through the one-row graph (set by `warm_up`)

    def warm_up_in_background(self, install: Callable[["CompiledDecode"], None]) -> threading.Thread:
        """`warm_up` on a daemon thread, then `install(self)` if the graphs are worth using. The compile and
        its timings touch only the padding block and state row, which no sequence owns, so the engine keeps
        stepping its eager step meanwhile (both share the cores: steps are slower while it compiles).

        The compile is Python holding the GIL for long stretches: each time the serving thread releases
        it (once per kernel, a few hundred times a step) the compile thread would keep it for the whole
        switch interval (5 ms), a step ~1 s. Meanwhile the interval is BACKGROUND_SWITCH_S, so a step
        waits at most that per release."""

        def work() -> None:
            before = sys.getswitchinterval()
            sys.setswitchinterval(BACKGROUND_SWITCH_S)
            try:
                if self.warm_up(background=True):
                    install(self)
                    log.warning("the compiled decode step now serves %s", self.serving())
            except Exception:  # noqa: BLE001  (the eager step keeps serving; say why it stays)
                log.warning("compiling the decode step failed; the eager step keeps serving", exc_info=True)
            finally:
                sys.setswitchinterval(before)

        thread = threading.Thread(target=work, name="flagdeploy-compile", daemon=True)
        thread.start()
        return thread

    def _compilers(self) -> dict[int, Callable]:
        """The torch.compile wrappers of the step, one per graph. torch's compiler is imported here, by the
        compile (on serve's background thread), not with this module: ~3 s of imports that a server would
        otherwise pay before it is ready."""
        import torch._inductor.config  # noqa: F401  (patched in `_call`)
        import torch.fx.experimental._config  # noqa: F401  (use_duck_shape, patched in `_call`)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        from flagdeploy.checkpoints.source import cache_dir

        # compiled kernels are kept with the models, so that the next start (of any process) reuses them,
        # unless the user chose a directory (torch writes its /tmp default into the variable on first use)
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
        # cpp_wrapper: the generated code that calls the kernels is C++ too, not Python (~10% of this
        # step at glm5_next's small sizes, for a longer first compile)
        # fullgraph: a step that breaks into several graphs (a host read, an op dynamo cannot trace) is
        # refused at warm-up instead of compiled piecewise; the guard-free calls rely on one graph
        # two graphs: one for every batch of 2 or more rows (batch and width dynamic), one for a single row
        # (static batch: no padding row, which would cost a lone stream a second row in every GEMV)
        return {rows: torch.compile(_own_code(self.step), fullgraph=True, options={"cpp_wrapper": True})
                for rows in (MIN_DIM, 1)}

    def serving(self) -> str:
        """Which steps the graphs serve, in words."""
        return ", ".join(["one sequence"] * self.one_row + [f"2 to {self.max_batch} sequences"] * (self.max_batch >= MIN_DIM))

    def warm_up(self, background: bool = False) -> bool:
        """Compile now (on padding rows only), not inside the first request. False where the step does
        not trace to one graph for every batch and width (then the caller runs it eagerly)."""
        t = time.perf_counter()
        self.compiled = self.compiled or self._compilers()
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, GuardOnDataDependentSymNode

        log.warning("compiling the decode step%s (once; a minute or more on a small CPU, less once cached)",
                    " in the background, serving with the eager step meanwhile" if background else "")
        try:
            self._call(MIN_DIM, [], [], [], [], [], [])
        except ConstraintViolationError as exc:
            # e.g. glm5_next's indexer pools of 4 tokens over blocks of 2: the pool count is a floor of
            # the width, which the trace fixes to one value
            log.warning("the decode step depends on the batch size or block-table width in a way one compiled "
                        "graph cannot follow (%s); running it eagerly. A --block-size that is a multiple of the "
                        "model's pooling avoids this.", str(exc).splitlines()[0])
            return False
        except (torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode, torch._dynamo.exc.BackendCompilerFailed) as exc:
            # e.g. the cpu backend's loop over W8A8 expert banks, which reads the routing on the host, or
            # a weight laid out as an opaque oneDNN tensor
            log.warning("the decode step does not trace to one graph on this backend (%s); running it eagerly.",
                        str(exc).splitlines()[0])
            return False
        try:
            self._call(1, [], [], [], [], [], [])
        except Exception as exc:  # noqa: BLE001  (the one-row graph is an extra: without it one row is padded to two)
            log.info("no one-row decode graph (%s); a lone sequence runs with a padding row", str(exc).splitlines()[0])
        log.warning("decode step compiled in %.0f s", time.perf_counter() - t)
        # each graph on its own: the one-row graph is a different program (e.g. autotuned GEMVs) and can win
        # where the batched one loses
        self.one_row = 1 in self.ready and self._graph_wins(1)
        self.max_batch = self._largest_faster_batch()
        if not self.one_row and self.max_batch < MIN_DIM:
            log.warning("the compiled decode step is slower than the eager one on this backend; running it eagerly.")
            return False
        log.info("compiled decode step used for %s", self.serving())
        return True

    def serves(self, n: int) -> bool:
        """Whether a decode step of n sequences runs through a graph (else eagerly)."""
        return self.one_row if n == 1 and 1 in self.ready else n <= self.max_batch

    def _largest_faster_batch(self) -> int:
        """The largest of 2, 4, 8, ... (up to max_seqs) rows at which the graph, and at every size before it,
        beat the eager step; 0 if it loses at 2 rows."""
        sizes = [n for n in (2**i for i in range(1, 16)) if n < self.max_seqs] + [max(self.max_seqs, MIN_DIM)]
        best = 0
        for n in sizes:
            if not self._graph_wins(n):
                break
            best = n
        return best

    def _graph_wins(self, n: int, repeats: int = 3) -> bool:
        """Whether the graph beats the eager step at n rows (best of `repeats` each, on padding rows)."""
        rows = ([0] * n, [0] * n, [self.scratch_slot] * n, [[self.scratch_block] * MIN_DIM] * n, [1] * n,
                [self.scratch_state] * n)
        with torch.inference_mode():
            d = DecodeInputs.build(*rows, self.device)
            return (fastest(lambda: self.run(*rows), repeats, self.device)
                    < fastest(lambda: self.step(d), repeats, self.device))

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], ctx: list[int],
            state_slots: list[int]) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences (one new token each)."""
        rows = 1 if len(ids) == 1 and 1 in self.ready else MIN_DIM
        return self._call(rows, ids, positions, slots, tables, ctx, state_slots)

    def _call(self, rows: int, ids, positions, slots, tables, ctx, state_slots) -> torch.Tensor:
        """Through the graph for `rows` (1, or MIN_DIM: any batch of at least that, padded up to it)."""
        n = len(ids)
        pad = max(rows - n, 0)
        width = max(MIN_DIM, *(len(t) for t in tables)) if tables else MIN_DIM
        table = [t + [self.scratch_block] * (width - len(t)) for t in tables] + [[self.scratch_block] * width] * pad
        compiled = self.compiled[rows]
        # built in inference mode, like everything the (inference-mode) step touches: dynamo refuses a
        # graph that mixes inference tensors with normal ones
        with torch.inference_mode():
            d = DecodeInputs.build(ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad, table,
                                   ctx + [1] * pad, state_slots + [self.scratch_state] * pad, self.device)
            if rows not in self.ready:
                if rows > 1:
                    for t in (d.ids, d.positions, d.slots, d.ctx, d.state_slots, d.rows, d.tables):
                        torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(d.tables, 1)
                # only those two: the pools, weights and everything else static, whatever other
                # compiles of this source line in the process saw (automatic dynamism would make the
                # block size symbolic after another engine's compile, and a floor of it could then
                # quietly fix the width)
                # and the backend's inductor settings (freezing is read when the graph is handed to
                # inductor, not from torch.compile's options)
                with torch.fx.experimental._config.patch(use_duck_shape=False), \
                        torch._dynamo.config.patch(automatic_dynamic_shapes=False, automatic_dynamic_local_pgo=False), \
                        torch._inductor.config.patch(self.inductor_config[rows]):
                    out = compiled(d)
                self.ready.add(rows)
            else:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = compiled(d)
        return out[:n]


def _own_code(step: Step) -> Step:
    """`step` behind a function with a code object of its own. Dynamo keeps compiled graphs per code
    object, so without this every engine of a process (tests, benchmarks) would add its graph to one
    shared list, and the guard-free calls above rely on each engine's list holding exactly one."""

    def call(d: DecodeInputs) -> torch.Tensor:
        return step(d)

    return types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__)
