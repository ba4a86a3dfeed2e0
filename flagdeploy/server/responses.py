"""The OpenAI Responses API, stateless: `POST /v1/responses`, streamed or not.

Codex speaks only this protocol (and LangChain switches to it for models named "*codex*"). Codex
sends `store: false` and the whole conversation as `input` items every turn, so no server-side state
is needed: `previous_response_id` is refused with a 400 that says so.

A request is turned into the chat path's pieces (template messages, tool plan, grammar, the same
generation and answer parsing), and the answer into Responses output items: a `reasoning` item
when the model thought, a `message` with `output_text`, and one `function_call` per tool call.
Streams are `event:`-framed and numbered (`sequence_number`), from `response.created` to exactly
one `response.completed` (or `response.incomplete` when max_output_tokens cut it, or an `error`
and `response.failed` when the generation failed or ran past --request-timeout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from flagdeploy.engine.grammar import GrammarSpec
from flagdeploy.engine.request import RequestOutput

from . import errors
from .answer import AnswerDelta, AnswerParser, parse_answer
from .engine_slot import EngineSlot
from .errors import APIError
from .generation import EventStream, Generation, collect
from .media import takes_media
from .names import ModelNames
from .pipeline import ServerSettings, chat_prompt, check_grammar, first_output, make_jobs, tool_plan
from .protocol import Lenient, SamplingFields, now
from .reasoning import RequestReasoning
from .tools import ToolPlan
from .validate import (OPENAI, check_responses_input, check_responses_tools, content_parts, read_body,
                       refuse_media)

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -------------------------------------------------------------------------------------


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextOptions(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None

    def function_tools(self) -> list[dict[str, Any]]:
        """Function tools in the chat shape, those `allowed_tools` names if it is the tool_choice;
        built-in tools (web_search, ...) cannot run here."""
        c = self.tool_choice
        allowed = {t["name"] for t in c["tools"]} if isinstance(c, dict) and c["type"] == "allowed_tools" else None
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in self.tools or [] if t.get("type") == "function" and isinstance(t.get("name"), str)
                and (allowed is None or t["name"] in allowed)]

    def choice(self) -> str | None:
        """In the chat vocabulary (checked before: validate.check_responses_tools)."""
        c = self.tool_choice
        if isinstance(c, dict):
            return c["name"] if c["type"] == "function" else c.get("mode", "auto")
        return c

    def grammar(self) -> GrammarSpec | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "Missing required parameter: 'text.format.schema' (a json_schema format needs "
                                "the schema; `{\"type\": \"json_object\"}` asks for any JSON object).",
                           param="text.format.schema")
        return GrammarSpec("json_schema", fmt.schema_ if fmt.type == "json_schema" else {"type": "object"})

    def media_parts(self) -> list[tuple[str, str]]:
        """(path, type) of every content part of the input items."""
        if isinstance(self.input, str):
            return []
        return [part for i, item in enumerate(self.input)
                for part in content_parts(item.get("content"), f"input[{i}].content", OPENAI)]

    def template_kwargs(self) -> dict[str, Any]:
        effort = (self.reasoning or {}).get("effort")
        return {"reasoning_effort": effort} if isinstance(effort, str) else {}

    def messages(self, media: bool = False) -> list[dict[str, Any]]:
        """The input items as chat turns: messages by role (developer is system), function calls as
        the assistant's tool calls (consecutive ones in one turn), their outputs as tool turns;
        reasoning items are dropped (earlier thinking does not go back into prompts). `media`:
        `input_image` parts as OpenAI image parts in their place (not in system turns), else dropped."""
        turns: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return turns + [{"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role", "user")
                role = "system" if role == "developer" else role
                turns.append({"role": role, "content": _item_content(item.get("content"), media and role != "system")})
            elif kind == "function_call":
                call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                if turns and turns[-1]["role"] == "assistant" and "tool_calls" in turns[-1]:
                    turns[-1]["tool_calls"].append(call)
                elif turns and turns[-1]["role"] == "assistant":
                    turns[-1]["tool_calls"] = [call]
                else:
                    turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                turns.append({"role": "tool", "tool_call_id": item.get("call_id"),
                              "content": output if isinstance(output, str) else _item_content(output, media)})
        # system turns anywhere merge into one leading system prompt, as on /v1/messages
        system = "\n\n".join(t["content"] for t in turns if t["role"] == "system" and t["content"])
        rest = [t for t in turns if t["role"] != "system"]
        return ([{"role": "system", "content": system}] if system else []) + rest


def _item_text(content: Any) -> str:
    """An item's text parts joined by newlines (their types were checked: validate.check_responses_input)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("text"))


def _item_content(content: Any, media: bool) -> str | list[dict[str, Any]]:
    """An item's content as chat content: its text (`_item_text`), or, with `media` and an
    `input_image` among the parts, OpenAI parts in order (consecutive text joined by newlines)."""
    parts = content if media and isinstance(content, list) else []
    if not any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
        return _item_text(content)
    out: list[dict[str, Any]] = []
    run: list[str] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if part.get("text"):
            run.append(part["text"])
        elif part.get("type") == "input_image":
            if run:
                out.append({"type": "text", "text": "\n".join(run)})
                run = []
            out.append(_image_part(part))
    return out + ([{"type": "text", "text": "\n".join(run)}] if run else [])


def _image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An `input_image` part ({"image_url": URL, "detail"?}) as an OpenAI chat image part."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        given = "a file_id" if part.get("file_id") else f"image_url {json.dumps(url)}"
        raise APIError(400, f"An input_image part needs `image_url` (a data: URL or an http(s) URL), but it has {given}. "
                            "This server keeps no files: send the image itself as a base64 data: URL.",
                       param="input")
    image = {"url": url} | ({"detail": part["detail"]} if isinstance(part.get("detail"), str) else {})
    return {"type": "image_url", "image_url": image}


# The request's field names (a location part that is none is a union member's tag, dropped from `param`)
_FIELDS = frozenset(name for m in (ResponsesRequest, TextOptions, TextFormat) for name in m.model_fields) | {"schema"}


def validated_request(body: Any) -> ResponsesRequest:
    """A Responses body as the request every reader may trust (this route and the gateway's translation):
    its fields' types, the input items and the tools checked, each failure a 400 naming the field."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False), _FIELDS) from None
    check_responses_input(req.input)
    check_responses_tools(req.tools, req.tool_choice)
    return req


async def _parse(request: Request) -> ResponsesRequest:
    return validated_request(await read_body(request))


# ---- output items --------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def reasoning_item(item_id: str, thought: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": thought}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_body(rid: str, created: int, model: str, req: ResponsesRequest, output: list[dict[str, Any]],
              status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "temperature": req.temperature, "top_p": req.top_p, "text": {"format": {"type": "text"}},
            "reasoning": req.reasoning, "store": False, "metadata": {}}


def _usage(gen: Generation) -> dict[str, Any]:
    prompt, cached = gen.prompt_usage()
    return usage_body(prompt, gen.completion_tokens(), cached)


def _status(final: RequestOutput) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


# ---- stream --------------------------------------------------------------------------------------


class _Events:
    """Numbered, `event:`-framed Responses events, and the output items as they open and close."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        events = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": []}
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=self.text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
            item = message_item(item["id"], self.text)
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=self.text))
            item = reasoning_item(item["id"], self.text)
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        self.output.append(item)
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def _start(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open, self.text = item, ""
        index = len(self.output)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def empty_message(self) -> list[str]:
        return self._start({"type": "message", "id": new_item_id("msg"), "status": "in_progress", "role": "assistant", "content": []})

    def thought(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open and self.open["type"] == "reasoning" else self._start(
            {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": []})
        self.text += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                    output_index=len(self.output), content_index=0, delta=delta)]

    def content(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open and self.open["type"] == "message" else self.empty_message()
        self.text += delta
        return events + [self.event("response.output_text.delta", item_id=self.open["id"],
                                    output_index=len(self.output), content_index=0, delta=delta, logprobs=[])]

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        events = []
        for d in deltas:
            if "id" in d:
                events += self._start(call_item(new_item_id("fc"), d["id"], d["function"]["name"], "", "in_progress"))
            fragment = d["function"].get("arguments")
            if fragment and self.open is not None:
                self.open["arguments"] += fragment
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.output), delta=fragment))
        return events


async def response_events(deltas: AsyncIterator[AnswerDelta], rid: str, model: str, req: ResponsesRequest,
                          end: Callable[[], tuple[str, dict[str, Any]]]) -> AsyncIterator[str]:
    """A Responses stream from answer deltas: response.created and .in_progress, the items as they open
    and close, then exactly one response.completed / .incomplete with `end()`'s (status, usage). An
    APIError from `deltas` after the 200 is one `error` event. Shared by the builtin route and the
    gateway's translation."""
    created, ev = now(), _Events()
    try:
        for kind in ("response.created", "response.in_progress"):
            yield ev.event(kind, response=response_body(rid, created, model, req, [], "in_progress", None))
        async for d in deltas:
            for event in ev.thought(d.thought) + ev.content(d.content) + ev.tool_calls(d.tool_calls):
                yield event
        for event in ev.close():
            yield event
        if not ev.output:  # an empty answer is still one (empty) message
            for event in ev.empty_message() + ev.close():
                yield event
        status, usage = end()
        done = response_body(rid, created, model, req, ev.output, status, usage)
        yield ev.event("response.completed" if status == "completed" else "response.incomplete", response=done)
    except APIError as exc:  # the error, then the response as failed: a stream still ends in its final state
        yield ev.event("error", code=exc.code, message=exc.message, param=exc.param)
        failed = response_body(rid, created, model, req, ev.output, "failed", None)
        yield ev.event("response.failed", response=failed | {"error": {"code": exc.code or exc.type,
                                                                        "message": exc.message}})


async def _stream(gen: Generation, first: tuple[int, RequestOutput], rid: str, model: str, req: ResponsesRequest,
                  reasoning: RequestReasoning | None, tools: ToolPlan | None) -> AsyncIterator[str]:
    """The builtin route's stream: the engine's outputs through the answer parser."""
    parser = AnswerParser(reasoning, tools)

    async def deltas() -> AsyncIterator[AnswerDelta]:
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                yield parser.feed(item[1].text, finished=item[1].finished)
                item = await gen.next() if not gen.done else None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band by response_events
            raise errors.from_generation(exc, "input") from None

    try:
        async for event in response_events(deltas(), rid, model, req, lambda: (_status(gen.finals[0]), _usage(gen))):
            yield event
    except asyncio.CancelledError:
        log.info("%s: client disconnected mid-stream, aborted", rid)
        raise
    finally:
        gen.close()


def usage_body(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


# ---- route ---------------------------------------------------------------------------------------


def responses_router(slot: EngineSlot, names: ModelNames, auth: Callable[[Request], Any],
                     settings: ServerSettings) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    @router.post("/responses")
    async def create_response(request: Request) -> Response:
        req = await _parse(request)
        if req.previous_response_id:
            raise APIError(400, "previous_response_id is not supported: this server keeps no response state. "
                                "Send the whole conversation as `input` (what Codex does with store=false).",
                           param="previous_response_id")
        model = names.resolve(req.model)
        engine: "AsyncEngine" = slot.get()
        rid = new_item_id("resp")
        refuse_media(req.media_parts(), engine.input_modalities, model)
        tools = tool_plan(engine, req.function_tools(), req.choice(), settings.tool_call_parser)
        prompt, prompt_text, media = await chat_prompt(engine, req.messages(media=takes_media(engine)),
                                                       req.template_kwargs(), tools, "input", settings.media)
        reasoning = RequestReasoning.for_prompt(settings.style, prompt_text)
        grammar, param = (tools.grammar(engine.tokenizer), "tool_choice") if tools and tools.forced else (req.grammar(), "text.format")
        sampling = SamplingFields(temperature=req.temperature, top_p=req.top_p)
        gen = settings.generation(engine, make_jobs(engine, settings, sampling, req.max_output_tokens, [prompt], rid,
                                                    "max_output_tokens", "input", media,
                                                    grammar=check_grammar(engine, grammar, param)))
        if req.stream:
            first = await first_output(request, gen, "input")
            if first is None:
                return Response(status_code=499)
            return EventStream(_stream(gen, first, rid, model, req, reasoning, tools), gen.close)
        outputs = await collect(request, gen, "input")
        if outputs is None:
            return Response(status_code=499)
        thought, text, calls = parse_answer("".join(o.text for o in outputs[0]), reasoning, tools)
        items = [reasoning_item(new_item_id("rs"), thought)] if thought else []
        if text or not calls:
            items.append(message_item(new_item_id("msg"), text))
        items += [call_item(new_item_id("fc"), c.id, c.name, c.arguments) for c in calls]
        return JSONResponse(response_body(rid, now(), model, req, items, _status(gen.finals[0]), _usage(gen)))

    return router
