"""One endpoint for every model: a pure-ASGI wrapper around the builtin app and the upstream pools.

The wrapper reads the body of each model route, looks at `model` (normalised like the builtin app:
case-insensitive, Claude Code's `[1m]` suffix stripped), and either proxies the request to that
model's upstream pool or replays it, byte for byte, to the builtin app made by
`flagdeploy.server.create_app`. That app is not changed and does not know it is wrapped; with no
builtin model configured, the wrapper runs alone.

/health is the process (always 200); /ready is every model (503 with Retry-After while any engine is
not ready, each model's state in the body); /v1/models lists builtin and upstream models together;
/v1/messages/count_tokens of an upstream model is counted by its engine (gateway/tokens.py).

Media parts (images, video, audio) go to the engine as the client sent them, or translated to OpenAI
parts (translate.py), once the model's media policy allows them (flagdeploy/media_policy.py: data:
URLs, http(s) URLs of the allowed hosts, at most the limit per modality).
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from flagdeploy.errors import FlagdeployError
from flagdeploy.media_policy import MediaPolicy
from flagdeploy.net import free_port
from flagdeploy.server import errors
from flagdeploy.server.auth import presented_key
from flagdeploy.server.names import normalize_model_name, strip_context_suffix
from flagdeploy.server.errors import APIError
from flagdeploy.server.protocol import ModelCard, ModelList, now
from flagdeploy.server.validate import ANTHROPIC, OPENAI, check_content_encoding, parse_body

from .balancer import Balancer, Replica
from .config import ConfigError, ModelEntry, GatewayConfig
from .launch import launch_plan
from .normalize import RETRY_AFTER_S, prepare_request, upstream_unavailable
from .proxy import Proxy, Timeouts
from .send import send_error, send_json
from .supervisor import AttachedUpstream, State, Supervisor, Upstream
from .tokens import TokenCounter, count_on_builtin
from .translate import AnthropicDialect, dialect_for

log = logging.getLogger(__name__)

PROXIED = ("/v1/chat/completions", "/v1/completions")
TRANSLATED = ("/v1/responses", "/v1/messages")  # served through the upstream's chat completions
COUNT_TOKENS = "/v1/messages/count_tokens"
_SEVERITY = [State.FAILED, State.DOWN, State.RESTARTING, State.STARTING, State.STOPPED]


# ---- one upstream model --------------------------------------------------------------------------


class ModelPool:
    """The replicas of one upstream model, the names it answers to, and its state. `model`: the
    model's files (GGUF or directory), read for its chat template when its engine cannot count
    prompt tokens by itself. `media`: what media a request to it may carry. `prefill`: the prefill
    instances of a prefill-decode pair (the `upstreams` are then its decode instances; proxy.py runs
    the two steps), balanced among themselves."""

    def __init__(self, names: list[str], upstreams: list[Upstream], engine: str = "upstream",
                 max_model_len: int | None = None, slack: int = 2, model: str | None = None,
                 media: MediaPolicy | None = None, prefill: list[Upstream] | None = None):
        self.configured_names = list(names)
        self.media = media or MediaPolicy()
        self.upstreams = upstreams
        self.prefill = list(prefill or [])
        self.engine = engine
        self._max_model_len = max_model_len
        self.balancer = Balancer([u.url for u in upstreams], slack=slack)
        self.prefill_balancer = Balancer([u.url for u in self.prefill], slack=slack) if self.prefill else None
        self.counter = TokenCounter(model)
        self._by_url = {u.url: u for u in upstreams}
        self._prefill_by_url = {u.url: u for u in self.prefill}

    @property
    def names(self) -> list[str]:
        """Configured names, else the ids the engines serve (known once one answered)."""
        if self.configured_names:
            return self.configured_names
        seen: list[str] = []
        for upstream in self.upstreams + self.prefill:
            seen += [m["id"] for m in upstream.models if isinstance(m.get("id"), str) and m["id"] not in seen]
        return seen

    @property
    def name(self) -> str:
        names = self.names
        return names[0] if names else self.upstreams[0].url

    def answers(self, key: str) -> bool:
        return any(normalize_model_name(n) == key for n in self.names)

    @property
    def ready(self) -> bool:
        """Every decode replica, and (for a prefill-decode pair) at least one prefill instance."""
        return all(u.ready for u in self.upstreams) and (not self.prefill or any(u.ready for u in self.prefill))

    @property
    def all_upstreams(self) -> list[Upstream]:
        return self.upstreams + self.prefill

    async def count_tokens(self, client: httpx.AsyncClient, upstream: Upstream, chat: dict[str, Any],
                           request: dict[str, Any] | None = None) -> int:
        """The prompt tokens of a request on `upstream`: flagdeploy's own replicas count the client's
        Anthropic `request` themselves; other engines count the translated `chat` (gateway/tokens.py)."""
        if self.engine == "builtin" and request is not None:
            return await count_on_builtin(client, upstream, request)
        return await self.counter.count(client, upstream, chat)

    @property
    def says_which_stop(self) -> bool:
        """Its engine reports which stop sequence ended an answer (learned from its answers)."""
        return any(u.says_which_stop for u in self.upstreams)

    @property
    def max_model_len(self) -> int | None:
        if self._max_model_len:
            return self._max_model_len
        return next((u.max_model_len for u in self.upstreams + self.prefill if u.max_model_len), None)

    def pick(self, key: str | None, exclude: set[str] = frozenset()) -> tuple[Replica, Upstream] | None:
        ready = {u.url for u in self.upstreams if u.ready and u.url not in exclude}
        replica = self.balancer.pick(key, ready)
        return None if replica is None else (replica, self._by_url[replica.url])

    def pick_prefill(self, key: str | None, exclude: set[str] = frozenset()) -> tuple[Replica, Upstream] | None:
        """A ready prefill instance (a pair's first step), balanced like the decode replicas."""
        assert self.prefill_balancer is not None, "not a prefill-decode pool"
        ready = {u.url for u in self.prefill if u.ready and u.url not in exclude}
        replica = self.prefill_balancer.pick(key, ready)
        return None if replica is None else (replica, self._prefill_by_url[replica.url])

    def state(self) -> str:
        states = [u.state for u in self.upstreams]
        if self.prefill and not any(u.ready for u in self.prefill):  # no first step: nothing can be served
            states = [u.state for u in self.prefill]
        elif self.prefill:
            states += [u.state for u in self.prefill]
        if all(s is State.READY for s in states):
            return "ready"
        if any(s is State.READY for s in states):
            return "degraded"
        return next(s for s in _SEVERITY if s in states).value

    def unavailable(self) -> APIError:
        """The 503 for a request that finds no ready replica."""
        if all(u.state is State.FAILED for u in self.upstreams):
            # No Retry-After: retrying cannot help until an operator fixes the engine.
            detail = "; ".join(u.detail for u in self.upstreams)
            return APIError(503, f"The engine serving `{self.name}` failed and was not restarted: {detail}",
                            type="service_unavailable_error", code="upstream_failed")
        detail = "; ".join(f"{u.state.value}: {u.detail}" if u.detail else u.state.value for u in self.upstreams)
        return upstream_unavailable(self.name, detail, RETRY_AFTER_S)

    def unavailable_prefill(self) -> APIError:
        """The 503 for a request of a prefill-decode pair that finds no ready prefill instance."""
        detail = "; ".join(f"{u.url} {u.state.value}" + (f": {u.detail}" if u.detail else "") for u in self.prefill)
        return upstream_unavailable(self.name, f"no prefill instance is ready ({detail})", RETRY_AFTER_S)

    def counters(self) -> list[tuple[str | None, Upstream, Replica]]:
        """(role, upstream, its balancer entry) of every instance; role None outside a prefill-decode pair."""
        out: list[tuple[str | None, Upstream, Replica]] = []
        for role, upstreams, balancer in (("decode" if self.prefill else None, self.upstreams, self.balancer),
                                          ("prefill", self.prefill, self.prefill_balancer)):
            for u in upstreams:
                out.append((role, u, next(r for r in balancer.replicas if r.url == u.url)))
        return out

    def status(self) -> dict[str, Any]:
        replicas: list[dict[str, Any]] = []
        prefill: list[dict[str, Any]] = []
        for role, u, r in self.counters():
            (prefill if role == "prefill" else replicas).append(
                u.status() | {"outstanding": r.outstanding, "served": r.served})
        return {"state": self.state(), "engine": self.engine, "replicas": replicas} | (
            {"prefill": prefill} if self.prefill else {})

    async def start(self, proxy: Proxy) -> None:
        for upstream in self.all_upstreams:
            await upstream.start(proxy.client)

    async def stop(self) -> None:
        for upstream in self.all_upstreams:
            await upstream.stop()


# ---- the wrapper ---------------------------------------------------------------------------------


class Gateway:
    """The ASGI app: routes each request to an upstream pool or to the builtin app (`inner`)."""

    def __init__(self, pools: list[ModelPool], inner: ASGIApp | None = None, api_key: str | None = None,
                 timeouts: Timeouts | None = None):
        self.pools = pools
        self.inner = inner
        self.api_key = api_key
        self.timeouts = timeouts or Timeouts()
        self.proxy: Proxy | None = None
        self.created = now()
        self._inner_lifespan: Any = None

    # ---- lifespan ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.proxy = Proxy(self.timeouts)
        for pool in self.pools:
            await pool.start(self.proxy)

    async def stop(self) -> None:
        for pool in self.pools:
            await pool.stop()
        if self.proxy is not None:
            await self.proxy.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            if self.inner is not None and hasattr(self.inner, "router"):
                self._inner_lifespan = self.inner.router.lifespan_context(self.inner)
                await self._inner_lifespan.__aenter__()
            await self.start()
        except Exception as exc:  # noqa: BLE001 - reported to the server, which stops
            log.exception("gateway startup failed")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await self.stop()
            if self._inner_lifespan is not None:
                await self._inner_lifespan.__aexit__(None, None, None)
        finally:
            await send({"type": "lifespan.shutdown.complete"})

    # ---- routing -----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            if self.inner is not None:
                await self.inner(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await send_json(send, 200, {"status": "ok"})
        elif path == "/ready":
            await self._ready(send)
        elif path == "/v1/models" and method == "GET":
            if await self._authorized(scope, send, path):
                await send_json(send, 200, self._models().model_dump())
        elif method == "POST" and path in PROXIED + TRANSLATED + (COUNT_TOKENS,):
            await self._model_route(scope, receive, send, path)
        elif path in PROXIED + TRANSLATED + (COUNT_TOKENS,) and self.inner is None:  # as the builtin app answers
            await self._error(send, path, APIError(405, f"Method {method} is not allowed for {path}"))
        elif path == "/metrics":
            await self._metrics(scope, receive, send)
        elif self.inner is not None:
            await self.inner(scope, receive, send)
        elif path == "/" and method in ("GET", "HEAD"):
            await send_json(send, 200, {"status": "ok", "service": "flagdeploy"})
        else:
            await send_error(send, APIError(404, f"Invalid URL ({method} {path})"))

    async def _model_route(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        raw = await _read_body(receive)
        problem = None  # what is wrong with the body as such, answered as the builtin routes answer it
        try:
            encoding = dict(scope["headers"]).get(b"content-encoding", b"").decode("latin-1")
            check_content_encoding(encoding)
            body = parse_body(raw, ANTHROPIC if path.startswith(errors.ANTHROPIC_PATHS) else OPENAI)
        except APIError as exc:  # not JSON, too deep, a lone surrogate (it broke the upstream request), compressed
            body, problem = None, exc
        name = body.get("model") if isinstance(body, dict) else None
        pool = self._pool_for(name if isinstance(name, str) else None)
        if pool is None:
            if self.inner is not None:  # the builtin app answers its models, and every error about the body
                await self._replay(scope, raw, receive, send)
            elif not await self._authorized(scope, send, path):
                return
            elif problem is not None or not isinstance(body, dict):
                await self._error(send, path, problem or APIError(400, "The request body must be a JSON object."))
            else:
                await self._error(send, path, errors.model_not_found(name if isinstance(name, str) else ""))
            return
        if not await self._authorized(scope, send, path):
            return
        if problem is not None:
            await self._error(send, path, problem)
            return
        if path == COUNT_TOKENS and pool.engine == "builtin" and isinstance(body, dict):
            await self._to_builtin_replica(pool, path, body, send)  # our engine counts tokens
            return
        if path == COUNT_TOKENS:
            await self._count_tokens(pool, body, send)
            return
        shown = strip_context_suffix(name) if isinstance(name, str) and name.strip() else pool.name
        dialect = dialect_for(path, shown, pool.says_which_stop)
        try:
            body = dialect.chat_request(body) if isinstance(body, dict) else body
            if isinstance(body, dict):
                pool.media.check(body)
        except APIError as exc:
            await self._error(send, path, exc)
            return
        if (problem := _check_body(dialect.upstream_path or path, body)) is not None:
            await self._error(send, path, problem)
            return
        assert self.proxy is not None, "the gateway was not started (its ASGI lifespan did not run)"
        await self.proxy.handle(pool, path, body, receive, send, dialect)

    async def _count_tokens(self, pool: ModelPool, body: Any, send: Send) -> None:
        """count_tokens of an upstream model: the request translated as /v1/messages would be, and
        its prompt counted by a ready replica's engine (gateway/tokens.py)."""
        assert self.proxy is not None, "the gateway was not started (its ASGI lifespan did not run)"
        try:
            if not isinstance(body, dict):
                raise errors.bad_json() if body is None else APIError(400, "The request body must be a JSON object.")
            chat = AnthropicDialect(pool.name).chat_request(body)
            pool.media.check(chat)  # the engine fetches what it counts
            picked = pool.pick(None)
            if picked is None:
                raise pool.unavailable()
            upstream = picked[1]
            counted = await pool.count_tokens(self.proxy.client, upstream, prepare_request(chat, upstream.model_id)[0])
        except APIError as exc:
            await self._error(send, COUNT_TOKENS, exc)
            return
        await send_json(send, 200, {"input_tokens": counted})

    async def _to_builtin_replica(self, pool: ModelPool, path: str, body: dict[str, Any], send: Send) -> None:
        """A builtin-only route (count_tokens) of a builtin model served by launched replicas (--dp):
        any ready replica answers it, as the in-process builtin app would."""
        assert self.proxy is not None, "the gateway was not started (its ASGI lifespan did not run)"
        picked = pool.pick(None)
        if picked is None:
            await self._error(send, path, pool.unavailable())
            return
        _, upstream = picked
        headers = {"Authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
        try:
            r = await self.proxy.client.post(f"{upstream.url}{path}", json=body | {"model": upstream.model_id},
                                             headers=headers)
        except Exception as exc:  # noqa: BLE001 - the replica is gone or stalled: a 503, as for chat
            upstream.report_failure(str(exc))
            await self._error(send, path, upstream_unavailable(pool.name, f"{type(exc).__name__}: {exc}", RETRY_AFTER_S))
            return
        await send({"type": "http.response.start", "status": r.status_code,
                    "headers": [(b"content-type", r.headers.get("content-type", "application/json").encode())]})
        await send({"type": "http.response.body", "body": r.content, "more_body": False})

    def _pool_for(self, name: str | None) -> ModelPool | None:
        if name is None or not name.strip():
            # A bare request means the one model served: the builtin one if any, else a lone pool.
            return self.pools[0] if self.inner is None and len(self.pools) == 1 else None
        key = normalize_model_name(name)
        return next((p for p in self.pools if p.answers(key)), None)

    async def _replay(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        """Hand the request to the builtin app with the body already read; later receives (the
        disconnect) come from the client as usual."""
        replayed = False

        async def again() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        assert self.inner is not None
        await self.inner(scope, again, send)

    async def _authorized(self, scope: Scope, send: Send, path: str) -> bool:
        if self.api_key is None:
            return True
        given = presented_key(Request(scope))
        if given and hmac.compare_digest(given.encode(), self.api_key.encode()):
            return True
        await self._error(send, path, errors.invalid_api_key(given))
        return False

    async def _error(self, send: Send, path: str, error: APIError) -> None:
        """An error in the route's protocol: Anthropic's shape on /v1/messages*, OpenAI's elsewhere."""
        if path.startswith(errors.ANTHROPIC_PATHS):
            response = errors.anthropic_response(error)
            await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
        else:
            await send_error(send, error)

    # ---- state -------------------------------------------------------------------------------------

    def _builtin(self) -> tuple[list[str], Any] | None:
        """(names, engine slot) of the builtin model, if there is one."""
        state = getattr(self.inner, "state", None)
        names = getattr(state, "model_names", None)
        slot = getattr(state, "engine_slot", None)
        return (names.names, slot) if names is not None and slot is not None else None

    def _models(self) -> ModelList:
        cards = []
        builtin = self._builtin()
        if builtin is not None:
            names, slot = builtin
            max_len = slot.engine.max_model_len if slot.engine is not None else None
            cards += [ModelCard(id=n, created=self.created, max_model_len=max_len) for n in names]
        for pool in self.pools:
            cards += [ModelCard(id=n, created=self.created, max_model_len=pool.max_model_len) for n in pool.names]
        return ModelList(data=cards)

    def readiness(self) -> tuple[bool, bool, dict[str, Any]]:
        """(all ready, worth retrying, each model's state)."""
        models: dict[str, Any] = {}
        ready, retry = True, False
        builtin = self._builtin()
        if builtin is not None:
            names, slot = builtin
            state = "ready" if slot.engine is not None else "failed" if slot.error is not None else "loading"
            models[names[0]] = {"state": state, "engine": "builtin"} | ({"error": slot.error} if slot.error else {})
            ready &= state == "ready"
            retry |= state == "loading"
        for pool in self.pools:
            models[pool.name] = pool.status()
            ready &= pool.ready
            retry |= any(u.state is not State.FAILED and not u.ready for u in pool.all_upstreams)
        return ready, retry, models

    async def _ready(self, send: Send) -> None:
        ready, retry, models = self.readiness()
        if ready:
            await send_json(send, 200, {"status": "ready", "models": models})
            return
        headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
        await send_json(send, 503, {"status": "not_ready" if retry else "failed", "models": models}, headers)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The builtin app's metrics (if any), one line per upstream replica, then the metrics of the
        builtin engine's launched replicas (`--dp`), labelled by replica."""
        text = ""
        if self.inner is not None:
            captured: list[bytes] = []

            async def keep(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    captured.append(message.get("body", b""))

            await self.inner(scope, receive, keep)
            text = b"".join(captured).decode()
        lines = []
        for pool in self.pools:
            for role, u, r in pool.counters():  # a prefill-decode pair's instances carry role="prefill"/"decode"
                labels = f'model="{pool.name}",url="{u.url}"' + (f',role="{role}"' if role else "")
                lines += [f"flagdeploy_upstream_ready{{{labels}}} {int(u.ready)}",
                          f"flagdeploy_upstream_outstanding{{{labels}}} {r.outstanding}",
                          f"flagdeploy_upstream_requests_total{{{labels}}} {r.served}"]
        text += "\n".join(lines) + ("\n" if lines else "")
        for pool in self.pools:
            if pool.engine == "builtin" and self.proxy is not None:  # our own engines: their metrics too
                from .replicas import replica_metrics

                text += await replica_metrics(self.proxy.client, pool.name, [u.url for u in pool.upstreams if u.ready])
        body = text.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _check_body(path: str, body: Any) -> APIError | None:
    """Check the body as the builtin app does (server/openai.py's validated_request for chat, the field
    types for completions), before it goes upstream: a malformed request gets our 400 naming the field,
    whatever the engine would have said (llama-cpp-python answers 500 to a bad max_tokens, and the SDKs
    retry a 500). The body is forwarded as the client sent it; unknown fields pass through to the engine."""
    from flagdeploy.server.openai import validated_completion, validated_request

    try:
        (validated_request if path == "/v1/chat/completions" else validated_completion)(body)
    except APIError as exc:
        return exc
    return None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


# ---- building it from a config -------------------------------------------------------------------


def build_gateway(config: GatewayConfig, inner: ASGIApp | None = None,
                  supervisor_options: dict[str, Any] | None = None) -> Gateway:
    """The gateway for `config`. The builtin model (if any) becomes `inner` unless one is given;
    launched engines get a Supervisor per replica, attached ones an AttachedUpstream per URL."""
    pools = []
    for entry in config.models:
        if entry.engine == "builtin" and entry.replicas == 1:
            if given := entry.media_policy().profile_fields():
                log.warning("builtin model %s: %s not applied (the builtin app refuses media its model cannot take)",
                            entry.names[:1] or entry.model or "(default)", " and ".join(given))
            inner = inner or builtin_app(entry, config.api_key)
            continue
        # An attached engine without names answers to the ids it serves (learned from its /v1/models).
        names = entry.names if entry.engine == "upstream" else (entry.names or [_default_name(entry)])
        prefill = [AttachedUpstream(u, entry.upstream_api_key, entry.upstream_model) for u in entry.prefill_upstreams]
        pools.append(ModelPool(names, _upstreams(entry, config, supervisor_options or {}), engine=entry.engine,
                               max_model_len=entry.max_model_len, model=_model_files(entry),
                               media=entry.media_policy(), prefill=prefill))
    return Gateway(pools, inner, config.api_key, Timeouts(config.connect_timeout, config.read_timeout))


def _model_files(entry: ModelEntry) -> str | None:
    """Where the model's own files are (for its chat template): `model`, or the default model that
    a launched llama.cpp runs without one."""
    if entry.model or entry.engine != "llama.cpp" or entry.command:
        return entry.model
    from flagdeploy.checkpoints.source import DEFAULT_MODEL

    return DEFAULT_MODEL


def _default_name(entry: ModelEntry) -> str:
    if entry.engine in ("llama.cpp", "builtin"):
        from flagdeploy.checkpoints.source import resolve

        return resolve(entry.model, weights=entry.args.get("load_format", "auto") != "dummy").name
    return Path(entry.model or entry.engine).name or entry.engine


def _upstreams(entry: ModelEntry, config: GatewayConfig, options: dict[str, Any]) -> list[Upstream]:
    if entry.engine == "upstream":
        return [AttachedUpstream(u, entry.upstream_api_key, entry.upstream_model) for u in entry.upstreams]
    label = (entry.names[0] if entry.names else _default_name(entry)).replace("/", "_")
    out: list[Upstream] = []
    if entry.engine == "builtin":  # launched `flagdeploy serve` replicas (gateway/replicas.py)
        from .replicas import READY_PATH

        options = {"ready_path": READY_PATH} | options
    for i in range(entry.replicas):
        port = entry.port + i if entry.port else free_port()
        plan = launch_plan(entry, port, i)
        for warning in plan.warnings:
            log.warning("%s replica %d: %s", label, i, warning)
        name = f"{label}-{i}"
        out.append(Supervisor(name, f"http://127.0.0.1:{port}", plan.argv, env=plan.env, setup=plan.setup,
                              files=plan.files, workdir=config.logs() / name, log_path=config.logs() / f"{name}.log",
                              startup_timeout=entry.startup_timeout or config.startup_timeout,
                              api_key=entry.upstream_api_key, upstream_model=entry.upstream_model, **options))
    return out


def builtin_app(entry: ModelEntry, api_key: str | None) -> ASGIApp:
    """The builtin app, in this process, for a serve.yaml `engine: builtin` entry with one replica: `args` are
    a builtin model's options (flagdeploy/assemble.py's SERVE_FLAGS, as with more replicas). Nothing is compiled
    unless `compile: true` asks for it (the gateway's process serves the other models too)."""
    from flagdeploy import assemble

    args = dict(entry.args)
    if entry.max_model_len:
        args.setdefault("max_model_len", entry.max_model_len)
    try:
        options = assemble.ServeOptions.from_args(args, model=entry.model, chip=entry.chip, api_key=api_key,
                                                  reasoning_parser=None, compile=False)
        src = assemble.checked_source(options.model, options.weights)
    except FlagdeployError as exc:
        raise ConfigError(f"builtin model {entry.names[:1] or entry.model or '(default)'}: {exc}") from None
    return assemble.builtin_app(options, assemble.engine_loader(options, src), entry.names or [src.name])
