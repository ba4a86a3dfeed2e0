"""Engines behind the gateway, and what the gateway knows about each: ready or not, and why.

Two kinds of upstream, one interface (`Upstream`: url, state, detail, the served model id):

- `Supervisor` launches one engine process (vLLM, SGLang, MindIE from the planner's launch; llama.cpp),
  writes its output to a log file, polls readiness (GET /health, then /v1/models, until both answer
  200) within a startup deadline, watches it afterwards, and restarts it with exponential back-off
  when it exits or stops answering. Large models take tens of minutes to load, hence the long
  default deadline; a process that dies while loading is restarted at once (back-off aside), without
  waiting for the deadline.
- `AttachedUpstream` is an engine someone else runs (`--upstream URL`): only probed, never started.

Everything runs as asyncio tasks on the server's own loop: no threads, and the state the gateway
reads is always current.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    STARTING = "starting"  # launched (or first probe pending), not answering yet
    READY = "ready"
    RESTARTING = "restarting"  # it exited or stopped answering; back-off, relaunch, load again
    DOWN = "down"  # an attached engine that does not answer (it is not ours to restart)
    FAILED = "failed"  # given up: an operator must look at the log
    STOPPED = "stopped"


@dataclass
class Probe:
    ok: bool
    detail: str = ""
    models: list[dict[str, Any]] = field(default_factory=list)


async def probe(client: httpx.AsyncClient, url: str, api_key: str | None = None, timeout: float = 5.0,
                full: bool = True, ready_path: str | None = None) -> Probe:
    """Is the engine at `url` serving? GET /health (engines without it answer 404: skipped), then
    GET /v1/models, which also tells the served model id and, on vLLM, max_model_len.

    `full=False` is the liveness check of an engine already ready: /health only. /v1/models is not
    polled then, because llama-cpp-python serves it under the model lock, so it waits behind every
    generation and, with its default `interrupt_requests`, a waiting request cuts the running
    stream short.

    `ready_path` (the builtin engine's /ready) must also answer 200 for a full probe: engines whose
    /health and /v1/models answer while the weights still load say there when they are done."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = await client.get(f"{url}/health", headers=headers, timeout=timeout)
        if health.status_code not in (200, 404, 405):
            return Probe(False, f"/health answered {health.status_code}")
        if not full:
            return Probe(True)
        if ready_path:
            ready = await client.get(f"{url}{ready_path}", headers=headers, timeout=timeout)
            if ready.status_code != 200:
                return Probe(False, f"{ready_path} answered {ready.status_code}: {_short(ready.text)}")
        models = await client.get(f"{url}/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        return Probe(False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if models.status_code != 200:
        return Probe(False, f"/v1/models answered {models.status_code}")
    try:
        data = models.json().get("data") or []
    except (ValueError, AttributeError):
        return Probe(False, "/v1/models did not answer a JSON model list")
    return Probe(True, "", [m for m in data if isinstance(m, dict)])


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class Upstream:
    """One engine endpoint as the gateway sees it."""

    def __init__(self, url: str, api_key: str | None = None, upstream_model: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.state = State.STARTING
        self.detail = "not probed yet"
        self.configured_model = upstream_model
        self.models: list[dict[str, Any]] = []
        # Learned from its answers (normalize.says_which_stop): it reports which stop sequence hit.
        self.says_which_stop = False
        self.since = time.monotonic()
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def model_id(self) -> str | None:
        """The name to send upstream: configured, else the engine's first served id."""
        if self.configured_model:
            return self.configured_model
        return self.models[0].get("id") if self.models else None

    @property
    def max_model_len(self) -> int | None:
        for card in self.models:
            if card.get("id") == self.model_id and isinstance(card.get("max_model_len"), int):
                return card["max_model_len"]
        return None

    def _set(self, state: State, detail: str = "") -> None:
        if state is not self.state:
            log.log(logging.WARNING if state in (State.DOWN, State.FAILED, State.RESTARTING) else logging.INFO,
                    "engine %s: %s -> %s%s", self.url, self.state.value, state.value, f" ({detail})" if detail else "")
            self.since = time.monotonic()
        self.state = state
        self.detail = detail

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state.value, "detail": self.detail or None,
                "for_s": round(time.monotonic() - self.since, 1)}

    def report_failure(self, reason: str) -> None:
        """The proxy could not reach the engine: stop routing to it until a probe says otherwise."""

    async def start(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._task = asyncio.create_task(self._run(), name=f"upstream {self.url}")

    async def _run(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        self._set(State.STOPPED, "server shutting down")


class AttachedUpstream(Upstream):
    """An engine that already runs elsewhere: probed every `interval` s (every second while down)."""

    def __init__(self, url: str, api_key: str | None = None, upstream_model: str | None = None,
                 interval: float = 5.0):
        super().__init__(url, api_key, upstream_model)
        self.interval = interval
        self._wake = asyncio.Event()

    def report_failure(self, reason: str) -> None:
        if self.state is State.READY:
            self._set(State.DOWN, reason)
            self._wake.set()

    async def _run(self) -> None:
        assert self._client is not None
        while True:
            result = await probe(self._client, self.url, self.api_key, full=not self.ready)
            if result.ok:
                self.models = result.models or self.models
                self._set(State.READY)
            else:
                self._set(State.DOWN, result.detail)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval if result.ok else min(1.0, self.interval))
            except asyncio.TimeoutError:
                pass


@dataclass
class Backoff:
    initial: float = 1.0
    maximum: float = 60.0
    factor: float = 2.0
    current: float = 0.0

    def next(self) -> float:
        self.current = self.initial if self.current == 0 else min(self.current * self.factor, self.maximum)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


class Supervisor(Upstream):
    """One engine process we launch, keep alive and stop.

    `argv`/`env` are the exact launch (from the planner's emit or the llama.cpp command); `setup`
    shell lines (sourcing CANN scripts) run first in a bash that then execs argv; `files` are written
    into `workdir` before each launch. The process gets its own session, so stopping it also stops
    the workers it forked (vLLM, SGLang and MindIE run one process per device).
    """

    def __init__(self, name: str, url: str, argv: list[str], *, env: dict[str, str] | None = None,
                 setup: list[str] | None = None, files: dict[str, str] | None = None,
                 workdir: str | Path | None = None, log_path: str | Path,
                 startup_timeout: float = 1800.0, poll_interval: float = 1.0, health_interval: float = 5.0,
                 unhealthy_after: int = 3, backoff: Backoff | None = None, max_failed_starts: int = 5,
                 stop_timeout: float = 15.0, api_key: str | None = None, upstream_model: str | None = None,
                 ready_path: str | None = None):
        super().__init__(url, api_key, upstream_model)
        self.name = name
        self.ready_path = ready_path
        self.argv = list(argv)
        self.env = dict(env or {})
        self.setup = list(setup or [])
        self.files = dict(files or {})
        self.log_path = Path(log_path)
        self.workdir = Path(workdir) if workdir else self.log_path.parent
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.health_interval = health_interval
        self.unhealthy_after = unhealthy_after
        self.backoff = backoff or Backoff()
        self.max_failed_starts = max_failed_starts
        self.stop_timeout = stop_timeout
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._wake = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    def status(self) -> dict[str, Any]:
        return super().status() | {"pid": self.pid, "restarts": self.restarts, "log": str(self.log_path)}

    def report_failure(self, reason: str) -> None:
        self._wake.set()  # check now rather than at the next health interval

    # ---- the loop ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        failed_starts = 0
        while True:
            proc = await self._spawn()
            outcome = await self._until_ready(proc)
            if outcome == "ready":
                failed_starts = 0
                self.backoff.reset()
                self._set(State.READY)
                outcome = await self._watch(proc)
            else:
                failed_starts += 1
            await self._terminate(proc)
            if outcome == "timeout":
                self._set(State.FAILED, f"not ready within the startup deadline of {self.startup_timeout:.0f} s; "
                                        f"see {self.log_path}, then raise --startup-timeout or fix the launch")
                return
            if failed_starts >= self.max_failed_starts:
                self._set(State.FAILED, f"{outcome} {failed_starts} times in a row before becoming ready; "
                                        f"see {self.log_path}")
                return
            delay = self.backoff.next()
            self.restarts += 1
            self._set(State.RESTARTING, f"{outcome} (exit code {proc.returncode}); relaunching in {delay:.1f} s")
            await asyncio.sleep(delay)

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for rel, content in self.files.items():
            (self.workdir / rel).write_text(content)
        argv = self.argv
        if self.setup:
            argv = ["bash", "-c", "; ".join(self.setup) + "; exec " + shlex.join(self.argv)]
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: {shlex.join(argv)}\n".encode())
            out.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                env=os.environ | self.env, cwd=self.workdir, start_new_session=True)
        self.process = proc
        self._set(State.STARTING if self.restarts == 0 else State.RESTARTING,
                  f"pid {proc.pid} loading; log {self.log_path}")
        log.info("engine %s: launched pid %d: %s (log %s)", self.name, proc.pid, shlex.join(argv), self.log_path)
        return proc

    async def _until_ready(self, proc: asyncio.subprocess.Process) -> str:
        """'ready', 'exited' or 'timeout'; a process exit is noticed at once, not at the next poll."""
        assert self._client is not None
        deadline = time.monotonic() + self.startup_timeout
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                if exited.done():
                    return "exited"
                if time.monotonic() > deadline:
                    return "timeout"
                result = await probe(self._client, self.url, self.api_key, timeout=max(self.poll_interval, 2.0),
                                     ready_path=self.ready_path)
                if result.ok and proc.returncode is None:
                    self.models = result.models
                    return "ready"
                await asyncio.wait({exited}, timeout=self.poll_interval)
        finally:
            exited.cancel()

    async def _watch(self, proc: asyncio.subprocess.Process) -> str:
        """Wait until the ready process exits ('exited') or fails `unhealthy_after` health checks in a
        row ('stopped answering')."""
        assert self._client is not None
        misses = 0
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                self._wake.clear()
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({exited, woken}, timeout=self.health_interval, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if exited.done():
                    return "exited"
                result = await probe(self._client, self.url, self.api_key, timeout=max(self.health_interval, 2.0),
                                     full=False)
                if result.ok:
                    misses = 0
                    continue
                misses += 1
                log.warning("engine %s: health check %d/%d failed: %s", self.name, misses, self.unhealthy_after,
                            result.detail)
                if misses >= self.unhealthy_after:
                    return "stopped answering"
        finally:
            exited.cancel()

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM to the process group, SIGKILL after `stop_timeout`; also reaps what an exited
        leader left behind."""
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.stop_timeout)
            except asyncio.TimeoutError:
                log.warning("engine %s: pid %d ignored SIGTERM for %.0f s; killing it", self.name, proc.pid,
                            self.stop_timeout)
        _signal_group(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()

    async def stop(self) -> None:
        await super().stop()
        if self.process is not None:
            # Shielded: this runs while the server shuts down, and the engine must not outlive it.
            await asyncio.shield(self._terminate(self.process))
        self._set(State.STOPPED, "server shutting down")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
