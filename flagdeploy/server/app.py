"""The FastAPI app: model loading state, auth, model names, and the OpenAI routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from flagdeploy.engine.sampling import RequestOutput, SamplingParams

from . import errors
from .errors import APIError
from .generation import SSE_DONE, ClientDisconnected, EventStream, Generation, Job, collect, sse, unless_disconnected
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
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
    new_id,
    now,
)
from .reasoning import RequestReasoning, get_style

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


def _sampling_params(req: SamplingFields, max_tokens: int, seed: int | None, default_temperature: float) -> SamplingParams:
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
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _jobs(engine: "AsyncEngine", req: SamplingFields, requested_max: int | None, prompts: list[list[int]],
          stem: str, default_temperature: float) -> list[Job]:
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
            jobs.append(Job(index, p, prompt_ids, _sampling_params(req, max_tokens, seed, default_temperature),
                            f"{stem}-{index}"))
    return jobs


def _finish_reason(out: RequestOutput) -> str:
    if out.finish_reason in ("stop", "length"):
        return out.finish_reason
    # "abort" only reaches a client that is still connected when the engine gave up on it.
    raise errors.server_error(f"generation ended with finish reason {out.finish_reason!r}")


def _chat_prompt(engine: "AsyncEngine", messages: list[dict[str, Any]],
                 template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """Token ids and text of `messages` (template dicts) through the model's chat template;
    `template_kwargs` are extra template variables (enable_thinking, reasoning_effort, ...). The
    text tells whether the template opened a reasoning section for the output."""
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {}))
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        # The template rejects the conversation (roles out of order, no template, ...): the
        # client can fix that, so 400 rather than 500.
        raise APIError(400, f"The messages could not be formatted with the model's chat template: {exc}",
                       param="messages") from None
    return engine.tokenizer.encode(text), text  # the template already carries the special tokens


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
        else:  # token ids: the engine refuses ids outside the vocabulary before queueing them
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
               reasoning_parser: str | None = None, max_waiting: int | None = None) -> FastAPI:
    """The server app. `load_engine` runs on a background thread at startup; until it returns,
    /ready and the inference routes answer 503.

    `reasoning_parser` (a REASONING_PARSERS name; None: off) splits the model's thinking from its
    answer. `max_waiting` bounds the engine's wait queue (None: unbounded); see `_admit`.

    `default_temperature` applies when a request sets none. It is 0 (greedy) unless the operator
    says otherwise: a bare request gets the model's own best answer, reproducibly, and clients that
    want sampling say so (LangChain and Dify send their temperature). 1.0 is OpenAI's default.
    """
    names = ModelNames(served_model_names)
    style = get_style(reasoning_parser)  # an unknown name fails here, at startup
    slot = EngineSlot(load_engine)
    started = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        slot.start()
        yield
        slot.shutdown()

    app = FastAPI(title="flagdeploy", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.engine_slot = slot
    app.state.model_names = names
    errors.install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/", methods=["GET", "HEAD"])
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
    async def metrics() -> PlainTextResponse:
        lines = [f"flagdeploy_ready {int(slot.engine is not None)}"]
        if slot.engine is not None:
            lines += [f"flagdeploy_{key} {value}" for key, value in slot.engine.stats().items()]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

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
        prompt, prompt_text = _chat_prompt(engine, [m.to_template() for m in req.messages], req.template_kwargs())
        reasoning = RequestReasoning.for_prompt(style, prompt_text)
        gen = Generation(engine, _jobs(engine, req, req.requested_max_tokens(), [prompt], cid, default_temperature))
        _admit(engine, gen.jobs, max_waiting)
        gen.start()
        if req.stream:
            first = await _first_output(request, gen, "messages")
            if first is None:
                return Response(status_code=499)
            return EventStream(_chat_events(gen, first, cid, model, req.include_usage, reasoning), gen.close)
        try:
            texts = await collect(request, gen)
        except ClientDisconnected:
            log.info("%s: client disconnected, aborted", cid)
            return Response(status_code=499)
        except Exception as exc:
            raise errors.from_generation(exc, "messages") from None
        choices = [ChatChoice(index=i, message=_assistant_message(texts[i], reasoning),
                              finish_reason=_finish_reason(gen.finals[i])) for i in sorted(texts)]
        return JSONResponse(ChatCompletion(id=cid, model=model, choices=choices, usage=_usage(gen)).model_dump())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        model = names.resolve(req.model)
        engine = slot.get()
        cid = new_id("cmpl")
        prompt_ids, prompt_texts = _completion_prompts(engine, req)
        gen = Generation(engine, _jobs(engine, req, req.requested_max_tokens(), prompt_ids, cid, default_temperature))
        echo = {job.index: prompt_texts[job.prompt_index] for job in gen.jobs} if req.echo else {}
        _admit(engine, gen.jobs, max_waiting)
        gen.start()
        if req.stream:
            first = await _first_output(request, gen, "prompt")
            if first is None:
                return Response(status_code=499)
            return EventStream(_completion_events(gen, first, cid, model, req.include_usage, echo), gen.close)
        try:
            texts = await collect(request, gen)
        except ClientDisconnected:
            log.info("%s: client disconnected, aborted", cid)
            return Response(status_code=499)
        except Exception as exc:
            raise errors.from_generation(exc, "prompt") from None
        choices = [CompletionChoice(index=i, text=echo.get(i, "") + texts[i], finish_reason=_finish_reason(gen.finals[i]))
                   for i in sorted(texts)]
        return JSONResponse(Completion(id=cid, model=model, choices=choices, usage=_usage(gen)).model_dump())

    app.include_router(v1)
    # Imported here: the Anthropic routes build on this module's helpers.
    from .anthropic import anthropic_router

    app.include_router(anthropic_router(slot, names, _auth_dependency(api_key), default_temperature,
                                        style, max_waiting))
    return app


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


def _assistant_message(text: str, reasoning: RequestReasoning | None) -> AssistantMessage:
    if reasoning is None:
        return AssistantMessage(content=text)
    thought, content = reasoning.split(text)
    return AssistantMessage(content=content, reasoning_content=thought, reasoning=thought)


def _chat_events(gen: Generation, first: tuple[int, RequestOutput], cid: str, model: str,
                 include_usage: bool, reasoning: RequestReasoning | None = None) -> AsyncIterator[str]:
    created = now()
    exclude = None if include_usage else {"usage"}
    parsers = {job.index: reasoning.parser() for job in gen.jobs} if reasoning is not None else {}

    def delta(index: int, out: RequestOutput) -> DeltaMessage:
        parser = parsers.get(index)
        if parser is None:
            return DeltaMessage(content=out.text or None)
        thought, content = parser.feed(out.text)
        if out.finished:
            more_thought, more_content = parser.finish()
            thought, content = thought + more_thought, content + more_content
        return DeltaMessage(content=content or None, reasoning_content=thought or None, reasoning=thought or None)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump_json(exclude=exclude))

    def render(index: int, out: RequestOutput) -> str | None:
        if not out.finished and not out.text:
            return None  # an incomplete multi-byte character: nothing to show yet
        finish = _finish_reason(out) if out.finished else None
        d = delta(index, out)
        if finish is None and d.content is None and d.reasoning_content is None:
            return None  # held back: maybe part of a tag
        return chunk([ChatChunkChoice(index=index, delta=d, finish_reason=finish)])

    async def events() -> AsyncIterator[str]:
        for job in gen.jobs:  # every choice opens with its role, as OpenAI's first chunk does
            yield chunk([ChatChunkChoice(index=job.index, delta=DeltaMessage(role="assistant", content=""))])
        usage = (lambda: chunk([], _usage(gen))) if include_usage else None
        async for event in _stream(gen, first, render, usage, cid, "messages"):
            yield event

    return events()


def _completion_events(gen: Generation, first: tuple[int, RequestOutput], cid: str, model: str,
                       include_usage: bool, echo: dict[int, str]) -> AsyncIterator[str]:
    created = now()
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        body = Completion(id=cid, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump_json(exclude=exclude))

    def render(index: int, out: RequestOutput) -> str | None:
        if not out.finished and not out.text:
            return None
        finish = _finish_reason(out) if out.finished else None
        return chunk([CompletionChoice(index=index, text=out.text, finish_reason=finish)])

    async def events() -> AsyncIterator[str]:
        for index, text in sorted(echo.items()):
            yield chunk([CompletionChoice(index=index, text=text)])
        usage = (lambda: chunk([], _usage(gen))) if include_usage else None
        async for event in _stream(gen, first, render, usage, cid, "prompt"):
            yield event

    return events()
