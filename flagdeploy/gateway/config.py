"""`serve.yaml`: several models behind one endpoint, each on its own engine.

    host: 0.0.0.0
    port: 8000
    models:
      - names: [smollm2, smollm2-135m-instruct]   # a small builtin model on the CPU
        engine: builtin
        args: {max_model_len: 2048, kv_cache_memory: 1GiB}
      - names: [glm-5.3-flash]                   # a large one on vLLM, launched and supervised here
        engine: vllm
        model: zai-org/GLM-5.3-Flash
        chip: h200
        replicas: 2
        args: {tp: 4, max_model_len: 65536, reasoning_parser: glm45}
      - names: [qwen3-8b]                        # engines that already run elsewhere
        engine: upstream
        upstreams: [http://10.0.0.5:8000, http://10.0.0.6:8000]
      - names: [smollm2-pd]                      # a prefill-decode pair of `flagdeploy serve` (or vLLM) instances
        engine: upstream
        upstreams: [http://10.0.0.8:8000]        # the decode instances (--kv-transfer-config ... kv_consumer)
        prefill_upstreams: [http://10.0.0.7:8000]  # the prefill instances (... kv_producer)

`args` are the neutral profile fields (flagdeploy/planner/profile.py) for vllm, vllm-ascend, sglang and
mindie (the planner's emitter turns them into each engine's flags), `flagdeploy serve`'s options by their
underscore names for builtin (flagdeploy/assemble.py: SERVE_FLAGS, whatever `replicas` says), and llama_cpp.server options (n_ctx, n_threads, chat_format, ...) for llama.cpp.

The media settings of a model, `limit_mm_per_prompt` and `allowed_media_domains` (serve's flags of
those names, flagdeploy/media_policy.py), sit beside `args` whatever the engine: the gateway checks
them on every request to the model, and an engine with an equivalent flag is passed them too.

`prefill_upstreams` (engine: upstream only) makes the pool a prefill-decode pair: each chat/completions
request (and each Anthropic or Responses request, turned into a chat one) first goes to a prefill instance
with max_tokens 1 and `kv_transfer_params: {do_remote_decode: true, ...}`, then to a decode replica (one of
`upstreams`) with the kv_transfer_params the prefill instance returned, as vllm-router
--vllm-pd-disaggregation does (gateway/proxy.py; docs/gateway.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flagdeploy.errors import FlagdeployError
from flagdeploy.media_policy import MediaPolicy, parse_domains, parse_limits

Engine = Literal["builtin", "vllm", "vllm-ascend", "sglang", "mindie", "llama.cpp", "upstream"]
PLANNER_ENGINES = ("vllm", "vllm-ascend", "sglang", "mindie")  # launched from flagdeploy.planner.emit
LAUNCHED_ENGINES = PLANNER_ENGINES + ("llama.cpp",)
DEFAULT_STARTUP_TIMEOUT = 1800.0  # a 700B checkpoint on a cold disk takes tens of minutes to load


class ConfigError(FlagdeployError, ValueError):
    """serve.yaml (or the equivalent serve options) cannot be used; the message says what to change."""


class ModelEntry(BaseModel):
    """One model behind the endpoint: the names it answers to, and what serves it."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(default_factory=list, description="the first is the id responses show; "
                             "empty: the model's own name (builtin, launched) or the upstream's (upstream)")
    engine: Engine = "builtin"
    model: str | None = Field(None, description="GGUF file, model directory, hub id or bundled name; for engine "
                              "'upstream', the files of the model it serves (optional: its chat template makes "
                              "counted prompt tokens exact on engines that cannot count a chat themselves)")
    upstreams: list[str] = Field(default_factory=list, description="base URLs of running engines (engine: upstream); "
                                 "with prefill_upstreams, the decode instances")
    prefill_upstreams: list[str] = Field(default_factory=list, description="base URLs of running prefill instances "
                                         "(engine: upstream): each request is prefilled there, then decoded on one "
                                         "of `upstreams` with the KV cache the prefill instance sends")
    replicas: int = Field(1, ge=1, description="engine processes to launch and balance (launched engines; "
                          "builtin: 1 runs in this process, more are launched as `flagdeploy serve` replicas)")
    chip: str | None = Field(None, description="chip catalog id for the planner's flags (vllm, sglang, ...); "
                             "backend for builtin")
    port: int | None = Field(None, description="first port of launched replicas (default: free ports)")
    upstream_model: str | None = Field(None, description="the name the engine serves (default: the first id "
                                       "of its /v1/models)")
    upstream_api_key: str | None = None
    max_model_len: int | None = None
    startup_timeout: float | None = Field(None, gt=0, description="seconds a launched engine may take to "
                                          "become ready (default: the server's)")
    args: dict[str, Any] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list, description="appended to a launched engine's argv")
    env: dict[str, str] = Field(default_factory=dict, description="added to a launched engine's environment")
    command: list[str] | None = Field(None, description="run exactly this argv instead ('{port}' and "
                                      "'{model}' are filled); for an engine version the emitter does not know")
    limit_mm_per_prompt: dict[str, int] | None = Field(None, description="most media items of one request, per "
                                                       "modality: {image: 2, video: 0} or 'image=2,video=0'")
    allowed_media_domains: list[str] | None = Field(None, description="hosts whose http(s) media URLs are "
                                                    "taken; none: data: URLs only")

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _limits(cls, value: Any) -> dict[str, int] | None:
        return parse_limits(value)

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _domains(cls, value: Any) -> list[str] | None:
        return parse_domains(value)

    def media_policy(self) -> MediaPolicy:
        return MediaPolicy.parse(self.limit_mm_per_prompt, self.allowed_media_domains)

    @field_validator("upstreams", "prefill_upstreams")
    @classmethod
    def _urls(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        kind = "prefill upstream" if info.field_name == "prefill_upstreams" else "upstream"
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{kind} {url!r} is not a URL; write it as http://HOST:PORT (without /v1)")
        return [u.rstrip("/").removesuffix("/v1") for u in urls]

    @model_validator(mode="after")
    def _consistent(self) -> "ModelEntry":
        label = self.names[0] if self.names else (self.model or self.engine)
        if self.engine == "upstream" and not self.upstreams:
            raise ValueError(f"model {label!r}: engine 'upstream' needs `upstreams: [http://HOST:PORT, ...]` "
                             "(the engines already running)")
        if self.engine != "upstream" and self.upstreams:
            raise ValueError(f"model {label!r}: `upstreams` is only for engine 'upstream'; engine {self.engine!r} "
                             "is launched here. Use engine: upstream to attach running engines.")
        if self.prefill_upstreams and self.engine != "upstream":
            raise ValueError(f"model {label!r}: `prefill_upstreams` is only for engine 'upstream' (a running "
                             "prefill-decode pair: prefill_upstreams beside the decode instances' `upstreams`)")
        if overlap := set(self.prefill_upstreams) & set(self.upstreams):
            raise ValueError(f"model {label!r}: {', '.join(sorted(overlap))} is in both `upstreams` (decode "
                             "instances) and `prefill_upstreams`; an instance is one or the other")
        if self.engine in PLANNER_ENGINES and not self.model and not self.command:
            raise ValueError(f"model {label!r}: engine {self.engine!r} needs `model` (a hub id or a directory)")
        if self.engine in PLANNER_ENGINES and not self.chip and not self.command:
            raise ValueError(f"model {label!r}: engine {self.engine!r} needs `chip` (a chip catalog id such as "
                             "h200 or ascend910b) so that its flags fit the chip; `flagdeploy ops list` and "
                             "profiles/chips.yaml list them")
        return self


class GatewayConfig(BaseModel):
    """The whole endpoint: where it listens, its key, and its models."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = None
    port: int | None = None
    api_key: str | None = None
    startup_timeout: float = Field(DEFAULT_STARTUP_TIMEOUT, gt=0)
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to an engine before a 503")
    read_timeout: float = Field(600.0, gt=0, description="seconds an engine may stay silent (before its "
                                "answer, or between two streamed chunks) before a 503 / an error event")
    log_dir: str | None = Field(None, description="where launched engines write their logs "
                                "(default: ~/.cache/flagdeploy/logs)")
    models: list[ModelEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "GatewayConfig":
        builtin = [m for m in self.models if m.engine == "builtin" and m.replicas == 1]
        if len(builtin) > 1:
            raise ValueError("at most one model may use engine 'builtin' with one replica (it runs in this process); "
                             "give the others `replicas: 2` or more (launched as their own processes), or serve them "
                             "with a launched engine or `engine: upstream`")
        from flagdeploy.server.names import normalize_model_name

        seen: dict[str, int] = {}
        for i, m in enumerate(self.models):
            for name in m.names:
                key = normalize_model_name(name)
                if key in seen and seen[key] != i:
                    raise ValueError(f"the name {name!r} is given to two models; each name must pick one model")
                seen[key] = i
        return self

    def logs(self) -> Path:
        return Path(self.log_dir).expanduser() if self.log_dir else Path.home() / ".cache" / "flagdeploy" / "logs"


def load_config(path: str | Path) -> GatewayConfig:
    """Read and check serve.yaml; every problem is a ConfigError naming the file and the field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping with a `models:` list (see docs/gateway.md)")
    return parse_config(data, str(path))


def parse_config(data: dict[str, Any], where: str = "serve.yaml") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{loc}: {msg}" if loc else msg)
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None


# ---- what to launch -----------------------------------------------------------------------------
