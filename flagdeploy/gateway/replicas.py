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

import functools
import logging
import os
import signal
import sys
from typing import Any, Callable, Mapping

from flagdeploy.errors import FlagdeployError
from flagdeploy.lifetime import on_parent_exit

from .config import ConfigError, LaunchPlan, ModelConfig

# serve.yaml `args` of a launched builtin replica -> the `flagdeploy serve` option that carries it
SERVE_FLAGS = {
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "kv_cache_memory": "--kv-cache-memory",
    "weight_format": "--weight-format",
    "load_format": "--load-format",
    "default_temperature": "--default-temperature",
    "reasoning_parser": "--reasoning-parser",
    "tool_call_parser": "--tool-call-parser",
    "request_timeout": "--request-timeout",
    "max_waiting": "--max-waiting",
    "max_tokens_policy": "--max-tokens-policy",
    "memory_utilization": "--gpu-memory-utilization",
    "tp": "--tp",
    "ep": "--ep",
    "compile": "--compile",  # a switch: True → --compile, False → --no-compile
    "speculative_config": "--speculative-config",  # JSON (engine/speculative.py)
}
READY_PATH = "/ready"  # the builtin app answers /health and /v1/models while it loads; /ready only once loaded
PARENT_ENV = "FLAGDEPLOY_PARENT_PID"  # set for each replica: the gateway whose end it outlives by a second at most

log = logging.getLogger(__name__)


def builtin_replicas_entry(model: str | None, dp: int, *, chip: str | None = None,
                           served_names: tuple[str, ...] | list[str] = (), **options: Any) -> dict[str, Any]:
    """The serve.yaml model entry (as a dict, for `parse_config`) of `flagdeploy serve --dp K`:
    `options` are serve's engine options by their parameter names (max_model_len, tp, ep, ...);
    None means the replica's own default."""
    if unknown := sorted(set(options) - set(SERVE_FLAGS)):
        raise ConfigError(f"builtin replicas take {sorted(SERVE_FLAGS)}; not {unknown}")
    args = {k: v for k, v in options.items() if v is not None}
    entry: dict[str, Any] = {"names": list(served_names), "engine": "builtin", "model": model, "chip": chip,
                             "replicas": dp, "args": args}
    if "max_model_len" in args:
        entry["max_model_len"] = args["max_model_len"]
    return entry


def builtin_launch_plan(entry: ModelConfig, port: int, replica: int = 0, *,
                        backend: Any = None, environ: Mapping[str, str] | None = None,
                        device_count: Callable[[], int | None] | None = None,
                        cores: int | None = None) -> LaunchPlan:
    """How to start replica `replica` of a builtin `entry` on `port`. `backend`, `environ`,
    `device_count` and `cores` default to this host's (tests pass their own)."""
    args = dict(entry.args)
    if entry.max_model_len:
        args.setdefault("max_model_len", entry.max_model_len)
    label = entry.names[0] if entry.names else (entry.model or "the builtin model")
    if unknown := sorted(set(args) - set(SERVE_FLAGS)):
        raise ConfigError(f"builtin model {label!r} with replicas: {entry.replicas}: unknown args {unknown}; each "
                          f"replica is a `flagdeploy serve`, whose args are {sorted(SERVE_FLAGS)}")
    _check_parsers(args)
    src = _source(entry.model, args.get("load_format", "auto") != "dummy")
    names = entry.names or [src.name]
    argv = [sys.executable, "-m", "flagdeploy", "serve", "--model", str(src.path), "--host", "127.0.0.1",
            "--port", str(port)]
    if entry.chip:
        argv += ["--chip", entry.chip]
    for name in names:
        argv += ["--served-model-name", name]
    for key, value in args.items():
        if isinstance(value, bool):
            argv.append(SERVE_FLAGS[key] if value else SERVE_FLAGS[key].replace("--", "--no-", 1))
        elif value is not None:
            argv += [SERVE_FLAGS[key], str(value)]
    policy = entry.media_policy()  # the gateway checks it too; a replica fetches from the allowed hosts itself
    if policy.limits is not None:
        argv += ["--limit-mm-per-prompt", ",".join(f"{k}={v}" for k, v in policy.limits.items())]
    if policy.domains is not None:
        argv += ["--allowed-media-domains", ",".join(policy.domains)]
    argv += ["--dp", "1"]  # a replica is one engine; only the gateway fans out
    per_replica = _int(args.get("tp", 1), "tp") * _int(args.get("ep", 1), "ep")
    if backend is None:
        backend = replica_backend(entry.chip)
    env, warnings = replica_env(backend, replica, entry.replicas, per_replica, environ=environ,
                                device_count=device_count, cores=cores)
    env[PARENT_ENV] = str(os.getpid())
    env.update(entry.env)
    return LaunchPlan(argv + entry.extra_args, env, warnings=warnings)


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
    cores = cores or _cores()
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (taskset, cgroups' cpusets)
    except AttributeError:
        return os.cpu_count() or 1


def _int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ConfigError(f"builtin args: {name} must be a whole number >= 1, not {value!r}")
    return number


@functools.lru_cache(maxsize=8)
def _source(model: str | None, weights: bool):
    """Resolve (and, for a hub id, download) the model once here, so that K replicas do not race to
    fetch it, and a wrong path fails before anything is launched. Cached: parsing a GGUF header takes
    seconds, and every replica's plan asks for the same model."""
    from flagdeploy.engine.loader import check_source
    from flagdeploy.loaders.source import resolve

    try:
        src = resolve(model, weights=weights)
        check_source(src.path, src.format, weights)
    except FlagdeployError as exc:
        raise ConfigError(f"builtin model {model or '(default)'}: {exc}") from None
    return src


def _check_parsers(args: dict[str, Any]) -> None:
    """A misspelt parser would make every replica exit at start, K times, after the back-off; say it now."""
    from flagdeploy.server.reasoning import get_style

    try:
        get_style(args.get("reasoning_parser") or "none")
    except ValueError as exc:
        raise ConfigError(f"reasoning_parser: {exc}") from None
    if (parser := args.get("tool_call_parser")) and parser != "auto":
        from flagdeploy.server.tools import get_parser

        try:
            get_parser(parser)
        except ValueError as exc:
            raise ConfigError(f"tool_call_parser: {exc}") from None


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
