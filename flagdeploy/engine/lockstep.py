"""One replica over several ranks: rank 0 schedules and samples, every rank runs the same forward pass.

`flagdeploy serve --tp N --ep M` starts N*M - 1 worker processes beside the server process (rank 0).
Each worker joins the replica's process group, builds its shard of the model, reads only its slices
of the checkpoint and allocates its own caches (the same number of blocks as rank 0: the block
manager on rank 0 addresses every rank's pool). Then it waits for steps: rank 0's runner plans each
step as plain lists (`PagedStep` / `StateStep`), broadcasts it over the control group, and every
rank executes it; the collectives inside the model (row-parallel sums, vocabulary gathers, expert
all-to-all) keep the ranks in lock-step. Only rank 0 samples; it already holds the full logits.

A worker that fails while loading reports its error before rank 0 waits on it, so `serve` fails
with the worker's message instead of hanging. The ranks meet through a store rank 0 serves
(engine/nodes.py): on loopback for one host, on --master-addr when the replica spans nodes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flagdeploy import ops, parallel
from flagdeploy.errors import ModelLoadError
from flagdeploy.lifetime import on_parent_exit
from flagdeploy.net import free_port

from .mtp import MtpForwards
from .nodes import HEARTBEAT_S, Heartbeat, NodeGroup, NodeMonitor, connect, join, post_failure

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint from a slow disk


@dataclass(frozen=True)
class ReplicaSpec:
    """What every rank needs to build its part of the replica (picklable: it crosses a spawn)."""

    path: Path
    fmt: str
    config: object  # EngineConfig
    chip: str | None
    nodes: NodeGroup


class Workers:
    """A process's handle on the ranks it started (rank 0's: the other ranks of its node; a headless
    node's: all of its own): started with the replica, stopped with the engine."""

    def __init__(self, path: Path, fmt: str, config, chip: str | None, nodes: NodeGroup, ranks: list[int]):
        self.spec = ReplicaSpec(path, fmt, config, chip, nodes)
        ctx = mp.get_context("spawn")  # never fork a process that may hold an accelerator context
        self.reports = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(rank, self.spec, self.reports), daemon=True,
                                  name=f"flagdeploy-rank{rank}") for rank in ranks]
        for proc in self.procs:
            proc.start()
        self.closed = False
        self.store = None  # rank 0's: the store it serves lives as long as the replica
        self.monitor: NodeMonitor | None = None  # rank 0 of a replica across nodes: watching the others

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
        if self.monitor is not None:
            self.monitor.stop()
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

    def call_everywhere(self, what: str, args: tuple) -> None:
        """Have the other ranks run a rank-local forward beside the steps (`what`: "mtp.draft" is
        `MtpForwards.draft`) with rank 0's arguments: plain values in the message, tensors (hidden rows)
        broadcast over the device library after it. Rank 0 then runs its own share."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        plain = [_TensorSlot(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        self._call("forward", what, plain)
        for t in tensors:
            parallel.broadcast_tensor(t)

    def close(self) -> None:
        if not self.workers.closed:
            try:
                self._call("stop")
            except RuntimeError:  # a worker is already gone: nothing left to tell
                pass
            self.workers.close()
        parallel.shutdown()


@dataclass(frozen=True)
class _TensorSlot:
    """A tensor argument of `call_everywhere`, sent after the message over the device library."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _serve_steps(runner, forwards: dict) -> None:
    """A worker's life after loading: execute what rank 0 sends until it says stop. `forwards`: the
    rank-local forwards beside the steps that rank 0 may call by name (the MTP layer's, "mtp")."""
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
        elif method == "forward":
            what, plain = args
            owner, name = what.split(".")
            target = forwards[owner]
            values = [parallel.broadcast_tensor(None, a.shape, a.dtype, target.device) if isinstance(a, _TensorSlot)
                      else a for a in plain]
            getattr(target, name)(*values)


def _worker_main(rank: int, spec: ReplicaSpec, reports) -> None:
    from .model_loading import load_model
    from .model_runner import build_runner

    # a rank whose launching process is gone stops too, rather than hold its device and wait on collectives
    # with nobody to step it
    on_parent_exit(os.getppid(), lambda: os._exit(1))
    try:
        config, nodes = spec.config, spec.nodes
        world = config.tp * config.ep
        backend = ops.use_backend(spec.chip)
        _bind_device(backend.device_type, rank - nodes.ranks(world).start, nodes.per_node(world))
        reports.put((rank, "started", ""))
        store = connect(nodes)
        join(store, rank, world, nodes)
        parallel.init_model_parallel(parallel.ParallelConfig(config.tp, config.ep), rank, store=_group_store(store))
        mtp = config.speculative is not None and config.speculative.method == "mtp"
        with torch.inference_mode():
            model, _ = load_model(spec.path, spec.fmt, config.dtype, config.device, progress=False,
                                  weight_format=config.weight_format, load_format=config.load_format, mtp=mtp,
                                  q8_activations=config.q8_activations)
            model.prepare(config.max_model_len)
            runner, _, _ = build_runner(model, config)
            forwards = {"mtp": MtpForwards(model, runner)} if mtp else {}
    except BaseException as exc:  # noqa: BLE001 (reported to rank 0, which names it)
        log.debug("rank %d failed", rank, exc_info=True)
        reports.put((rank, "error", f"{exc} ({type(exc).__name__})\n{traceback.format_exc(limit=3)}"))
        return
    reports.put((rank, "loaded", ""))
    try:
        with torch.inference_mode():
            _serve_steps(runner, forwards)
    finally:
        parallel.shutdown()


def _bind_device(device_type: str, local_rank: int, local_ranks: int) -> None:
    """The node's r-th rank drives its device r (the server restricts which devices a replica sees); on
    the CPU the node's ranks share its cores instead of each taking all of them."""
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    else:
        torch.accelerator.set_device_index(local_rank)


def _group_store(store):
    """The process group's keys, apart from flagdeploy's own (joined ranks, heartbeats) in the same store."""
    return dist.PrefixStore("flagdeploy/pg/", store)


def start(path: Path, fmt: str, config, chip: str | None, nodes: NodeGroup | None = None) -> Workers:
    """As rank 0 (config.device already names the backend's device): serve the replica's store, start
    this node's other ranks, wait until every rank of every node has joined, and join the group. With
    several nodes, a monitor then watches the others (engine/nodes.py)."""
    world = config.tp * config.ep
    nodes = nodes or NodeGroup(master_port=free_port())
    nodes.check(world)
    store = connect(nodes, serve=True)
    workers = Workers(path, fmt, config, chip, nodes, list(nodes.ranks(world, 0))[1:])
    workers.store = store
    try:
        workers.wait("started")
        _bind_device(config.device, 0, nodes.per_node(world))
        join(store, 0, world, nodes)
    except BaseException:
        workers.close(force=True)
        raise
    if nodes.nnodes > 1:
        workers.monitor = NodeMonitor(nodes, world)
    parallel.init_model_parallel(parallel.ParallelConfig(config.tp, config.ep), 0, store=_group_store(store))
    return workers


def run_headless(path, fmt: str, config, chip: str | None, nodes: NodeGroup) -> int:
    """A node other than 0: start this node's ranks, report them, keep the heartbeat, and return the exit
    code once they stop (0 when rank 0 told them to)."""
    from .model_loading import check_split

    world = config.tp * config.ep
    nodes.check(world)
    config.device = ops.use_backend(chip).device_type
    check_split(path, fmt, config)  # what node 0 refuses, refused here too before anything starts
    store = connect(nodes)
    heartbeat = Heartbeat(nodes)
    workers = Workers(path, fmt, config, chip, nodes, list(nodes.ranks(world)))
    try:
        try:
            workers.wait("loaded")
        except ModelLoadError as exc:
            post_failure(store, nodes.node_rank, str(exc))
            raise
        print(f"flagdeploy: node {nodes.node_rank} of {nodes.nnodes} ready (ranks "
              f"{', '.join(map(str, nodes.ranks(world)))}); serving steps from {nodes.master_addr}", file=sys.stderr,
              flush=True)
        while all(p.is_alive() for p in workers.procs):
            if heartbeat.lost is not None:  # node 0's store went away: the replica is over
                log.warning("node 0 stopped answering (%s); stopping this node's ranks", heartbeat.lost)
                workers.close(force=True)
                return 1
            time.sleep(HEARTBEAT_S / 2)
        codes = [p.exitcode or 0 for p in workers.procs if not p.is_alive()]
        if any(codes):
            post_failure(store, nodes.node_rank, f"a rank exited with code {max(codes, key=abs)}")
        workers.close()
        return 1 if any(codes) else 0
    finally:
        heartbeat.stop()
