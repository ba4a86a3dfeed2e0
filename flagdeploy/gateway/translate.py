"""Protocols an upstream engine does not speak, served through its chat completions.

Claude Code (Anthropic Messages) and Codex (OpenAI Responses) must reach a model on vLLM-Ascend,
SGLang or llama.cpp just as they reach a builtin one. Each Dialect turns its protocol's request into
a chat-completions request (the same conversion the builtin routes use: messages, tools,
tool_choice, thinking switch, output format) and the engine's answer (already normalised: usage
chunk, reasoning_content, tool-call deltas with index) back into its protocol, streamed or not,
with the same event builders as the builtin routes so that both look identical to a client.

OpenAI chat and completions pass through unchanged (`PASSTHROUGH`).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from pydantic import ValidationError
from starlette.types import Send

from flagdeploy.server import errors
from flagdeploy.server.answer import AnswerDelta
from flagdeploy.server.anthropic import (MessagesRequest, StreamEnd, _input, _message, _signature, _tool_use_id,
                                         error_response, message_events)
from flagdeploy.server.errors import APIError
from flagdeploy.server.protocol import now
from flagdeploy.server.responses import (ResponsesRequest, _call_item, _id, _message_item, _reasoning_item, _response,
                                         response_events, usage_body)

_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


class Dialect:
    """OpenAI itself: bodies and frames pass through."""

    upstream_path: str | None = None  # None: the client's path

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        async for payload in payloads:
            yield f"data: {payload}\n\n".encode()

    async def send_error(self, send: Send, error: APIError) -> None:
        from .proxy import _send_error

        await _send_error(send, error)


PASSTHROUGH = Dialect()


def _validated(model: type, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors(include_url=False)) from None


async def _answer_deltas(payloads: AsyncIterator[str], state: dict[str, Any]) -> AsyncIterator[AnswerDelta]:
    """Normalised chat chunks as answer deltas; the usage and finish_reason seen go into `state`, an
    error chunk is raised as an APIError (each protocol reports it in-band its own way)."""
    async for payload in payloads:
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            err = chunk["error"]
            raise APIError(503, err.get("message") or "The engine failed mid-stream.", type="api_error",
                           code=err.get("code"))
        state["usage"] = chunk.get("usage") or state["usage"]
        if not chunk.get("choices"):
            continue
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        state["finish"] = choice.get("finish_reason") or state["finish"]
        yield AnswerDelta(delta.get("reasoning_content") or "", delta.get("content") or "", delta.get("tool_calls") or [])


def _with_tools_and_switches(out: dict[str, Any], tools: list[dict[str, Any]], choice: str | None,
                             template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat request both protocols fill the same way: function tools and tool_choice
    (a function name becomes OpenAI's named choice), template switches, usage in streams."""
    if tools:
        out["tools"] = tools
        if choice is not None:
            out["tool_choice"] = choice if choice in ("auto", "none", "required") else {
                "type": "function", "function": {"name": choice}}
    if template_kwargs:
        out["chat_template_kwargs"] = template_kwargs
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


class AnthropicDialect(Dialect):
    """/v1/messages over an upstream's /v1/chat/completions."""

    upstream_path = "/v1/chat/completions"

    def __init__(self, model: str):
        self.model = model
        self.mid = _id("msg")

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        req: MessagesRequest = _validated(MessagesRequest, body)
        tools = req.function_tools()
        out: dict[str, Any] = {"model": req.model, "messages": req.template_messages(structured=bool(tools)),
                               "stream": bool(req.stream)}
        for key, value in (("max_tokens", req.max_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                           ("top_k", req.top_k), ("stop", req.stop_sequences)):
            if value is not None:
                out[key] = value
        return _with_tools_and_switches(out, tools, req.choice(), req.template_kwargs())

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        thought = message.get("reasoning_content")
        calls = message.get("tool_calls") or []
        blocks = [{"type": "thinking", "thinking": thought, "signature": _signature(thought)}] if thought else []
        if message.get("content") or not calls:
            blocks.append({"type": "text", "text": message.get("content") or ""})
        blocks += [{"type": "tool_use", "id": _tool_use_id(c.get("id") or _id("call")), "name": c["function"]["name"],
                    "input": _input(c["function"].get("arguments") or "")} for c in calls]
        usage = body.get("usage") or {}
        stop = _ANTHROPIC_STOP.get(choice.get("finish_reason"), "end_turn")
        return _message(self.mid, self.model, blocks, (stop, None), usage.get("prompt_tokens", 0),
                        usage.get("completion_tokens", 0))

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        state: dict[str, Any] = {"usage": {}, "finish": None}

        def end(called: bool) -> StreamEnd:
            usage = state["usage"]
            stop = "tool_use" if called else _ANTHROPIC_STOP.get(state["finish"], "end_turn")
            return StreamEnd(stop, None, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

        async for event in message_events(_answer_deltas(payloads, state), self.mid, self.model, 0, end):
            yield event.encode()

    async def send_error(self, send: Send, error: APIError) -> None:
        response = error_response(error)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})


class ResponsesDialect(Dialect):
    """/v1/responses (stateless) over an upstream's /v1/chat/completions."""

    upstream_path = "/v1/chat/completions"

    def __init__(self, model: str):
        self.model = model
        self.rid = _id("resp")
        self.req: ResponsesRequest | None = None

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        req: ResponsesRequest = _validated(ResponsesRequest, body)
        if req.previous_response_id:
            raise APIError(400, "previous_response_id is not supported: this server keeps no response state. "
                                "Send the whole conversation as `input`.", param="previous_response_id")
        self.req = req
        out: dict[str, Any] = {"model": req.model, "messages": req.messages(), "stream": bool(req.stream)}
        for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                           ("top_p", req.top_p)):
            if value is not None:
                out[key] = value
        grammar = req.grammar()
        if grammar is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": grammar.value}}
        return _with_tools_and_switches(out, req.function_tools(), req.choice(), req.template_kwargs())

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return usage_body(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), cached)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.req is not None
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or []
        items = [_reasoning_item(_id("rs"), message["reasoning_content"])] if message.get("reasoning_content") else []
        if message.get("content") or not calls:
            items.append(_message_item(_id("msg"), message.get("content") or ""))
        items += [_call_item(_id("fc"), c.get("id") or _id("call"), c["function"]["name"],
                             c["function"].get("arguments") or "") for c in calls]
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        return _response(self.rid, now(), self.model, self.req, items, status, self._usage(body.get("usage") or {}))

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        assert self.req is not None
        state: dict[str, Any] = {"usage": {}, "finish": None}

        def end() -> tuple[str, dict[str, Any]]:
            return "incomplete" if state["finish"] == "length" else "completed", self._usage(state["usage"])

        async for event in response_events(_answer_deltas(payloads, state), self.rid, self.model, self.req, end):
            yield event.encode()


def dialect_for(path: str, model: str) -> Dialect:
    """The dialect of a client route; `model` is the name the answer shows."""
    if path == "/v1/messages":
        return AnthropicDialect(model)
    if path == "/v1/responses":
        return ResponsesDialect(model)
    return PASSTHROUGH
