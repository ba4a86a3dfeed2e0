"""The Anthropic Messages API: `/v1/messages` (stream and not) and `/v1/messages/count_tokens`.

Claude Code (as CC Switch configures it) speaks only this protocol, so serving it lets users point
`ANTHROPIC_BASE_URL` at `flagdeploy serve` and change nothing else. It runs on the same engine,
chat template and generation path as the OpenAI routes; only the wire shapes differ:
`event:`-framed SSE (the SDK drops events without an `event:` line), exactly one message_start /
message_delta / message_stop (duplicates make Claude Code abort), and errors as
`{"type": "error", "error": {"type", "message"}}` (never 422, never 5xx for a client mistake).

Requests are lenient like the OpenAI ones: Claude Code sends `thinking`, `context_management`,
`metadata`, `tools`, `cache_control`, a `?beta=true` query, `anthropic-version` / `anthropic-beta`
headers of any value, and `role: "system"` entries inside `messages`; all are accepted, and what
this text-only path cannot use is ignored.

Tools map onto the OpenAI path's machinery: `tools` (name, description, input_schema) become
function tools rendered by the chat template, `tool_use` / `tool_result` blocks in the history become
assistant tool calls and tool turns, the model's calls come back as `tool_use` blocks (streamed as
`input_json_delta` fragments) with stop_reason "tool_use", and `tool_choice` any / tool forces a
call by grammar.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from flagdeploy.engine.request import RequestOutput

from . import errors
from .answer import AnswerDelta, AnswerParser, parse_answer
from .engine_slot import EngineSlot
from .errors import APIError, anthropic_response
from .generation import EventStream, Generation, collect
from .media import takes_media
from .names import ModelNames, strip_context_suffix
from .pipeline import ServerSettings, chat_prompt, check_grammar, first_output, make_jobs, tool_plan
from .protocol import Lenient, SamplingFields, thinking_switch, thinking_template_kwargs
from .reasoning import RequestReasoning
from .tools import ToolPlan
from .validate import (ANTHROPIC, ANTHROPIC_ROLES, check_anthropic_tools, content_parts, one_of, read_body,
                       refuse_media)

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)

# ---- requests ------------------------------------------------------------------------------------


class Block(Lenient):
    """A content block. Text is the conversation; tool_use / tool_result become plain text so that
    an agent's history still renders on a template without tools; thinking and documents are dropped
    (Claude Code echoes earlier thinking blocks back, which must not fail); images become OpenAI image
    parts where the messages go to an engine that takes them (`template_messages(media=True)`: the
    gateway), and are dropped otherwise (a model that cannot take them has refused the request)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    source: Any = None  # an image's: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}

    def image_part(self) -> dict[str, Any]:
        """An image block as an OpenAI image part: a base64 source as a data: URL, a url source as its URL."""
        source = self.source if isinstance(self.source, dict) else {}
        kind = source.get("type")
        if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
            url = f"data:{source['media_type']};base64,{source['data']}"
        elif kind == "url" and isinstance(source.get("url"), str):
            url = source["url"]
        else:
            got = json.dumps(self.source, ensure_ascii=False)
            raise APIError(400, f"An image block's source must be {{\"type\": \"base64\", \"media_type\": "
                                f"\"image/png\", \"data\": \"<base64>\"}} or {{\"type\": \"url\", \"url\": "
                                f"\"https://...\"}}, but it is {got[:200]}. Send the image in one of those forms "
                                f"(`file` sources name Anthropic's Files API, which is not served here).")
        return {"type": "image_url", "image_url": {"url": url}}

    def images(self) -> list[dict[str, Any]]:
        """The OpenAI image parts this block carries: itself if an image, a tool result's own images."""
        if self.type == "image":
            return [self.image_part()]
        if self.type == "tool_result" and isinstance(self.content, list):
            return [b.image_part() for b in self.content if b.type == "image"]
        return []

    def render(self) -> str:
        if self.type == "text":
            return self.text or ""
        if self.type == "tool_use":
            return f"[tool call {self.name} ({self.id}): {json.dumps(self.input, ensure_ascii=False)}]"
        if self.type == "tool_result":
            label = "tool error" if self.is_error else "tool result"
            return f"[{label} ({self.tool_use_id}): {_text(self.content)}]"
        return ""


def _text(content: str | list[Block] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(t for t in (b.render() for b in content) if t)


def _chat_content(content: str | list[Block] | None, media: bool, text: str) -> str | list[dict[str, Any]]:
    """Chat content for `content`: `text` (the blocks as plain text), or, with `media` and an image
    among the blocks, OpenAI content parts in block order: each block's text, then its images (a tool
    result's after its text), consecutive text joined by newlines as in `text`."""
    blocks = content if media and isinstance(content, list) else []
    carried = [b.images() for b in blocks]
    if not any(carried):
        return text
    parts: list[dict[str, Any]] = []
    run: list[str] = []
    for block, images in zip(blocks, carried):
        if rendered := block.render():
            run.append(rendered)
        if images and run:
            parts.append({"type": "text", "text": "\n".join(run)})
            run = []
        parts += images
    return parts + ([{"type": "text", "text": "\n".join(run)}] if run else [])


class Message(Lenient):
    role: str  # a plain string: Claude Code >= 2.1.154 sends "system" here
    content: str | list[Block] | None = None


def _tool_turn(b: Block, media: bool) -> dict[str, Any]:
    """A tool_result block as a tool turn (an error's text marked as one)."""
    prefix = "[error] " if b.is_error else ""
    content = _chat_content(b.content, media, prefix + _text(b.content))
    if isinstance(content, list) and prefix:  # on the first text, as in the plain-text form
        first = content[0]["text"] if content[0]["type"] == "text" else ""
        content = [{"type": "text", "text": prefix + first}] + content[1 if first else 0:]
    return {"role": "tool", "tool_call_id": b.tool_use_id, "content": content}


def _structured(m: Message, media: bool = False) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-style turns: tool results first (each its own tool turn),
    then the text (and, with `media`, the images in their place), with tool_use blocks as the
    assistant's tool calls."""
    blocks = m.content if isinstance(m.content, list) else []
    turns = [_tool_turn(b, media) for b in blocks if b.type == "tool_result"]
    said = [b for b in blocks if b.type in ("text", "image")]
    text = _chat_content(said, media, "\n".join(b.text or "" for b in blocks if b.type == "text"))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}}
             for b in blocks if b.type == "tool_use"]
    if text or calls or not turns:
        turns.append({"role": m.role, "content": text, **({"tool_calls": calls} if calls else {})})
    return turns


class MessagesRequest(Lenient):
    """Both routes' body. `max_tokens` is required by Anthropic but optional here (whatever fits,
    as on the OpenAI routes); a missing `model` means the one model served."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    thinking: Any = None  # {"type": "enabled", "budget_tokens": N} | {"type": "adaptive"} | {"type": "disabled"}
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "none"} or {"type": "tool", "name": N}

    def function_tools(self) -> list[dict[str, Any]]:
        """The client tools in OpenAI's shape; server tools (web_search, ...) have no input_schema
        and nothing here could run them, so they are left out."""
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                  "parameters": t.get("input_schema") or {"type": "object"}}}
                for t in self.tools or [] if isinstance(t, dict) and isinstance(t.get("name"), str) and "input_schema" in t]

    def choice(self) -> str | None:
        """`tool_choice` in the OpenAI vocabulary the tool plan takes."""
        kind = (self.tool_choice or {}).get("type")
        if kind == "tool":
            return str(self.tool_choice.get("name"))
        return {"any": "required", "none": "none", "auto": "auto"}.get(kind)

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` as the template's thinking switch (budget_tokens has no template equivalent)."""
        return thinking_template_kwargs(thinking_switch(self.thinking))

    def template_messages(self, structured: bool = False, media: bool = False) -> list[dict[str, Any]]:
        """Chat-template dicts; system prompts inside `messages` are merged into the top-level one
        (what vLLM does: models trained on one leading system turn degrade on scattered ones).
        `structured`: tool_use / tool_result blocks as OpenAI tool calls and tool turns (for a request
        with tools), else as text. `media`: image blocks as OpenAI image parts in their place (a
        message with one gets a content array), else dropped."""
        system = [_text(self.system)] + [_text(m.content) for m in self.messages if m.role == "system"]
        system_text = "\n\n".join(s for s in system if s)
        turns = [{"role": "system", "content": system_text}] if system_text else []
        for m in self.messages:
            if m.role == "system":
                continue
            turns += (_structured(m, media) if structured and isinstance(m.content, list)
                      else [{"role": m.role, "content": _chat_content(m.content, media, _text(m.content))}])
        return turns

    def media_parts(self) -> list[tuple[str, str]]:
        """(path, type) of every block in `system` and `messages`, tool results' own blocks included."""
        parts = list(content_parts(self.model_dump()["system"], "system", ANTHROPIC, nested="content"))
        for i, m in enumerate(self.messages):
            parts += content_parts(m.model_dump()["content"], f"messages.{i}.content", ANTHROPIC, nested="content")
        return parts

    def sampling(self) -> SamplingFields:
        return SamplingFields(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              stop=[s for s in self.stop_sequences or [] if s])


# ---- errors --------------------------------------------------------------------------------------


class AnthropicRoute(APIRoute):
    """Every failure on these routes, auth (a dependency) included, answers in Anthropic's shape
    rather than the app-wide OpenAI envelope."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return anthropic_response(exc)
            except RequestValidationError as exc:
                return anthropic_response(errors.from_validation(exc.errors()))
            except HTTPException as exc:
                return anthropic_response(APIError(exc.status_code, str(exc.detail)))
            except ClientDisconnect:  # hung up before its body arrived (errors._on_disconnect)
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 - a 500 the SDK can read
                log.error("unhandled error on %s", request.url.path, exc_info=exc)
                return anthropic_response(errors.server_error())

        return route


_FIELDS = frozenset(name for m in (MessagesRequest, Message, Block) for name in m.model_fields)


def validated_request(body: Any) -> MessagesRequest:
    """A Messages body as the request every reader may trust (this route and the gateway's translation):
    its fields' types, the roles and the tools checked, each failure a 400 naming the field."""
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        # the most specific failure (a union's members fail each in its own way: `content` is no string,
        # and its block 0's text is none either), its location without the union members' tags
        first = errors.most_specific(exc.errors(include_url=False))
        where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in _FIELDS)
        message = f"{where}: {first['msg']}" if where else f"The request body is invalid: {first['msg']}"
        raise APIError(400, message) from None
    for i, m in enumerate(req.messages):
        one_of(m.role, ANTHROPIC_ROLES, f"messages.{i}.role")
    for k, block in enumerate(req.system if isinstance(req.system, list) else []):
        if block.type != "text":  # Anthropic's system takes text blocks only; an image there was dropped unseen
            raise APIError(400, f"system.{k}: the system prompt takes text blocks only, but this one is "
                                f"{block.type!r}. Put it in a user message.")
    check_anthropic_tools(req.tools, req.tool_choice)
    return req


async def _parse(request: Request) -> MessagesRequest:
    return validated_request(await read_body(request, ANTHROPIC))


# ---- responses -----------------------------------------------------------------------------------


def _stop_reason(engine: "AsyncEngine", final: RequestOutput, text: str, token_ids: list[int],
                 stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine reports "stop" both for EOS and for a stop string,
    and cuts the string off the text; the raw decoded tokens show which string, if any, it was."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.finish_reason != "stop":
        raise errors.server_error(f"generation ended with finish reason {final.finish_reason!r}")
    if stops:
        raw = engine.tokenizer.decode(token_ids)
        hits = [(i, s) for i, s in ((raw.find(s, max(len(text) - 1, 0)), s) for s in stops) if i >= 0]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _event(kind: str, data: dict[str, Any]) -> str:
    """One SSE event the way the Anthropic SDK parses it: an `event:` line, then the JSON."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'), ensure_ascii=False)}\n\n"


def thinking_signature(thinking: str) -> str:
    """A thinking block's `signature`. Anthropic's is an opaque token that Claude Code echoes back
    and we never verify (earlier thinking is dropped from prompts), so a digest of the text does."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _content(text: str, reasoning: RequestReasoning | None, tools: ToolPlan | None) -> tuple[list[dict[str, Any]], bool]:
    """The content blocks of an answer (a thinking block first when the model thought, then the
    text, then tool_use blocks), and whether it calls tools."""
    thought, text, calls = parse_answer(text, reasoning, tools)
    blocks = [{"type": "thinking", "thinking": thought, "signature": thinking_signature(thought)}] if thought is not None else []
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": tool_input(c.arguments)} for c in calls]
    return blocks, bool(calls)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"_raw": arguments}  # a call whose arguments the model left unfinished


def message_body(mid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


class _Blocks:
    """The content blocks of a streamed message, in order: each opened by content_block_start,
    filled by deltas, closed by content_block_stop; a thinking block gets its signature_delta
    just before it closes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.thought: list[str] = []

    def _switch(self, kind: str, start: dict[str, Any] | None = None) -> list[str]:
        if self.kind == kind and start is None:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        if start is None:
            start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
        return events + [_event("content_block_start", {"index": self.index, "content_block": start})]

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        """OpenAI tool-call deltas as tool_use blocks: a header opens one, fragments fill it."""
        events = []
        for d in deltas:
            if "id" in d:
                events += self._switch("tool_use", {"type": "tool_use", "id": tool_use_id(d["id"]),
                                                    "name": d["function"]["name"], "input": {}})
            fragment = d["function"].get("arguments")
            if fragment:
                events.append(_event("content_block_delta", {"index": self.index,
                                                             "delta": {"type": "input_json_delta", "partial_json": fragment}}))
        return events

    def add(self, thought: str, text: str) -> list[str]:
        events = []
        if thought:
            self.thought.append(thought)
            events += self._switch("thinking")
            events.append(_event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "thinking_delta", "thinking": thought}}))
        if text:
            events += self._switch("text")
            events.append(_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}}))
        return events

    def close(self) -> list[str]:
        events = []
        if self.kind == "thinking":
            signature = thinking_signature("".join(self.thought))
            events.append(_event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "signature_delta", "signature": signature}}))
        if self.kind is not None:
            events.append(_event("content_block_stop", {"index": self.index}))
        self.kind = None
        return events

    def finish(self, called: bool = False) -> list[str]:
        """Close the last block; an answer always has a text block (if only an empty one) or a call."""
        if called:
            return self.close()
        return (self._switch("text") if self.kind != "text" else []) + self.close()


@dataclass
class StreamEnd:
    """How a streamed message ended: message_delta's fields."""

    stop_reason: str
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int


async def message_events(deltas: AsyncIterator[AnswerDelta], mid: str, model: str, input_tokens: int,
                         end: Callable[[bool], StreamEnd], text_first: bool = False) -> AsyncIterator[str]:
    """A Messages stream from answer deltas (thinking, text, OpenAI-style tool-call deltas): exactly one
    message_start, message_delta and message_stop; `end(called)` gives the stop reason and usage once
    the deltas are over. An APIError from `deltas` after the 200 is one `event: error` (which the SDK
    raises), and then no message_delta / message_stop, as Anthropic does. `text_first`: open the text
    block at once (nothing can come before it); otherwise the first block opens once the output shows
    whether it is thinking, text or a call. Shared by the builtin route and the gateway's translation."""
    blocks = _Blocks()
    called = False
    try:
        yield _event("message_start", {"message": message_body(mid, model, [], (None, None), input_tokens, 0)})
        if text_first:
            for event in blocks._switch("text"):
                yield event
        yield _event("ping", {})
        async for d in deltas:
            called = called or bool(d.tool_calls)
            for event in blocks.add(d.thought, d.content) + blocks.tool_calls(d.tool_calls):
                yield event
        result = end(called)
        for event in blocks.finish(called):
            yield event
        yield _event("message_delta", {"delta": {"stop_reason": result.stop_reason, "stop_sequence": result.stop_sequence},
                                       "usage": {"input_tokens": result.input_tokens,
                                                 "output_tokens": result.output_tokens}})
        yield _event("message_stop", {})
    except APIError as exc:
        body = json.loads(anthropic_response(exc).body)
        yield _event("error", {"error": body["error"]})


async def _events(engine: "AsyncEngine", gen: Generation, first: tuple[int, RequestOutput], mid: str, model: str,
                  stops: list[str], reasoning: RequestReasoning | None = None,
                  tools: ToolPlan | None = None) -> AsyncIterator[str]:
    """The builtin route's stream: the engine's outputs through the answer parser."""
    input_tokens = len(gen.jobs[0].prompt_ids)
    parser = AnswerParser(reasoning, tools)
    parts: list[str] = []
    ids: list[int] = []

    async def deltas() -> AsyncIterator[AnswerDelta]:
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                out = item[1]
                ids.extend(out.token_ids)
                parts.append(out.text)
                yield parser.feed(out.text, finished=out.finished)
                item = await gen.next() if not gen.done else None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band by message_events
            raise errors.from_generation(exc, "messages") from None

    def end(called: bool) -> StreamEnd:
        final = gen.finals[0]
        cut = final.finish_reason == "length"
        reason, sequence = ("tool_use", None) if called and not cut else _stop_reason(engine, final, "".join(parts), ids, stops)
        return StreamEnd(reason, sequence, input_tokens, final.num_output_tokens)

    try:
        async for event in message_events(deltas(), mid, model, input_tokens, end,
                                          text_first=reasoning is None and tools is None):
            yield event
    except asyncio.CancelledError:
        log.info("%s: client disconnected mid-stream, aborted", mid)
        raise
    finally:
        gen.close()


# ---- routes --------------------------------------------------------------------------------------


def anthropic_router(slot: EngineSlot, names: ModelNames, auth: Callable[[Request], Any],
                     settings: ServerSettings) -> APIRouter:
    """The Messages routes; `auth` is the app's key check (it takes `x-api-key` or Bearer);
    `style` the model's reasoning tags (None: no thinking blocks); `max_waiting` the queue bound."""
    router = APIRouter(prefix="/v1/messages", dependencies=[Depends(auth)], route_class=AnthropicRoute)

    async def prepare(req: MessagesRequest) -> tuple["AsyncEngine", str, list[int], RequestReasoning | None,
                                                     ToolPlan | None, list | None]:
        """Engine, the model name to echo (bare: Anthropic echoes the id without `[1m]`), prompt ids,
        how to split reasoning from the answer, the request's tools and its media items."""
        names.resolve(req.model)  # 404 for a name we do not serve
        model = strip_context_suffix(req.model) if req.model and req.model.strip() else names.canonical
        engine = slot.get()
        refuse_media(req.media_parts(), engine.input_modalities, model)
        tools = tool_plan(engine, req.function_tools(), req.choice(), settings.tool_call_parser)
        prompt, prompt_text, media = await chat_prompt(
            engine, req.template_messages(structured=tools is not None, media=takes_media(engine)), req.template_kwargs(),
            tools, media=settings.media)
        return engine, model, prompt, RequestReasoning.for_prompt(settings.style, prompt_text), tools, media

    @router.post("")
    async def create_message(request: Request) -> Response:
        req = await _parse(request)
        engine, model, prompt, reasoning, tools, media = await prepare(req)
        mid = f"msg_{uuid.uuid4().hex}"
        sampling = req.sampling()
        stops = sampling.stop_list()
        grammar = check_grammar(engine, tools.grammar(engine.tokenizer), "tool_choice") if tools is not None else None
        gen = settings.generation(engine, make_jobs(engine, settings, sampling, req.max_tokens, [prompt], mid,
                                                    media=media, anthropic=True, grammar=grammar),
                                  overload_status=529)
        if req.stream:
            first = await first_output(request, gen, "messages")
            if first is None:
                return Response(status_code=499)
            return EventStream(_events(engine, gen, first, mid, model, stops, reasoning, tools), gen.close)

        outputs = await collect(request, gen, "messages")
        if outputs is None:
            return Response(status_code=499)
        text = "".join(out.text for out in outputs[0])
        ids = [token for out in outputs[0] for token in out.token_ids]
        final = gen.finals[0]
        content, called = _content(text, reasoning, tools)
        cut = final.finish_reason == "length"
        stop = ("tool_use", None) if called and not cut else _stop_reason(engine, final, text, ids, stops)
        return JSONResponse(message_body(mid, model, content, stop, len(prompt), final.num_output_tokens))

    @router.post("/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        """The prompt as generation would see it (chat template applied), without generating."""
        _, _, prompt, _, _, _ = await prepare(await _parse(request))
        return {"input_tokens": len(prompt)}

    return router
