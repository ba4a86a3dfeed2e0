"""The FastAPI app: model loading state, auth, model names, and the OpenAI routes."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from flagdeploy.engine.grammar import GrammarError, GrammarSpec
from flagdeploy.engine.grammar import validate as validate_grammar
from flagdeploy.engine.sampling import RequestOutput, SamplingParams, TokenLogprob

from . import errors
from .answer import AnswerParser, parse_answer
from .errors import APIError
from .generation import (
    SSE_DONE,
    ClientDisconnected,
    EventStream,
    Generation,
    Job,
    collect,
    sse,
    unless_disconnected,
)
from .metrics import HTTPMetricsMiddleware, ServerMetrics
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    FunctionCall,
    ModelCard,
    ModelList,
    NamedToolChoice,
    SamplingFields,
    ToolCall,
    Usage,
    new_id,
    now,
)
from .reasoning import ReasoningStyle, RequestReasoning, get_style
from .tools import ToolPlan, get_parser, plan_tools

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)

MAX_CHOICES = 128  # engine requests one HTTP request may start (prompts x n): a queue, not a flood

_CONTEXT_SUFFIX = re.compile(r"(\s*\[1m\])+\s*$", re.IGNORECASE)


# ---- model names ---------------------------------------------------------------------------------


def strip_context_suffix(name: str) -> str:
    """The bare name: Claude Code's `[1m]` (1M-context) marker is client-side decoration."""
    return _CONTEXT_SUFFIX.sub("", name.strip()).strip()


def normalize_model_name(name: str) -> str:
    """The lookup key: the bare name, case-insensitive."""
    return strip_context_suffix(name).lower()


class ModelNames:
    """The names one model answers to; the first is the id every response shows."""

    def __init__(self, names: list[str]):
        if not names:
            raise ValueError("create_app needs at least one served model name")
        self.names = list(names)
        self.canonical = names[0]
        self._keys = {normalize_model_name(n) for n in names}

    def resolve(self, name: str | None) -> str:
        """The canonical id for `name`; a missing or empty name means the one model served."""
        if name is None or not name.strip() or normalize_model_name(name) in self._keys:
            return self.canonical
        raise errors.model_not_found(name)


# ---- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """What the operator chose at startup that every generation route applies (see create_app)."""

    default_temperature: float = 0.0
    style: ReasoningStyle | None = None
    max_waiting: int | None = None
    tool_call_parser: str = "auto"
    request_timeout: float | None = None

    def generation(self, engine: "AsyncEngine", jobs: list[Job], overload_status: int = 429) -> Generation:
        """The request's engine requests, admitted (or refused: backpressure) and started."""
        gen = Generation(engine, jobs, self.request_timeout)
        _admit(engine, gen.jobs, self.max_waiting, overload_status)
        return gen.start()


# ---- engine loading ------------------------------------------------------------------------------


class EngineSlot:
    """Holds the engine once `load_engine` returns; loading runs on a thread so the server can
    answer /health and /ready (and a clear 503) while weights are read."""

    def __init__(self, load_engine: Callable[[], "AsyncEngine"]):
        self._load_engine = load_engine
        self.engine: "AsyncEngine | None" = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="flagdeploy-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        started = time.monotonic()
        try:
            engine = self._load_engine()
        except BaseException as exc:  # noqa: BLE001 - a failed load must leave the server answering
            self.error = str(exc) or type(exc).__name__
            log.error("loading the model failed: %s", self.error, exc_info=exc)
            return
        self.engine = engine
        log.info("model loaded in %.1f s", time.monotonic() - started)

    def get(self) -> "AsyncEngine":
        if self.engine is not None:
            return self.engine
        if self.error is not None:
            raise errors.model_load_failed(self.error)
        raise errors.model_loading()

    def shutdown(self) -> None:
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine shutdown failed")


# ---- auth ----------------------------------------------------------------------------------------


def _presented_key(request: Request) -> str | None:
    """OpenAI clients send `Authorization: Bearer`, Anthropic-style ones `x-api-key`."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else auth.strip()
    return request.headers.get("x-api-key")


def _auth_dependency(api_key: str | None) -> Callable[[Request], Any]:
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = _presented_key(request)
        if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise errors.invalid_api_key(given)

    return check_api_key


# ---- request parsing and sampling ----------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """Parse the body ourselves: any Content-Type (curl -d sends a form type), and every failure
    a 400 in the OpenAI envelope naming the field."""
    body = errors.parse_json_body(await request.body())
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False)) from None


def _sampling_params(req: SamplingFields, max_tokens: int, seed: int | None, default_temperature: float,
                     **engine_fields: Any) -> SamplingParams:
    """`engine_fields`: the SamplingParams a route adds (grammar, logprobs, prompt_logprobs)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,  # vLLM's -1 means off
            seed=seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            **engine_fields,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _jobs(engine: "AsyncEngine", req: SamplingFields, requested_max: int | None, prompts: list[list[int]],
          stem: str, default_temperature: float, **engine_fields: Any) -> list[Job]:
    """One engine request per (prompt, choice); choice i of a seeded request uses seed + i so that
    the n answers differ yet the whole request is reproducible."""
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(400, f"This request asks for {len(prompts) * n} completions (prompts x n); at most "
                            f"{MAX_CHOICES} are served per request. Split it into several requests.", param="n")
    jobs = []
    for p, prompt_ids in enumerate(prompts):
        # Default: whatever fits. An explicit max_tokens beyond the window is capped by the engine,
        # not refused: Dify sends 4096 to models of any size.
        max_tokens = requested_max if requested_max is not None else max(1, engine.max_model_len - len(prompt_ids))
        for i in range(n):
            seed = None if req.seed is None else req.seed + i
            index = p * n + i
            params = _sampling_params(req, max_tokens, seed, default_temperature, **engine_fields)
            jobs.append(Job(index, p, prompt_ids, params, f"{stem}-{index}"))
    return jobs


def _finish_reason(out: RequestOutput, called: bool = False) -> str:
    """"tool_calls" when the answer calls tools, unless max_tokens cut it ("length", as OpenAI says
    for a truncated call too)."""
    if called and out.finish_reason == "stop":
        return "tool_calls"
    if out.finish_reason in ("stop", "length"):
        return out.finish_reason
    # "abort" only reaches a client that is still connected when the engine gave up on it.
    raise errors.server_error(f"generation ended with finish reason {out.finish_reason!r}")


def _chat_prompt(engine: "AsyncEngine", messages: list[dict[str, Any]],
                 template_kwargs: dict[str, Any] | None = None, tools: ToolPlan | None = None) -> tuple[list[int], str]:
    """Token ids and text of `messages` (template dicts) through the model's chat template;
    `template_kwargs` are extra template variables (enable_thinking, reasoning_effort, ...), `tools`
    how the request's tools reach the prompt. The text tells whether the template opened a
    reasoning section for the output."""
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        messages = tools.messages(messages)
        kwargs["tools"] = tools.template_tools()
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        # The template rejects the conversation (roles out of order, no template, ...): the
        # client can fix that, so 400 rather than 500.
        raise APIError(400, f"The messages could not be formatted with the model's chat template: {exc}",
                       param="messages") from None
    return engine.tokenizer.encode(text), text  # the template already carries the special tokens


def _tool_plan(engine: "AsyncEngine", definitions: list[dict[str, Any]] | None, choice: str | None,
               parser: str) -> ToolPlan | None:
    try:
        return plan_tools(engine.tokenizer, definitions, choice, parser)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None


def _grammar(engine: "AsyncEngine", spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """Check a request's grammar before anything is queued: a schema the library refuses is a 400."""
    if spec is not None:
        try:
            validate_grammar(engine.tokenizer, spec)
        except GrammarError as exc:
            raise APIError(400, f"The {param} cannot be enforced: {exc}", param=param) from None
    return spec


def _output_grammar(req: ChatCompletionRequest) -> tuple[GrammarSpec | None, str]:
    """The structured-output constraint of a chat request: OpenAI's response_format, or vLLM's
    guided_json / guided_regex / guided_choice."""
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"guided_json is not valid JSON: {exc}", param="guided_json") from None
        return GrammarSpec("json_schema", schema), "guided_json"
    if req.guided_regex is not None:
        return GrammarSpec("regex", req.guided_regex), "guided_regex"
    if req.guided_choice:
        return GrammarSpec("regex", "|".join(re.escape(c) for c in req.guided_choice)), "guided_choice"
    schema = req.response_format.schema() if req.response_format is not None else None
    return (GrammarSpec("json_schema", schema) if schema is not None else None), "response_format"


def _admit(engine: "AsyncEngine", jobs: list[Job], max_waiting: int | None, status: int = 429) -> None:
    """Backpressure: refuse at once, with Retry-After, a request whose engine requests would push
    the wait queue past `max_waiting`, instead of queueing without bound (every SDK retries 429 and
    529 after Retry-After, so a burst is spread out rather than piled up). `status` is 429 for the
    OpenAI routes and 529 (Anthropic's overloaded_error) for the Anthropic ones."""
    if max_waiting is None:
        return
    would_wait = getattr(engine, "would_wait", None)
    if would_wait is not None and would_wait(len(jobs)) > max_waiting:
        raise errors.overloaded(max_waiting, status)


def _completion_prompts(engine: "AsyncEngine", req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (the text is what `echo` sends back)."""
    ids, texts = [], []
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "The prompt is empty; send a string, a list of strings or a list of token ids.",
                       param="prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(engine.tokenizer.encode(prompt, add_special_tokens=True))
            texts.append(prompt)
        else:  # token ids: refused here if outside the vocabulary, before `echo` would decode them
            try:
                engine.check_prompt(list(prompt))
            except Exception as exc:
                raise errors.from_generation(exc, "prompt") from None
            ids.append(list(prompt))
            texts.append(engine.tokenizer.decode(list(prompt)) if req.echo else "")
    return ids, texts


async def _first_output(request: Request, gen: Generation, prompt_param: str) -> tuple[int, RequestOutput] | None:
    """Wait for the first output before committing to a 200 stream, so that a prompt that is too
    long or a bad sampling value still gets a proper 4xx instead of an error event. None: the
    client left meanwhile."""
    try:
        return await unless_disconnected(request, gen.next())
    except ClientDisconnected:
        gen.close()
        log.info("client disconnected before the first token, aborted")
        return None
    except Exception as exc:
        gen.close()
        raise errors.from_generation(exc, prompt_param) from None
    except BaseException:  # cancelled: the request is over either way
        gen.close()
        raise


def _usage(gen: Generation) -> Usage:
    prompt_tokens, cached = gen.prompt_usage()
    return Usage.of(prompt_tokens, gen.completion_tokens(), cached)


# ---- the app -------------------------------------------------------------------------------------


def create_app(load_engine: Callable[[], "AsyncEngine"], served_model_names: list[str],
               api_key: str | None = None, default_temperature: float = 0.0,
               reasoning_parser: str | None = None, max_waiting: int | None = None,
               tool_call_parser: str = "auto", request_timeout: float | None = None) -> FastAPI:
    """The server app. `load_engine` runs on a background thread at startup; until it returns,
    /ready and the inference routes answer 503.

    `reasoning_parser` (a REASONING_PARSERS name; None: off) splits the model's thinking from its
    answer. `max_waiting` bounds the engine's wait queue (None: unbounded); see `_admit`.
    `tool_call_parser` names the convention tool calls are read in (tool_parsers.yaml), or "auto"
    to take it from the model's chat template. `request_timeout` (seconds, None: none) aborts a
    generation that runs longer: 408 before the first byte, an error event in a stream after it.

    `default_temperature` applies when a request sets none. It is 0 (greedy) unless the operator
    says otherwise: a bare request gets the model's own best answer, reproducibly, and clients that
    want sampling say so (LangChain and Dify send their temperature). 1.0 is OpenAI's default.
    """
    names = ModelNames(served_model_names)
    if tool_call_parser != "auto":
        get_parser(tool_call_parser)  # an unknown name fails here, at startup
    settings = ServerSettings(default_temperature, get_style(reasoning_parser), max_waiting, tool_call_parser,
                              request_timeout)
    slot = EngineSlot(lambda: app_metrics.attach(load_engine()))
    app_metrics = ServerMetrics(lambda: slot.engine)  # this app's own registry
    started = now()

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

    @app.get("/health")
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

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(api_key))])

    @v1.get("/models")
    async def list_models() -> ModelList:
        max_len = slot.engine.max_model_len if slot.engine is not None else None
        return ModelList(data=[ModelCard(id=n, created=started, max_model_len=max_len) for n in names.names])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        model = names.resolve(req.model)
        engine = slot.get()
        cid = new_id("chatcmpl")
        choice = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        tools = _tool_plan(engine, req.tools, choice, settings.tool_call_parser)
        prompt, prompt_text = _chat_prompt(engine, [m.to_template() for m in req.messages], req.template_kwargs(), tools)
        reasoning = RequestReasoning.for_prompt(settings.style, prompt_text)
        grammar, grammar_param = (tools.grammar(engine.tokenizer), "tool_choice") if tools and tools.forced else _output_grammar(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen = settings.generation(engine, _jobs(engine, req, req.requested_max_tokens(), [prompt], cid,
                                                settings.default_temperature,
                                                grammar=_grammar(engine, grammar, grammar_param), logprobs=logprobs))
        if req.stream:
            first = await _first_output(request, gen, "messages")
            if first is None:
                return Response(status_code=499)
            return EventStream(_chat_events(engine, gen, first, cid, model, req.include_usage, reasoning, tools), gen.close)
        outputs = await collect(request, gen, "messages")
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for i in sorted(outputs):
            text = "".join(out.text for out in outputs[i])
            message, called = _assistant_message(text, reasoning, tools)
            lps = [lp for out in outputs[i] for lp in out.logprobs or []]
            choices.append(ChatChoice(index=i, message=message, logprobs=_chat_logprobs(engine, lps) if logprobs is not None else None,
                                      finish_reason=_finish_reason(gen.finals[i], called)))
        return JSONResponse(ChatCompletion(id=cid, model=model, choices=choices, usage=_usage(gen)).model_dump())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        model = names.resolve(req.model)
        engine = slot.get()
        cid = new_id("cmpl")
        prompt_ids, prompt_texts = _completion_prompts(engine, req)
        # echo + logprobs scores the prompt too (perplexity): each prompt token given those before it
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        gen = settings.generation(engine, _jobs(engine, req, req.requested_max_tokens(), prompt_ids, cid,
                                                settings.default_temperature, logprobs=req.logprobs,
                                                prompt_logprobs=prompt_logprobs))
        echo = {job.index: prompt_texts[job.prompt_index] for job in gen.jobs} if req.echo else {}
        if req.stream:
            first = await _first_output(request, gen, "prompt")
            if first is None:
                return Response(status_code=499)
            return EventStream(_completion_events(engine, gen, first, cid, model, req.include_usage, echo,
                                                  req.logprobs is not None), gen.close)
        outputs = await collect(request, gen, "prompt")
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for job in gen.jobs:
            outs = outputs[job.index]
            text = "".join(out.text for out in outs)
            lps = None
            if req.logprobs is not None:
                scored = _prompt_scores(job.prompt_ids, outs[0].prompt_logprobs) if req.echo else []
                lps = _completion_logprobs(engine, scored + [lp for out in outs for lp in out.logprobs or []])
            choices.append(CompletionChoice(index=job.index, text=echo.get(job.index, "") + text, logprobs=lps,
                                            finish_reason=_finish_reason(gen.finals[job.index])))
        return JSONResponse(Completion(id=cid, model=model, choices=choices, usage=_usage(gen)).model_dump())

    app.include_router(v1)
    # Imported here: the Anthropic routes build on this module's helpers.
    from .anthropic import anthropic_router

    app.include_router(anthropic_router(slot, names, _auth_dependency(api_key), settings))
    from .anthropic import MessagesRequest
    from .responses import ResponsesRequest, responses_router

    app.include_router(responses_router(slot, names, _auth_dependency(api_key), settings))
    _document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                           "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": MessagesRequest,
                           "/v1/responses": ResponsesRequest})
    return app


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


# ---- streams -------------------------------------------------------------------------------------


async def _stream(gen: Generation, first: tuple[int, RequestOutput], render: Callable[[int, RequestOutput], str | None],
                  final_usage: Callable[[], str] | None, cid: str, prompt_param: str) -> AsyncIterator[str]:
    """The common body of both streams: outputs as events, then usage and [DONE]; a failure
    mid-stream is one `data: {"error": ...}` event, after which the stream ends."""
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            event = render(*item)
            if event:
                yield event
            item = await gen.next() if not gen.done else None
        if final_usage is not None:
            yield final_usage()
        yield SSE_DONE
    except asyncio.CancelledError:
        log.info("%s: client disconnected mid-stream, aborted", cid)
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse(errors.from_generation(exc, prompt_param).body())
    finally:
        gen.close()


def _assistant_message(text: str, reasoning: RequestReasoning | None, tools: ToolPlan | None) -> tuple[AssistantMessage, bool]:
    """The message, and whether it calls tools."""
    thought, content, calls = parse_answer(text, reasoning, tools)
    tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None
    message = AssistantMessage(content=content if content or not calls else None, tool_calls=tool_calls,
                               reasoning_content=thought, reasoning=thought)
    return message, bool(calls)


def _token_text(engine: "AsyncEngine", token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(engine: "AsyncEngine", lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _prompt_scores(prompt_ids: list[int], scores: list[TokenLogprob | None] | None) -> list[TokenLogprob | int]:
    """The prompt's entries for `echo` + logprobs: the first token has no logprob (just its id)."""
    scores = scores or [None] * len(prompt_ids)
    return [score if score is not None else token_id for token_id, score in zip(prompt_ids, scores)]


def _completion_logprobs(engine: "AsyncEngine", lps: list[TokenLogprob | int], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives as
    {token: logprob} and each token's character offset in the text (`offset`: where this part
    starts). A bare int is a token without a logprob (the first of an echoed prompt): null, as OpenAI."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        token_id = lp if isinstance(lp, int) else lp.token_id
        text = _token_text(engine, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if isinstance(lp, int) else lp.logprob)
        tops.append(None if isinstance(lp, int) else {_token_text(engine, t): v for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_events(engine: "AsyncEngine", gen: Generation, first: tuple[int, RequestOutput], cid: str, model: str,
                 include_usage: bool, reasoning: RequestReasoning | None = None,
                 tools: ToolPlan | None = None) -> AsyncIterator[str]:
    created = now()
    exclude = None if include_usage else {"usage"}
    parsers = {job.index: AnswerParser(reasoning, tools) for job in gen.jobs}
    unsent: dict[int, list[TokenLogprob]] = {job.index: [] for job in gen.jobs}  # logprobs of held-back text
    want_logprobs = gen.jobs[0].params.logprobs is not None

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump_json(exclude=exclude))

    def render(index: int, out: RequestOutput) -> str | None:
        unsent[index] += out.logprobs or []
        if not out.finished and not out.text:
            return None  # an incomplete multi-byte character: nothing to show yet
        parser = parsers[index]
        d = parser.feed(out.text, finished=out.finished)
        finish = None
        if out.finished:
            finish = _finish_reason(out, bool(parser.calls))
        if finish is None and not d:
            return None  # held back: maybe part of a tag
        thought = (d.thought or None) if reasoning is not None else None
        delta = DeltaMessage(content=d.content or None, reasoning_content=thought, reasoning=thought,
                             tool_calls=d.tool_calls or None)
        logprobs = _chat_logprobs(engine, unsent[index]) if want_logprobs else None
        unsent[index] = []
        return chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)])

    async def events() -> AsyncIterator[str]:
        for job in gen.jobs:  # every choice opens with its role, as OpenAI's first chunk does
            yield chunk([ChatChunkChoice(index=job.index, delta=DeltaMessage(role="assistant", content=""))])
        usage = (lambda: chunk([], _usage(gen))) if include_usage else None
        async for event in _stream(gen, first, render, usage, cid, "messages"):
            yield event

    return events()


def _completion_events(engine: "AsyncEngine", gen: Generation, first: tuple[int, RequestOutput], cid: str, model: str,
                       include_usage: bool, echo: dict[int, str], want_logprobs: bool = False) -> AsyncIterator[str]:
    created = now()
    exclude = None if include_usage else {"usage"}
    offsets = {index: len(text) for index, text in echo.items()}  # text_offset continues after the echo
    jobs = {job.index: job for job in gen.jobs}

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        body = Completion(id=cid, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump_json(exclude=exclude))

    def render(index: int, out: RequestOutput) -> str | None:
        if not out.finished and not out.text and not out.prompt_logprobs:
            return None
        finish = _finish_reason(out) if out.finished else None
        lps = None
        if want_logprobs:
            scored = _prompt_scores(jobs[index].prompt_ids, out.prompt_logprobs) if out.prompt_logprobs else []
            lps = _completion_logprobs(engine, scored + list(out.logprobs or []), 0 if scored else offsets.get(index, 0))
            offsets[index] = lps["text_offset"][-1] + len(lps["tokens"][-1]) if lps["tokens"] else offsets.get(index, 0)
        text = (echo.get(index, "") if out.prompt_logprobs else "") + out.text
        return chunk([CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish)])

    async def events() -> AsyncIterator[str]:
        for index, text in sorted(echo.items()):
            if not want_logprobs:  # with logprobs the echoed prompt comes with its scores, in the first output
                yield chunk([CompletionChoice(index=index, text=text)])
        usage = (lambda: chunk([], _usage(gen))) if include_usage else None
        async for event in _stream(gen, first, render, usage, cid, "prompt"):
            yield event

    return events()
