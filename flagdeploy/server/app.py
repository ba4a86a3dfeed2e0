"""The FastAPI app: the service routes (/health, /ready, /metrics) and one router per protocol over the same
pipeline (pipeline.py): OpenAI (openai.py), Anthropic (anthropic.py) and Responses (responses.py)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from flagdeploy.errors import ConfigError

from . import errors
from .anthropic import MessagesRequest, anthropic_router
from .auth import api_key_check
from .engine_slot import EngineSlot
from .media import MediaSettings
from .metrics import HTTPMetricsMiddleware, ServerMetrics
from .names import ModelNames
from .openai import openai_router
from .pipeline import MaxTokensPolicy, ServerSettings
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from .reasoning import get_style
from .responses import ResponsesRequest, responses_router
from .tools import get_parser

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine


# ---- the app -------------------------------------------------------------------------------------


def create_app(load_engine: Callable[[], "AsyncEngine"], served_model_names: list[str],
               api_key: str | None = None, default_temperature: float = 0.0,
               reasoning_parser: str | None = None, max_waiting: int | None = None,
               tool_call_parser: str = "auto", request_timeout: float | None = None,
               max_tokens_policy: MaxTokensPolicy = "auto", media: MediaSettings | None = None) -> FastAPI:
    """The server app. `load_engine` runs on a background thread at startup; until it returns,
    /ready and the inference routes answer 503.

    `reasoning_parser` (a REASONING_PARSERS name; None: off) splits the model's thinking from its
    answer. `max_waiting` bounds the engine's wait queue (None: unbounded); see `pipeline.admit`.
    `tool_call_parser` names the convention tool calls are read in (tool_parsers.yaml), or "auto"
    to take it from the model's chat template. `request_timeout` (seconds, None: none) aborts a
    generation that runs longer: 408 before the first byte, an error event in a stream after it.
    `max_tokens_policy` ("auto", "error" or "clamp") answers a max_tokens that cannot fit after the prompt
    (pipeline.ServerSettings).
    `media`: the allowed media hosts, items per request and fetch limits for a model that takes images
    and video (server/media.py; default: data: URLs only, no count limit).

    `default_temperature` applies when a request sets none. It is 0 (greedy) unless the operator
    says otherwise: a bare request gets the model's own best answer, reproducibly, and clients that
    want sampling say so (LangChain and Dify send their temperature). 1.0 is OpenAI's default.
    """
    names = ModelNames(served_model_names)
    check_parsers(reasoning_parser, tool_call_parser)  # an unknown name fails here, at startup
    settings = ServerSettings(default_temperature, get_style(reasoning_parser), max_waiting, tool_call_parser,
                              request_timeout, max_tokens_policy, media or MediaSettings())
    slot = EngineSlot(lambda: app_metrics.attach(load_engine()))
    app_metrics = ServerMetrics(lambda: slot.engine)  # this app's own registry

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        slot.start()
        yield
        slot.shutdown()

    app = FastAPI(title="flagdeploy", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.engine_slot = slot
    app.state.model_names = names
    app.state.metrics = app_metrics
    app.add_middleware(HTTPMetricsMiddleware, metrics=app_metrics)
    errors.install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, str]:
        """Claude Code probes `HEAD /` before its first request: answer it (no auth, like /health)."""
        return {"status": "ok", "service": "flagdeploy"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if slot.engine is not None:
            return JSONResponse({"status": "ready"})
        if slot.error is not None:
            return JSONResponse({"status": "failed", "error": slot.error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = app_metrics.exposition()
        return Response(body, media_type=content_type)

    auth = api_key_check(api_key)
    app.include_router(openai_router(slot, names, auth, settings))
    app.include_router(anthropic_router(slot, names, auth, settings))
    app.include_router(responses_router(slot, names, auth, settings))
    _document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                           "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": MessagesRequest,
                           "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest})
    return app


def check_parsers(reasoning_parser: str | None, tool_call_parser: str | None,
                  spell: Callable[[str], str] = lambda name: name) -> None:
    """A misspelt parser name fails before any model loads: the one check of the command line (cli.py), of
    serve.yaml's builtin models (assemble.py) and of the app itself. `spell` names the option the caller's
    way (--reasoning-parser on the command line, reasoning_parser in serve.yaml)."""
    try:
        get_style(reasoning_parser or "none")
    except ValueError as exc:
        raise ConfigError(f"{spell('reasoning_parser')}: {exc}") from None
    if tool_call_parser and tool_call_parser != "auto":
        try:
            get_parser(tool_call_parser)
        except ValueError as exc:
            raise ConfigError(f"{spell('tool_call_parser')}: {exc}") from None


def _document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request models into /openapi.json. The routes parse bodies themselves (any
    Content-Type, 400 not 422), so FastAPI cannot see them; without this the document would say
    nothing about what the endpoints take, and schema-driven tools (clients, fuzzers) would guess."""
    from pydantic.json_schema import models_json_schema

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            models = list(dict.fromkeys(bodies.values()))
            refs, defs = models_json_schema([(m, "validation") for m in models],
                                            ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in bodies.items():
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
