"""Protocols an upstream engine does not speak, served through its chat completions.

Claude Code (Anthropic Messages) and Codex (OpenAI Responses) must reach a model on vLLM-Ascend,
SGLang or llama.cpp just as they reach a builtin one. Each Dialect turns its protocol's request into
a chat-completions request (the same conversion the builtin routes use: messages, tools,
tool_choice, thinking switch, output format) and the engine's answer (already normalised: usage
chunk, reasoning_content, tool-call deltas with index) back into its protocol, streamed or not,
with the same event builders as the builtin routes so that both look identical to a client.

OpenAI chat and completions pass through unchanged (`PASSTHROUGH`), media parts included. Media of
the other protocols become OpenAI parts, in their place among the text: Anthropic `image` blocks
(base64 source -> a data: URL, url source -> the URL) and Responses `input_image` parts, both as
`{"type": "image_url", "image_url": {"url": ...}}`.

Claude Code also needs what the engine does not send in an OpenAI answer: the prompt's tokens in
the stream's message_start (counted before the request goes, gateway/tokens.py, and set as
`input_tokens`), and which stop sequence ended the answer (the engine's `stop_reason` /
`matched_stop`, or, for an engine that does not say, `normalize.StopMatcher` applied here, with the
upstream asked for a stream that the gateway can leave at the match).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.types import Send

from flagdeploy.server import errors
from flagdeploy.server.answer import AnswerDelta
from flagdeploy.server.anthropic import (MessagesRequest, StreamEnd, message_body, message_events, thinking_signature,
                                         tool_input, tool_use_id)
from flagdeploy.server.anthropic import validated_request as anthropic_request
from flagdeploy.server.errors import APIError
from flagdeploy.server.protocol import now
from flagdeploy.server.responses import (ResponsesRequest, call_item, message_item, new_item_id, reasoning_item,
                                         response_body, response_events, usage_body)
from flagdeploy.server.responses import validated_request as responses_request

from .normalize import StopMatcher, matched_stop
from .send import send_error as send_plain_error

_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


class Dialect:
    """OpenAI itself: bodies and frames pass through."""

    upstream_path: str | None = None  # None: the client's path
    client_stream: bool | None = None  # whether the client gets a stream; None: as the upstream request
    wants_prompt_count = False  # the proxy counts the prompt into `input_tokens` before sending
    clamps_max_tokens = False  # a max_tokens that cannot fit after the prompt: ask again without it
    input_tokens: int | None = None
    request: dict[str, Any] | None = None  # the client's body, in its own protocol

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        async for payload in payloads:
            yield f"data: {payload}\n\n".encode()

    async def collected(self, payloads: AsyncIterator[str]) -> dict[str, Any]:
        """The answer to a client that did not ask for a stream, from an upstream stream."""
        return self.answer(await _collect(payloads))

    async def send_error(self, send: Send, error: APIError) -> None:
        await send_plain_error(send, error)


PASSTHROUGH = Dialect()


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
        if choice.get("finish_reason"):
            state["finish"], state["stop"] = choice["finish_reason"], matched_stop(choice)
        yield AnswerDelta(delta.get("reasoning_content") or "", delta.get("content") or "", delta.get("tool_calls") or [])


def _new_state() -> dict[str, Any]:
    return {"usage": {}, "finish": None, "stop": None}


async def _collect(payloads: AsyncIterator[str]) -> dict[str, Any]:
    """A normalised chat stream as the chat.completion body it stands for (tool-call deltas carry
    `index`, and `id` and the name only in their first delta)."""
    state = _new_state()
    thought: list[str] = []
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for delta in _answer_deltas(payloads, state):
        thought.append(delta.thought)
        text.append(delta.content)
        for d in delta.tool_calls:
            call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            fn = d.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    message = {"role": "assistant", "content": "".join(text), "reasoning_content": "".join(thought) or None,
               "tool_calls": [calls[i] for i in sorted(calls)]}
    choice = {"index": 0, "message": message, "finish_reason": state["finish"], "stop_reason": state["stop"]}
    return {"choices": [choice], "usage": state["usage"]}


async def _matched(payloads: AsyncIterator[str], matcher: StopMatcher) -> AsyncIterator[str]:
    """`payloads` with the stop sequences applied by `matcher`; ends at a match, without reading
    on (the proxy then closes the upstream stream)."""
    async for payload in payloads:
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            yield payload
            return
        for out in matcher.chunk(chunk):
            yield json.dumps(out, ensure_ascii=False)
        if matcher.done:
            break
    for out in matcher.end():
        yield json.dumps(out, ensure_ascii=False)
    yield "[DONE]"


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
    """/v1/messages over an upstream's /v1/chat/completions. `engine_says_stop`: the engine reports
    which stop sequence ended an answer (vLLM, SGLang), so it is sent them; otherwise they are
    matched here (`normalize.StopMatcher`) on a stream, whatever the client asked for."""

    upstream_path = "/v1/chat/completions"
    clamps_max_tokens = True  # as the builtin route under --max-tokens-policy auto: Claude Code asks for 32,000

    def __init__(self, model: str, engine_says_stop: bool = False):
        self.model = model
        self.mid = new_item_id("msg")
        self.engine_says_stop = engine_says_stop
        self.stops: list[str] = []
        self.matcher: StopMatcher | None = None

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        req: MessagesRequest = anthropic_request(body)
        self.request = body
        tools = req.function_tools()
        self.stops = [s for s in req.stop_sequences or [] if s]
        self.matcher = StopMatcher(self.stops) if self.stops and not self.engine_says_stop else None
        self.client_stream = bool(req.stream)
        # message_start carries the prompt's tokens, and a stream left at a stop sequence has no usage.
        self.wants_prompt_count = self.client_stream or self.matcher is not None
        messages = req.template_messages(structured=bool(tools), media=True)
        out: dict[str, Any] = {"model": req.model, "messages": messages,
                               "stream": self.client_stream or self.matcher is not None}
        stop = self.stops if self.stops and self.matcher is None else None
        for key, value in (("max_tokens", req.max_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                           ("top_k", req.top_k), ("stop", stop)):
            if value is not None:
                out[key] = value
        return _with_tools_and_switches(out, tools, req.choice(), req.template_kwargs())

    def _stop(self, finish: str | None, matched: Any) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): "stop_sequence" when what ended the answer is one of the
        request's stop sequences (a stop token id, or EOS, is an end_turn)."""
        if finish == "stop" and isinstance(matched, str) and matched in self.stops:
            return "stop_sequence", matched
        return _ANTHROPIC_STOP.get(finish or "", "end_turn"), None

    def _input_tokens(self, usage: dict[str, Any]) -> int:
        """The engine's prompt tokens when it reported them, else the count made before sending."""
        if usage.get("prompt_tokens") and not usage.get("estimated"):
            return usage["prompt_tokens"]
        return self.input_tokens or 0

    def _payloads(self, payloads: AsyncIterator[str]) -> AsyncIterator[str]:
        return payloads if self.matcher is None else _matched(payloads, self.matcher)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        thought = message.get("reasoning_content")
        calls = message.get("tool_calls") or []
        blocks = [{"type": "thinking", "thinking": thought, "signature": thinking_signature(thought)}] if thought else []
        if message.get("content") or not calls:
            blocks.append({"type": "text", "text": message.get("content") or ""})
        blocks += [{"type": "tool_use", "id": tool_use_id(c.get("id") or new_item_id("call")), "name": c["function"]["name"],
                    "input": tool_input(c["function"].get("arguments") or "")} for c in calls]
        usage = body.get("usage") or {}
        return message_body(self.mid, self.model, blocks, self._stop(choice.get("finish_reason"), matched_stop(choice)),
                        self._input_tokens(usage), usage.get("completion_tokens", 0))

    async def collected(self, payloads: AsyncIterator[str]) -> dict[str, Any]:
        return await super().collected(self._payloads(payloads))

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        state = _new_state()

        def end(called: bool) -> StreamEnd:
            usage = state["usage"]
            stop = ("tool_use", None) if called else self._stop(state["finish"], state["stop"])
            return StreamEnd(*stop, self._input_tokens(usage), usage.get("completion_tokens", 0))

        async for event in message_events(_answer_deltas(self._payloads(payloads), state), self.mid, self.model,
                                          self.input_tokens or 0, end):
            yield event.encode()

    async def send_error(self, send: Send, error: APIError) -> None:
        if error.status == 429:  # a full queue is Anthropic's 529 overloaded_error, as the builtin route answers
            error = APIError(529, error.message, error.type, error.param, error.code, error.headers)
        response = errors.anthropic_response(error)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})


class ResponsesDialect(Dialect):
    """/v1/responses (stateless) over an upstream's /v1/chat/completions."""

    upstream_path = "/v1/chat/completions"

    def __init__(self, model: str):
        self.model = model
        self.rid = new_item_id("resp")
        self.req: ResponsesRequest | None = None

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        req: ResponsesRequest = responses_request(body)
        if req.previous_response_id:
            raise APIError(400, "previous_response_id is not supported: this server keeps no response state. "
                                "Send the whole conversation as `input`.", param="previous_response_id")
        self.req = req
        out: dict[str, Any] = {"model": req.model, "messages": req.messages(media=True), "stream": bool(req.stream)}
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
        items = [reasoning_item(new_item_id("rs"), message["reasoning_content"])] if message.get("reasoning_content") else []
        if message.get("content") or not calls:
            items.append(message_item(new_item_id("msg"), message.get("content") or ""))
        items += [call_item(new_item_id("fc"), c.get("id") or new_item_id("call"), c["function"]["name"],
                             c["function"].get("arguments") or "") for c in calls]
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        return response_body(self.rid, now(), self.model, self.req, items, status, self._usage(body.get("usage") or {}))

    async def frames(self, payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
        assert self.req is not None
        state = _new_state()

        def end() -> tuple[str, dict[str, Any]]:
            return "incomplete" if state["finish"] == "length" else "completed", self._usage(state["usage"])

        async for event in response_events(_answer_deltas(payloads, state), self.rid, self.model, self.req, end):
            yield event.encode()


def dialect_for(path: str, model: str, engine_says_stop: bool = False) -> Dialect:
    """The dialect of a client route; `model` is the name the answer shows; `engine_says_stop`
    whether the engine reports which stop sequence ended an answer."""
    if path == "/v1/messages":
        return AnthropicDialect(model, engine_says_stop)
    if path == "/v1/responses":
        return ResponsesDialect(model)
    return PASSTHROUGH
