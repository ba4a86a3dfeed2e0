"""How the gateway starts one replica of a launched model (`launch_plan`): the exact argv, environment and
files of each engine's process.

- `builtin`, one replica: served in the gateway's own process (gateway/app.py), nothing launched;
- `builtin` with `replicas: K` (and `flagdeploy serve --dp K`): K `flagdeploy serve` processes on loopback
  ports, each on its share of the devices and cores (gateway/replicas.py);
- `llama.cpp`: llama-cpp-python's OpenAI server on a GGUF file;
- vllm, vllm-ascend, sglang, mindie: the planner's emitter (the flags `flagdeploy plan --emit` prints);
- `command`: the user's own argv, with {port} and {model} filled in.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Callable, Mapping

from flagdeploy.assemble import SERVE_FLAGS, ServeOptions, checked_source
from flagdeploy.errors import FlagdeployError

from .config import PLANNER_ENGINES, ConfigError, ModelEntry
from .replicas import PARENT_ENV, replica_backend, replica_env



@dataclasses.dataclass
class LaunchPlan:
    """One engine process: exact argv, extra environment, shell setup lines, files to write first."""

    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    setup: list[str] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)


def launch_plan(entry: ModelEntry, port: int, replica: int = 0) -> LaunchPlan:
    """How to start replica `replica` of a launched model so that it listens on `port`."""
    if entry.command:
        fill = {"port": str(port), "model": entry.model or ""}
        return LaunchPlan([a.format(**fill) for a in entry.command] + entry.extra_args, dict(entry.env))
    if entry.engine == "llama.cpp":
        return _llama_cpp(entry, port)
    if entry.engine == "builtin" and entry.replicas > 1:
        return builtin_launch_plan(entry, port, replica)
    if entry.engine in PLANNER_ENGINES:
        return _planned(entry, port, replica)
    raise ConfigError(f"engine {entry.engine!r} is not launched by the gateway")


def _llama_cpp(entry: ModelEntry, port: int) -> LaunchPlan:
    """llama-cpp-python's OpenAI server (`pip install 'llama-cpp-python[server]'`) on a GGUF file."""
    from flagdeploy.checkpoints.source import resolve

    try:
        src = resolve(entry.model)
    except FlagdeployError as exc:
        raise ConfigError(f"llama.cpp model {entry.model!r}: {exc}") from None
    if src.format != "gguf":
        raise ConfigError(f"llama.cpp runs GGUF files; {entry.model!r} resolved to a {src.format} model at "
                          f"{src.path}. Give a .gguf file, or serve it with another engine.")
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(src.path), "--host", "127.0.0.1",
            "--port", str(port)]
    args = dict(entry.args)
    # Its default cuts a running stream short whenever another request waits; behind the gateway,
    # requests queue for the model instead.
    args.setdefault("interrupt_requests", False)
    if entry.max_model_len and "n_ctx" not in args:
        args["n_ctx"] = entry.max_model_len
    for key, value in args.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    # llama_cpp.server has no media limit or domain list: the gateway's check is the only one.
    warnings = [f"llama.cpp (llama_cpp.server) has no equivalent of --{name.replace('_', '-')}: not passed; the "
                f"gateway enforces it on every request" for name in entry.media_policy().profile_fields()]
    return LaunchPlan(argv + entry.extra_args, dict(entry.env), warnings=warnings)


def _planned(entry: ModelEntry, port: int, replica: int) -> LaunchPlan:
    """vLLM / SGLang / MindIE through the planner's emitter, so the flags are the ones `flagdeploy plan
    --emit` prints for the same profile."""
    from flagdeploy.chips import get_chip
    from flagdeploy.planner.emit import emit
    from flagdeploy.planner.profile import Profile

    known = {f.name for f in dataclasses.fields(Profile)}
    args = dict(entry.args)
    if unknown := sorted(set(args) - known):
        raise ConfigError(f"model {entry.names[:1] or entry.model}: unknown args {unknown} for {entry.engine}; "
                          f"args are profile fields: {sorted(known - {'model', 'chip', 'port'})}. Pass engine "
                          f"flags the profile lacks through `extra_args`.")
    if misplaced := sorted(set(args) & {"limit_mm_per_prompt", "allowed_media_domains"}):
        raise ConfigError(f"model {entry.names[:1] or entry.model}: {', '.join(misplaced)} go beside `args`, not in "
                          f"it: the gateway checks them for every engine, and passes them to {entry.engine}")
    args |= entry.media_policy().profile_fields()
    if entry.max_model_len:
        args.setdefault("max_model_len", entry.max_model_len)
    if entry.names:
        args.setdefault("served_model_name", entry.names[0])
    try:
        profile = Profile(model=entry.model or "", chip=entry.chip or "", port=port,
                          **{k: v for k, v in args.items() if k not in ("model", "chip", "port")})
        launch = emit(profile, entry.engine)
        backend = get_chip(profile.chip).backend
    except (FlagdeployError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot launch {entry.engine} for {entry.model}: {exc}") from None
    env = dict(launch.env)
    if entry.replicas > 1:  # replica i takes the next `devices` devices
        devices = ",".join(str(replica * profile.devices + d) for d in range(profile.devices))
        var = {"cuda": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}.get(backend)
        if var:
            env[var] = devices
        else:
            launch.warnings.append(f"replica {replica}: no device-visibility variable known for backend "
                                   f"{backend}; all replicas see every device")
    env.update(entry.env)
    return LaunchPlan(launch.argv + entry.extra_args, env, list(launch.setup), dict(launch.files),
                      list(launch.warnings))


def builtin_launch_plan(entry: ModelEntry, port: int, replica: int = 0, *,
                        backend: Any = None, environ: Mapping[str, str] | None = None,
                        device_count: Callable[[], int | None] | None = None,
                        cores: int | None = None) -> LaunchPlan:
    """How to start replica `replica` of a builtin `entry` on `port`. `backend`, `environ`,
    `device_count` and `cores` default to this host's (tests pass their own)."""
    args = dict(entry.args)
    if entry.max_model_len:
        args.setdefault("max_model_len", entry.max_model_len)
    label = entry.names[0] if entry.names else (entry.model or "the builtin model")
    try:  # what every replica would refuse at its start (K times, after the back-off), refused here once
        options = ServeOptions.from_args(args)
    except FlagdeployError as exc:
        raise ConfigError(f"builtin model {label!r} with replicas: {entry.replicas}: {exc}") from None
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
    per_replica = options.tp * options.ep
    if backend is None:
        backend = replica_backend(entry.chip)
    env, warnings = replica_env(backend, replica, entry.replicas, per_replica, environ=environ,
                                device_count=device_count, cores=cores)
    env[PARENT_ENV] = str(os.getpid())
    env.update(entry.env)
    return LaunchPlan(argv + entry.extra_args, env, warnings=warnings)


@functools.lru_cache(maxsize=8)
def _source(model: str | None, weights: bool):
    """Resolve (and, for a hub id, download) the model once here, so that K replicas do not race to
    fetch it, and a wrong path fails before anything is launched. Cached: parsing a GGUF header takes
    seconds, and every replica's plan asks for the same model."""
    try:
        src = checked_source(model, weights)
    except FlagdeployError as exc:
        raise ConfigError(f"builtin model {model or '(default)'}: {exc}") from None
    return src
