"""Data-parallel replicas of the builtin engine: K `flagdeploy serve` processes behind the gateway.

`flagdeploy serve --dp K` (or `engine: builtin` with `replicas: K` in serve.yaml) serves one endpoint
from K copies of the builtin engine. Each copy is its own process: the engine's op backend and its
device are process-wide, and K engines in one process would share one GIL and one scheduler loop. A
replica is a plain `flagdeploy serve --dp 1` on a loopback port, launched and supervised like any
other engine (restart with back-off, /ready, /metrics) and balanced by the gateway's least-loaded +
prefix-affinity balancer. The gateway checks the API key; replicas run without one, on 127.0.0.1.

Devices: replica i sees devices [i*n, (i+1)*n), n = tp * ep, through the backend's visibility
variable (`Backend.visible_devices_env`: CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES). A list the
user already set in that variable is split instead of 0..N-1, so `CUDA_VISIBLE_DEVICES=4,5,6,7
flagdeploy serve --dp 2` runs on 4,5 and 6,7. Host cores are split too (OMP_NUM_THREADS = cores // K,
at least 1): K torch processes each using every core would slow each other down, which matters most
on the CPU backend, where the cores are the device.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable, Mapping

from flagdeploy.cpu_threads import cores as cpu_cores
from flagdeploy.errors import FlagdeployError
from flagdeploy.lifetime import on_parent_exit

from .config import ConfigError

READY_PATH = "/ready"  # the builtin app answers /health and /v1/models while it loads; /ready only once loaded
PARENT_ENV = "FLAGDEPLOY_PARENT_PID"  # set for each replica: the gateway whose end it outlives by a second at most

log = logging.getLogger(__name__)


def exit_with_parent(environ: Mapping[str, str] | None = None, interval: float = 1.0) -> None:
    """In a replica (PARENT_ENV set): stop once the gateway that launched it is gone. A gateway that is
    killed outright (SIGKILL, the OOM killer) cannot stop its replicas, which run in their own process
    groups; without this they would hold their devices and ports until someone finds them. The replica
    sends itself SIGTERM, so the server shuts down as on any stop (engine and parallel ranks included)."""
    pid = (os.environ if environ is None else environ).get(PARENT_ENV)
    if not pid:
        return
    parent = int(pid)

    def stop() -> None:
        log.warning("the gateway (pid %d) is gone: stopping this replica", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    on_parent_exit(parent, stop, interval)


def replica_env(backend: Any, replica: int, replicas: int, per_replica: int, *,
                environ: Mapping[str, str] | None = None, device_count: Callable[[], int | None] | None = None,
                cores: int | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, warnings) for replica `replica` of `replicas`, each of `per_replica` devices:
    its slice of the devices through the backend's visibility variable, and its share of the cores."""
    environ = os.environ if environ is None else environ
    cores = cores or cpu_cores()
    env = {"OMP_NUM_THREADS": str(max(1, cores // replicas))}
    warnings: list[str] = []
    var = getattr(backend, "visible_devices_env", None)
    if var is None:
        if getattr(backend, "device_type", "cpu") != "cpu":
            warnings.append(f"the {backend.name} backend declares no device-visibility variable "
                            f"(Backend.visible_devices_env); every replica sees every device")
        return env, warnings
    need = replicas * per_replica
    given = environ.get(var, "").strip()
    if given:
        devices = [d.strip() for d in given.split(",") if d.strip()]
        where = f"{var}={given} lists {len(devices)}"
    else:
        count = (device_count or (lambda: _device_count(backend)))()
        devices = [str(i) for i in range(count)] if count is not None else None
        where = f"the {backend.name} backend sees {count}"
    if devices is not None and len(devices) < need:
        raise ConfigError(f"{replicas} replicas of {per_replica} device(s) each (dp x tp x ep) need {need} "
                          f"{backend.name} devices; {where}. Lower --dp (replicas), --tp or --ep, or make more "
                          f"devices visible through {var}.")
    ids = devices if devices is not None else [str(i) for i in range(need)]
    env[var] = ",".join(ids[replica * per_replica:(replica + 1) * per_replica])
    return env, warnings


def replica_backend(chip: str | None) -> Any:
    """The op backend the replicas will run (`--chip`, else the one detected here)."""
    from flagdeploy import ops

    try:
        return ops.get_backend(chip) if chip else ops.detect_backend()
    except FlagdeployError as exc:
        raise ConfigError(str(exc)) from None


def _device_count(backend: Any) -> int | None:
    """Devices the backend's torch module sees (torch.cuda, torch.npu); None when it cannot tell."""
    try:
        import torch

        if backend.device_type == "npu":
            import torch_npu  # noqa: F401 - registers torch.npu
        return int(getattr(torch, backend.device_type).device_count())
    except Exception:  # noqa: BLE001 - unknown: launch, and let the replica say what is missing
        return None


# ---- /metrics: the replicas' own metrics through the gateway -------------------------------------


async def replica_metrics(client: Any, model: str, urls: list[str], timeout: float = 2.0) -> str:
    """The /metrics of each replica in `urls`, merged into one exposition with `model` and `replica`
    labels on every sample, so that one scrape of the endpoint shows every engine's counters (tokens,
    queue, KV cache) without knowing the replicas' loopback ports. A replica that does not answer in
    `timeout` s is left out of this scrape (its flagdeploy_upstream_ready line says why)."""
    import asyncio

    async def one(url: str) -> tuple[str, str] | None:
        try:
            r = await client.get(f"{url}/metrics", timeout=timeout)
        except Exception:  # noqa: BLE001 - a scrape must not fail because one replica is down
            return None
        return (url, r.text) if r.status_code == 200 else None

    found = [x for x in await asyncio.gather(*(one(u) for u in urls)) if x is not None]
    return merge_expositions(model, found)


def merge_expositions(model: str, texts: list[tuple[str, str]]) -> str:
    """Prometheus text expositions of several replicas as one: each family's HELP/TYPE once, then its
    samples from every replica, labelled (the format wants a family's lines together)."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for url, text in texts:
        extra = f'model="{_escape(model)}",replica="{_escape(url)}"'
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    meta = families.setdefault(family, [])
                    if len(meta) < 2 and line not in meta:
                        meta.append(line)
                    samples.setdefault(family, [])
                continue
            brace, space = line.find("{"), line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                close = line.find("}", brace)
                inner = line[brace + 1:close]
                labelled = f"{line[:brace]}{{{extra}{',' + inner if inner else ''}}}{line[close + 1:]}"
            else:
                labelled = f"{line[:space]}{{{extra}}}{line[space:]}" if space != -1 else line
            samples.setdefault(family, []).append(labelled)
    out: list[str] = []
    for family in samples:
        out += families.get(family, []) + samples[family]
    return "\n".join(out) + ("\n" if out else "")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
