"""One replica over several ranks: rank 0 schedules and samples, every rank runs the same forward pass.

`flagdeploy serve --tp N --ep M` starts N*M - 1 worker processes beside the server process (rank 0).
Each worker joins the replica's process group, builds its shard of the model, reads only its slices
of the checkpoint and allocates its own caches (the same number of blocks as rank 0: the block
manager on rank 0 addresses every rank's pool). Then it waits for steps: rank 0's runner plans each
step as plain lists (`PagedStep` / `StateStep`), broadcasts it over the control group, and every
rank executes it; the collectives inside the model (row-parallel sums, vocabulary gathers, expert
all-to-all) keep the ranks in lock-step. Only rank 0 samples; it already holds the full logits.

A worker that fails while loading reports its error before rank 0 waits on it, so `serve` fails
with the worker's message instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from flagdeploy import ops, parallel
from flagdeploy.errors import ModelLoadError
from flagdeploy.net import free_port

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint from a slow disk


@dataclass(frozen=True)
class ReplicaSpec:
    """What every rank needs to build its part of the replica (picklable: it crosses a spawn)."""

    path: Path
    fmt: str
    config: object  # EngineConfig
    chip: str | None
    init_method: str


class Workers:
    """Rank 0's handle on ranks 1..n-1: started with the replica, stopped with the engine."""

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        n = spec.config.tp * spec.config.ep
        ctx = mp.get_context("spawn")  # never fork a process that may hold an accelerator context
        self.reports = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(rank, spec, self.reports), daemon=True,
                                  name=f"flagdeploy-rank{rank}") for rank in range(1, n)]
        for proc in self.procs:
            proc.start()
        self.closed = False

    def wait(self, stage: str) -> None:
        """Block until every worker reports `stage`; a worker's failure is raised here, with its message."""
        pending = len(self.procs)
        while pending:
            try:
                rank, what, detail = self.reports.get(timeout=STARTUP_TIMEOUT_S)
            except Exception:
                dead = [p.name for p in self.procs if not p.is_alive()]
                raise ModelLoadError(f"the parallel workers did not report '{stage}' within {STARTUP_TIMEOUT_S:.0f} s"
                                     + (f" ({', '.join(dead)} exited)" if dead else "")) from None
            if what == "error":
                self.close(force=True)
                raise ModelLoadError(f"rank {rank} failed while starting: {detail}")
            if what == stage:
                pending -= 1

    def check(self) -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"parallel worker {dead[0].name} exited (code {dead[0].exitcode}); restart the server")

    def close(self, force: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class LockstepRunner:
    """Rank 0's runner: plans a step, sends it to the other ranks, executes its own share."""

    def __init__(self, runner, workers: Workers):
        self.runner = runner
        self.workers = workers
        self.model = runner.model
        self._dropped: list[int] = []  # sequences finished since the last step

    def __getattr__(self, name):  # kv_caches, pools, caches, ...: the local runner's
        return getattr(self.runner, name)

    def _call(self, method: str, *args) -> None:
        self.workers.check()
        parallel.broadcast_object((method, args))

    def run(self, batch):
        step, sampled = self.runner.plan(batch)
        self._call("step", self._dropped, step)
        self._dropped = []
        return self.runner.execute(step), sampled

    def release(self, seq) -> None:
        self.runner.drop(seq.seq_id)
        self._dropped.append(seq.seq_id)  # the other ranks forget it with the next step

    def score(self, ids: list[int]) -> torch.Tensor:
        self._call("score", ids)
        return self.runner.score(ids)

    def close(self) -> None:
        if not self.workers.closed:
            try:
                self._call("stop")
            except RuntimeError:  # a worker is already gone: nothing left to tell
                pass
            self.workers.close()
        parallel.shutdown()


def _serve_steps(runner) -> None:
    """A worker's life after loading: execute what rank 0 sends until it says stop."""
    while True:
        method, args = parallel.broadcast_object()
        if method == "stop":
            return
        if method == "step":
            dropped, step = args
            for seq_id in dropped:
                runner.drop(seq_id)
            runner.execute(step)
        elif method == "score":
            runner.score(*args)


def _worker_main(rank: int, spec: ReplicaSpec, reports) -> None:
    from .model_loading import load_model
    from .model_runner import build_runner

    try:
        config = spec.config
        backend = ops.use_backend(spec.chip)
        _bind_device(backend.device_type, rank, config.tp * config.ep)
        reports.put((rank, "started", ""))
        parallel.init_model_parallel(parallel.ParallelConfig(config.tp, config.ep), rank, spec.init_method)
        with torch.inference_mode():
            model, _ = load_model(spec.path, spec.fmt, config.dtype, config.device, progress=False,
                                  weight_format=config.weight_format, load_format=config.load_format)
            model.prepare(config.max_model_len)
            runner, _, _ = build_runner(model, config)
    except BaseException as exc:  # noqa: BLE001 (reported to rank 0, which names it)
        log.debug("rank %d failed", rank, exc_info=True)
        reports.put((rank, "error", f"{exc} ({type(exc).__name__})\n{traceback.format_exc(limit=3)}"))
        return
    reports.put((rank, "loaded", ""))
    try:
        with torch.inference_mode():
            _serve_steps(runner)
    finally:
        parallel.shutdown()


def _bind_device(device_type: str, rank: int, world: int) -> None:
    """Rank r drives device r of the replica (the server restricts which devices a replica sees); on the
    CPU the ranks share the cores instead of each taking all of them."""
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.accelerator.set_device_index(rank)


def start(path: Path, fmt: str, config, chip: str | None) -> Workers:
    """Start ranks 1..n-1 (config.device already names the backend's device) and join the group as rank 0."""
    workers = Workers(ReplicaSpec(path, fmt, config, chip, f"tcp://127.0.0.1:{free_port()}"))
    workers.wait("started")
    _bind_device(config.device, 0, config.tp * config.ep)
    parallel.init_model_parallel(parallel.ParallelConfig(config.tp, config.ep), 0, workers.spec.init_method)
    return workers
