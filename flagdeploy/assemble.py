"""The builtin server, assembled once: `ServeOptions` (what it is built from, in one vocabulary: `SERVE_FLAGS`)
and the one path from them to a serving process, taken by every way the builtin engine is served:

- `flagdeploy serve` (cli.py: the click surface only) builds ServeOptions from its flags, and serving.py
  (which server the command starts) merges a --profile into them, checks them (`checked_source`,
  `check_split`) and serves them (`engine_loader`, `run_server`);
- `flagdeploy serve --dp K` and a serve.yaml `engine: builtin` entry with `replicas: K` launch K
  `flagdeploy serve` processes (gateway/launch.py), whose serve.yaml entry is written from ServeOptions
  (`replicas_entry`, `args`: the inverse of `from_args`) and read back and checked here first (`from_args`,
  `checked_source`);
- a serve.yaml `engine: builtin` entry with `replicas: 1` runs in the gateway's process (gateway/app.py:
  `from_args`, then `builtin_app`);
- `flagdeploy serve --engine onnxruntime` (serving.py) serves the ONNX engine through the same app and the
  same start-up (`run_server`).

From here a request goes to server/app.py's create_app (the routes, one module per protocol) and the engine
that `load` builds (engine/replica.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from flagdeploy.engine.kv_transfer import KvTransferConfig
from flagdeploy.engine.speculative import SpeculativeConfig
from flagdeploy.errors import ConfigError, FlagdeployError
from flagdeploy.media_policy import MediaPolicy
from flagdeploy.server.app import check_parsers
from flagdeploy.units import parse_bytes

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine, EngineConfig
    from flagdeploy.checkpoints.source import ModelSource

# The one vocabulary of a builtin model's options: serve.yaml `args` of an `engine: builtin` entry (whatever its
# `replicas`) by name -> the `flagdeploy serve` flag that carries it (how a launched replica is passed it).
SERVE_FLAGS = {
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "kv_cache_memory": "--kv-cache-memory",
    "weight_format": "--weight-format",
    "q8_activations": "--q8-activations",  # a switch, as compile
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
    "num_scheduler_steps": "--num-scheduler-steps",
    "speculative_config": "--speculative-config",  # JSON (engine/speculative.py)
    "kv_transfer_config": "--kv-transfer-config",  # vLLM's JSON (engine/kv_transfer.py)
}


@dataclass
class ServeOptions:
    """Everything a builtin server is built from, typed, by the names of SERVE_FLAGS (the CLI's options
    without their dashes). `kv_cache_memory` is in bytes; `max_waiting` None or < 0 means unbounded."""

    model: str | None = None
    chip: str | None = None
    served_names: tuple[str, ...] = ()
    # the engine
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int = 2 << 30
    memory_utilization: float = 0.9
    weight_format: str = "auto"
    q8_activations: bool = False
    load_format: str = "auto"
    tp: int = 1
    ep: int = 1
    compile: bool | None = None  # None: in the background (serve's default)
    num_scheduler_steps: int | None = None  # None: the backend's (tune.yaml's `serve` on the CPU)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KvTransferConfig | None = None  # prefill-decode disaggregation: this instance's role
    # the server
    api_key: str | None = None
    default_temperature: float = 0.0
    reasoning_parser: str | None = "none"
    tool_call_parser: str = "auto"
    request_timeout: float | None = None
    max_waiting: int | None = 64
    max_tokens_policy: str = "auto"
    media: MediaPolicy = field(default_factory=MediaPolicy)

    @property
    def weights(self) -> bool:
        """Whether the checkpoint's weights are read (not --load-format dummy)."""
        return self.load_format != "dummy"

    def engine_config(self) -> "EngineConfig":
        from flagdeploy.engine import EngineConfig

        return EngineConfig(max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, block_size=self.block_size,
                            kv_cache_memory=self.kv_cache_memory, weight_format=self.weight_format,
                            q8_activations=self.q8_activations, load_format=self.load_format, tp=self.tp, ep=self.ep,
                            compile=self.compile, num_scheduler_steps=self.num_scheduler_steps,
                            speculative=self.speculative, kv_transfer=self.kv_transfer)

    @classmethod
    def from_args(cls, args: dict[str, Any], **given: Any) -> "ServeOptions":
        """A serve.yaml entry's `args` (SERVE_FLAGS' names; kv_cache_memory a size like "2GiB" or bytes,
        speculative_config vLLM's JSON or mapping) over `given` (model, chip, served_names, api_key, media,
        and defaults the caller's path keeps). Unknown names and bad values raise ConfigError."""
        if unknown := sorted(set(args) - set(SERVE_FLAGS)):
            raise ConfigError(f"unknown args {unknown}; a builtin model's args are {sorted(SERVE_FLAGS)}")
        values = dict(given)
        for name, value in args.items():
            if value is None:
                continue
            try:
                values[_FIELD.get(name, name)] = _convert(name, value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name}: {exc}") from None
        options = cls(**values)
        check_parsers(options.reasoning_parser, options.tool_call_parser)  # server/app.py
        return options

    def args(self) -> dict[str, Any]:
        """The inverse of `from_args`: these options as a serve.yaml entry's `args`, by SERVE_FLAGS' names
        (what is unset, None, is left out: the replica's own default)."""
        values = {name: getattr(self, name) for name in SERVE_FLAGS if name not in _FIELD}
        values["speculative_config"] = self.speculative.as_json() if self.speculative.enabled else None
        values["kv_transfer_config"] = json.dumps(dataclasses.asdict(self.kv_transfer)) if self.kv_transfer else None
        return {name: value for name, value in values.items() if value is not None}

    def replicas_entry(self, replicas: int) -> dict[str, Any]:
        """The serve.yaml model entry (a dict, for gateway.parse_config) serving these options as `replicas`
        `flagdeploy serve` processes behind the gateway: `flagdeploy serve --dp K`."""
        return {"names": list(self.served_names), "engine": "builtin", "model": self.model, "chip": self.chip,
                "replicas": replicas, "max_model_len": self.max_model_len, "args": self.args(),
                **self.media.profile_fields()}  # the gateway checks the media policy and passes it to every replica


_FIELD = {"speculative_config": "speculative", "kv_transfer_config": "kv_transfer"}  # arg name -> field name
_TYPES: dict[str, type] = {f.name: f.type for f in dataclasses.fields(ServeOptions)}  # type: ignore[misc]


def _convert(name: str, value: Any) -> Any:
    if name == "kv_cache_memory":
        return parse_bytes(value) if isinstance(value, str) else int(value)
    if name == "speculative_config":
        text = value if isinstance(value, str) else json.dumps(value)
        return SpeculativeConfig.parse(None, None, text)
    if name == "kv_transfer_config":
        return KvTransferConfig.parse(value if isinstance(value, str) else json.dumps(value))
    if name in ("compile", "q8_activations"):
        if not isinstance(value, bool):
            raise TypeError(f"a switch (true or false), not {value!r}")
        return value
    kind = _TYPES[name]
    if "int" in kind:
        number = int(value)
        if str(number) != str(value).strip() or (number < 1 and name != "max_waiting"):
            raise ValueError(f"must be a whole number >= 1, not {value!r}")
        return number
    if "float" in kind:
        return float(value)
    return str(value)


def checked_source(model: str | None, weights: bool = True) -> "ModelSource":
    """The model resolved (downloaded if it is a hub id) and its header or config read: a wrong path or an
    unsupported model fails here, before a server or a replica starts."""
    from flagdeploy.engine.model_loading import check_source
    from flagdeploy.checkpoints.source import resolve

    src = resolve(model, weights=weights)
    check_source(src.path, src.format, weights)
    return src


def check_split(src: "ModelSource", options: ServeOptions) -> None:
    """Refuse a --tp x --ep split the model cannot take before any rank starts."""
    if options.tp * options.ep > 1:
        from flagdeploy.engine.model_loading import check_split as check

        check(src.path, src.format, options.engine_config())


def builtin_app(options: ServeOptions, load: Callable[[], "AsyncEngine"], names: list[str]):
    """The server app (server/app.py) for `options`, its engine built by `load` on a background thread."""
    from flagdeploy.server import create_app
    from flagdeploy.server.media import MediaSettings

    max_waiting = options.max_waiting
    return create_app(load, names, api_key=options.api_key, default_temperature=options.default_temperature,
                      reasoning_parser=options.reasoning_parser,
                      max_waiting=None if max_waiting is None or max_waiting < 0 else max_waiting,
                      tool_call_parser=options.tool_call_parser, request_timeout=options.request_timeout,
                      max_tokens_policy=options.max_tokens_policy,  # type: ignore[arg-type]
                      media=MediaSettings(options.media))


def engine_loader(options: ServeOptions, src: "ModelSource", *, progress: bool = False, nodes=None,
                  config: "EngineConfig | None" = None) -> Callable[[], "AsyncEngine"]:
    """What builds the builtin engine for `options` (engine/replica.py), to run on the app's loading thread."""
    from flagdeploy.cpu_threads import threads_for_server
    from flagdeploy.engine import AsyncEngine
    from flagdeploy.engine.replica import build_llm_engine

    config = config or options.engine_config()

    def load() -> AsyncEngine:
        threads_for_server(options.chip)
        return AsyncEngine(build_llm_engine(src.path, src.format, config, chip=options.chip, progress=progress,
                                            nodes=nodes))

    return load


def run_server(options: ServeOptions, load: Callable[[], "AsyncEngine"], names: list[str], *, host: str, port: int,
               log_level: str, loading: str, ready: Callable[["AsyncEngine"], str],
               configure: Callable[[Any], None] | None = None) -> None:
    """Serve `options`' app in this process until it stops: `loading` is printed before the engine loads,
    `ready(engine)` once it has; a load that fails stops the server and exits 1 with its message.
    `configure(app)` runs before the server starts (multi-node: mark the app failed when a node fails)."""
    from flagdeploy.server import make_server

    failure: list[BaseException] = []

    def load_or_stop() -> "AsyncEngine":
        try:
            engine = load()
        except BaseException as exc:
            failure.append(exc)
            server.should_exit = True
            raise
        print(ready(engine), file=sys.stderr, flush=True)
        return engine

    app = builtin_app(options, load_or_stop, names)
    if configure is not None:
        configure(app)
    server = make_server(app, host, port, log_level)
    print(loading, file=sys.stderr, flush=True)
    server.run()
    if failure:
        exc = failure[0]
        print(f"error: {exc if isinstance(exc, (FlagdeployError, ValueError)) else repr(exc)}", file=sys.stderr,
              flush=True)
        sys.exit(1)
