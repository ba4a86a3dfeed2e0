"""The OpenAI protocol: chat completions, completions, the model list and vLLM's /tokenize, over the shared
pipeline (pipeline.py), as the Anthropic (anthropic.py) and Responses (responses.py) protocols are.

`validated_request` / `validated_completion` turn a body into the request every reader may trust (these
routes and the gateway, which checks a body before it goes to another engine); the wire shapes of the
answers are the pydantic models of protocol.py and the builders below."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from flagdeploy.engine.grammar import GrammarSpec
from flagdeploy.engine.request import RequestOutput, TokenLogprob

from . import errors
from .answer import AnswerParser, parse_answer
from .engine_slot import EngineSlot
from .errors import APIError
from .generation import SSE_DONE, EventStream, Generation, collect, sse
from .media import takes_media
from .names import ModelNames
from .pipeline import (
    ServerSettings,
    chat_prompt,
    check_grammar,
    check_length_bound,
    encode_text,
    first_output,
    make_jobs,
    tool_plan,
)
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
    TokenizeRequest,
    ToolCall,
    Usage,
    new_id,
    now,
)
from .reasoning import RequestReasoning
from .tools import ToolPlan
from .validate import check_chat_messages, check_openai_tools, check_response_format, read_body, refuse_media

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)


# ---- requests ------------------------------------------------------------------------------------


def validated_request(body: Any) -> ChatCompletionRequest:
    """A chat completions body as the request every reader may trust (this route and the gateway): its
    fields' types, the messages' roles and parts, the response format and the tools checked, each failure a
    400 naming the field. (What the model can take, its media, is the route's to check: it knows the engine.)"""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False)) from None
    check_chat_messages(req.messages)
    check_response_format(req.response_format)
    check_openai_tools(req.tools, req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice)
                       else req.tool_choice)
    return req


def validated_completion(body: Any) -> CompletionRequest:
    """A (legacy) completions body, its fields' types checked, each failure a 400 naming the field."""
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False)) from None


def _validated_tokenize(body: Any) -> TokenizeRequest:
    try:
        return TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False)) from None


def _chat_media(req: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(path, type) of every content part of the messages."""
    return [(f"messages[{i}].content[{k}]", part.type) for i, m in enumerate(req.messages)
            if isinstance(m.content, list) for k, part in enumerate(m.content)]


def _finish_reason(out: RequestOutput, called: bool = False) -> str:
    """"tool_calls" when the answer calls tools, unless max_tokens cut it ("length", as OpenAI says
    for a truncated call too)."""
    if called and out.finish_reason == "stop":
        return "tool_calls"
    if out.finish_reason in ("stop", "length"):
        return out.finish_reason
    # "abort" only reaches a client that is still connected when the engine gave up on it.
    raise errors.server_error(f"generation ended with finish reason {out.finish_reason!r}")


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
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise APIError(400, "guided_choice is empty: list the strings the answer may be.", param="guided_choice")
        return GrammarSpec("regex", "|".join(re.escape(c) for c in req.guided_choice)), "guided_choice"
    schema = req.response_format.schema() if req.response_format is not None else None
    return (GrammarSpec("json_schema", schema) if schema is not None else None), "response_format"


async def _completion_prompts(engine: "AsyncEngine", req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (the text is what `echo` sends back)."""
    ids, texts = [], []
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "The prompt is empty; send a string, a list of strings or a list of token ids.",
                       param="prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(await encode_text(engine, prompt, "prompt"))
            texts.append(prompt)
        else:  # token ids: refused here if outside the vocabulary, before `echo` would decode them
            try:
                engine.check_prompt(list(prompt))
            except Exception as exc:
                raise errors.from_generation(exc, "prompt") from None
            ids.append(list(prompt))
            texts.append(engine.tokenizer.decode(list(prompt)) if req.echo else "")
    return ids, texts


def _with_transfer(body, gen: Generation) -> dict[str, Any]:
    """The response body, with vLLM's `kv_transfer_params` where a prefill staged its caches for a decode
    instance (engine/kv_transfer.py): a router hands them to the decode request."""
    out = body.model_dump()
    params = [f.kv_transfer_params for f in gen.finals.values() if f is not None and f.kv_transfer_params]
    if params:
        out["kv_transfer_params"] = params[0]
    return out


def _usage(gen: Generation) -> Usage:
    prompt_tokens, cached = gen.prompt_usage()
    return Usage.of(prompt_tokens, gen.completion_tokens(), cached)


# ---- routes --------------------------------------------------------------------------------------


def openai_router(slot: EngineSlot, names: ModelNames, auth: Callable[[Request], Any],
                  settings: ServerSettings) -> APIRouter:
    """The OpenAI routes (/v1/models, /v1/chat/completions, /v1/completions) and vLLM's /tokenize (at the
    root, as vLLM serves it); `auth` is the app's key check."""
    router = APIRouter(dependencies=[Depends(auth)])
    started = now()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's route (at the root, as vLLM serves it): the token ids of a prompt or of a chat as a chat
        completion renders it. A gateway in front of this server counts prompts with it, as it does on vLLM."""
        req = _validated_tokenize(await read_body(request))
        names.resolve(req.model)
        engine = slot.get()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send `prompt` (a text) or `messages` (a chat), one of them.", param="prompt")
        if req.messages is not None:
            check_chat_messages(req.messages)
            check_openai_tools(req.tools, None)
            tools = tool_plan(engine, req.tools, None, settings.tool_call_parser)
            ids, _, _ = await chat_prompt(engine, [m.to_template() for m in req.messages], req.template_kwargs(), tools)
        elif req.add_special_tokens:
            ids = await encode_text(engine, req.prompt, "prompt")
        else:
            check_length_bound(engine, len(req.prompt), "prompt")
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        max_len = slot.engine.max_model_len if slot.engine is not None else None
        return ModelList(data=[ModelCard(id=n, created=started, max_model_len=max_len) for n in names.names])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = validated_request(await read_body(request))
        model = names.resolve(req.model)
        engine = slot.get()
        cid = new_id("chatcmpl")
        refuse_media(_chat_media(req), engine.input_modalities, model)
        choice = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        tools = tool_plan(engine, req.tools, choice, settings.tool_call_parser)
        prompt, prompt_text, media = await chat_prompt(engine, [m.to_template(takes_media(engine)) for m in req.messages],
                                                       req.template_kwargs(), tools, media=settings.media)
        reasoning = RequestReasoning.for_prompt(settings.style, prompt_text)
        grammar, grammar_param = (tools.grammar(engine.tokenizer), "tool_choice") if tools and tools.forced else _output_grammar(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        gen = settings.generation(engine, make_jobs(engine, settings, req, req.requested_max_tokens(), [prompt], cid,
                                                    max_param, media=media,
                                                    grammar=check_grammar(engine, grammar, grammar_param),
                                                    logprobs=logprobs))
        if req.stream:
            first = await first_output(request, gen, "messages")
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
        return JSONResponse(_with_transfer(ChatCompletion(id=cid, model=model, choices=choices, usage=_usage(gen)), gen))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = validated_completion(await read_body(request))
        model = names.resolve(req.model)
        engine = slot.get()
        cid = new_id("cmpl")
        prompt_ids, prompt_texts = await _completion_prompts(engine, req)
        # echo + logprobs scores the prompt too (perplexity): each prompt token given those before it
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        gen = settings.generation(engine, make_jobs(engine, settings, req, req.requested_max_tokens(), prompt_ids, cid,
                                                    prompt_param="prompt", logprobs=req.logprobs,
                                                    prompt_logprobs=prompt_logprobs))
        echo = {job.index: prompt_texts[job.prompt_index] for job in gen.jobs} if req.echo else {}
        if req.stream:
            first = await first_output(request, gen, "prompt")
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
        return JSONResponse(_with_transfer(Completion(id=cid, model=model, choices=choices, usage=_usage(gen)), gen))

    return router


# ---- streams -------------------------------------------------------------------------------------


async def _stream(gen: Generation, first: tuple[int, RequestOutput], render: Callable[[int, RequestOutput], str | None],
                  final_usage: Callable[[], str] | None, cid: str, prompt_param: str) -> AsyncIterator[str]:
    """The common body of both streams: outputs as events, then usage and [DONE]; a failure
    mid-stream is one `data: {"error": ...}` event, then [DONE]."""
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
        yield SSE_DONE  # then the end, as every stream ends (clients that wait for it would wait forever)
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


class ContentChunks:
    """The event of a chat stream's chunk that carries only the next piece of one choice's content (most
    of a stream's events): the bytes `ChatCompletionChunk(...).model_dump_json` writes, from a prefix and a
    suffix made once per stream. Building and serialising the models for every token was the largest part
    of the event loop's time per token, time taken from the engine's step on a CPU with few cores."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool):
        marker = "\x00"
        sample = ChatCompletionChunk(id=cid, created=created, model=model, usage=None, choices=[
            ChatChunkChoice(index=0, delta=DeltaMessage(content=marker))]).model_dump_json(
                exclude=None if include_usage else {"usage"})
        self.head, rest = sample.split('"choices":[{"index":0,', 1)
        self.mid, self.tail = rest.split(json.dumps(marker), 1)

    def __call__(self, index: int, text: str) -> str:
        return sse(f'{self.head}"choices":[{{"index":{index},{self.mid}{json.dumps(text, ensure_ascii=False)}{self.tail}')


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

    content_chunk = ContentChunks(cid, created, model, include_usage)

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
        if finish is None and d.content and not thought and not d.tool_calls and not want_logprobs:
            return content_chunk(index, d.content)
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
