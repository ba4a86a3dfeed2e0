"""One replica across several machines: where its ranks run, how they meet, and what happens when a
machine goes away.

`flagdeploy serve --tp 4 --nnodes 2 --node-rank R --master-addr A --master-port P` on each machine: the
replica's tp x ep ranks are spread evenly over the nodes in rank order (node R runs ranks R*k .. R*k+k-1,
k = ranks / nodes), so with rank = ep_rank * tp + tp_rank a TP group fills a node before it crosses one and
expert parallelism goes across nodes. Node 0 runs rank 0 (the scheduler and the HTTP server) and its own
share of workers; every other node is headless: it starts its workers and watches them.

Meeting: every rank connects to one key-value store that rank 0 serves on A:P (torch's TCPStore), says
it has joined, and rank 0 waits for all of them before any collective starts, so a node that never comes
is named ("node 1 (ranks 2, 3) did not join within 300 s") instead of a collective hanging. The process
group itself is built on that store, with the chip's library (gloo, NCCL, HCCL); the network interface
it uses is the libraries' own choice, set with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME /
HCCL_SOCKET_IFNAME (`flagdeploy doctor --nodes` checks them before a start).

Liveness: each headless node bumps a counter in the store every second and posts its workers' errors
there; a monitor on node 0 reads them. A node that stops counting for `timeout_s`, or posts an error, is
reported by number and ranks, `/ready` answers 503 with the reason, and node 0 exits shortly after: a
collective with a vanished peer would otherwise wait for the library's own timeout (minutes) or forever.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from flagdeploy.errors import ModelLoadError

log = logging.getLogger(__name__)

_KEY = "flagdeploy/"
HEARTBEAT_S = 1.0
EXIT_GRACE_S = 2.0  # /ready answers 503 with the reason this long before node 0 exits


@dataclass(frozen=True)
class NodeGroup:
    """The machines one replica spans. One node (the default) is the single-host case: the store then
    listens on loopback on a free port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 300.0  # to join, and the longest a node may stay silent once joined

    def check(self, world: int) -> None:
        """Refuse a layout the nodes cannot take evenly, with what to change."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}")
        if world % self.nnodes:
            raise ValueError(f"--tp x --ep = {world} ranks do not spread evenly over --nnodes {self.nnodes}; give each "
                             "node the same number of devices (make tp x ep a multiple of the node count)")

    def per_node(self, world: int) -> int:
        return world // self.nnodes

    def ranks(self, world: int, node: int | None = None) -> range:
        """The global ranks node `node` (this one by default) runs."""
        k = self.per_node(world)
        node = self.node_rank if node is None else node
        return range(node * k, (node + 1) * k)

    def node_of(self, rank: int, world: int) -> int:
        return rank // self.per_node(world)

    def describe(self, node: int, world: int) -> str:
        ranks = self.ranks(world, node)
        return f"node {node} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def connect(nodes: NodeGroup, serve: bool = False) -> dist.TCPStore:
    """A connection to the replica's store at master_addr:master_port; `serve`: this process (rank 0)
    hosts it. A client retries until the store is up, for at most timeout_s."""
    try:
        return dist.TCPStore(nodes.master_addr, nodes.master_port, is_master=serve, wait_for_workers=False,
                             timeout=timedelta(seconds=nodes.timeout_s))
    except (RuntimeError, OSError) as exc:
        where = f"{nodes.master_addr}:{nodes.master_port}"
        what = f"could not listen on {where} ({exc}); pick a free --master-port" if serve else (
            f"could not reach node 0's store at {where} within {nodes.timeout_s:.0f} s ({exc}); start node 0 first, "
            f"and check --master-addr, the port's firewall and the network interface")
        raise ModelLoadError(f"multi-node rendezvous: {what}") from None


def join(store: dist.TCPStore, rank: int, world: int, nodes: NodeGroup) -> None:
    """Say that `rank` is here; rank 0 then waits until every rank has said so (or names who did not)."""
    store.set(f"{_KEY}joined/{rank}", str(nodes.node_of(rank, world)))
    if rank == 0:
        _wait_for_ranks(store, world, nodes)


def _wait_for_ranks(store: dist.TCPStore, world: int, nodes: NodeGroup) -> None:
    deadline = time.monotonic() + nodes.timeout_s
    missing = list(range(world))
    while True:
        missing = [r for r in missing if not store.check([f"{_KEY}joined/{r}"])]
        failed = failures(store, nodes)
        if failed:
            raise ModelLoadError(failed[0])
        if not missing:
            return
        if time.monotonic() > deadline:
            absent = sorted({nodes.node_of(r, world) for r in missing})
            names = ", ".join(nodes.describe(n, world) for n in absent)
            raise ModelLoadError(
                f"{names} did not join within {nodes.timeout_s:.0f} s at {nodes.master_addr}:{nodes.master_port}. Start "
                f"`flagdeploy serve ... --nnodes {nodes.nnodes} --node-rank N --master-addr {nodes.master_addr} "
                f"--master-port {nodes.master_port}` there with the same model and layout; if it runs, check that it "
                "reaches this address (firewall, the interface in GLOO_SOCKET_IFNAME; `flagdeploy doctor --nodes`).")
        time.sleep(0.2)


def failures(store: dist.TCPStore, nodes: NodeGroup) -> list[str]:
    """The errors headless nodes posted (a worker that failed to load or exited), as messages."""
    out = []
    for node in range(1, nodes.nnodes):
        key = f"{_KEY}error/{node}"
        if store.check([key]):
            out.append(f"node {node} failed: {store.get(key).decode(errors='replace')}")
    return out


def post_failure(store: dist.TCPStore, node: int, message: str) -> None:
    try:
        store.set(f"{_KEY}error/{node}", message)
    except (RuntimeError, OSError):  # node 0 is gone too: nobody to tell
        pass


# ---- node 0: watching the others ----------------------------------------------------------------------


def _exit_after_grace(message: str) -> None:
    print(f"flagdeploy: {message}; exiting", file=sys.stderr, flush=True)
    time.sleep(EXIT_GRACE_S)
    os._exit(1)


_on_failure: list[Callable[[str], None]] = []


def on_node_failure(handler: Callable[[str], None]) -> None:
    """Run `handler(message)` before node 0 exits because another node failed (the server marks itself
    not ready with the message)."""
    _on_failure.append(handler)


class NodeMonitor:
    """On node 0: a thread that reads the headless nodes' heartbeats and errors from the store; on the
    first silent or failed node, the failure handlers run and the process exits (`_exit_after_grace`)."""

    def __init__(self, nodes: NodeGroup, world: int, exit: Callable[[str], None] = _exit_after_grace):
        self.nodes, self.world, self.exit = nodes, world, exit
        self.store = connect(nodes)  # its own connection: the store client is not shared across threads
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flagdeploy-node-monitor", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        seen: dict[int, tuple[bytes, float]] = {}
        while not self._stop.wait(HEARTBEAT_S / 2):
            message = self._check(seen)
            if message is not None and not self._stop.is_set():
                log.error("%s", message)
                for handler in _on_failure:
                    handler(message)
                self.exit(message)
                return

    def _check(self, seen: dict[int, tuple[bytes, float]]) -> str | None:
        try:
            failed = failures(self.store, self.nodes)
            if failed:
                return failed[0]
            now = time.monotonic()
            for node in range(1, self.nodes.nnodes):
                key = f"{_KEY}alive/{node}"
                value = self.store.get(key) if self.store.check([key]) else b""
                last = seen.get(node)
                if last is None or last[0] != value:
                    seen[node] = (value, now)
                elif now - last[1] > self.nodes.timeout_s:
                    return (f"{self.nodes.describe(node, self.world)} stopped answering {now - last[1]:.0f} s ago "
                            "(its process or machine is gone, or the network between them); the replica cannot "
                            "continue without it")
        except (RuntimeError, OSError) as exc:  # our own store is gone: rank 0 is going down anyway
            return f"the multi-node store stopped answering ({exc})"
        return None


# ---- nodes 1..N-1: headless ---------------------------------------------------------------------------


class Heartbeat:
    """A headless node's pulse in the store, from its start (loading a large shard takes longer than the
    timeout) until it stops; `lost` once node 0's store stops answering."""

    def __init__(self, nodes: NodeGroup):
        self.key = f"{_KEY}alive/{nodes.node_rank}"
        self.store = connect(nodes)  # its own connection (the main thread posts failures on another)
        self.lost: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="flagdeploy-heartbeat", daemon=True).start()

    def _run(self) -> None:
        beats = 0
        while not self._stop.is_set():
            try:
                self.store.set(self.key, str(beats))
            except (RuntimeError, OSError) as exc:
                self.lost = str(exc)
                return
            beats += 1
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
