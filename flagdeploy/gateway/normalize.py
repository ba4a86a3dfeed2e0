"""Make every engine's OpenAI dialect look like ours before a client sees it.

Engines behind the gateway (vLLM, SGLang, MindIE, llama.cpp) each speak "OpenAI-compatible" a little
differently, and the clients we serve (LangChain, Dify, CC Switch; ../shared/docs/clients.md) break on
exactly those differences. Everything here is pure data in, data out, so that it is tested on recorded
chunk shapes without any server:

- reasoning text: vLLM >= 0.12 sends `reasoning`, SGLang/DeepSeek `reasoning_content`, clients read
  one or the other: both are always filled.
- usage in streams: upstream is always asked for it (`stream_options.include_usage`), so that the
  gateway knows the counts; the client gets exactly one final `choices: []` usage chunk if, and only
  if, it asked. An upstream that never sends one (llama-cpp-python ignores `stream_options`) gets a
  counted one, see `StreamNormalizer.counted_usage`.
- streamed tool calls: every delta carries `index`; `id`, `type` and `function.name` only in the
  first delta of each call (LangChain drops calls without index and concatenates repeated names).
- the model name: our served name, never the upstream's.
- errors: upstream bodies in any of the shapes engines use become our OpenAI envelope; 4xx stay 4xx
  (422 becomes 400: the SDKs never expect 422), 5xx become 503 with Retry-After, because the failure
  is the engine's and a retry (maybe on another replica) can succeed.
- which stop sequence ended a choice: vLLM says it in `stop_reason`, SGLang in `matched_stop`;
  llama-cpp-python and llama.cpp's OpenAI routes say only "stop". For those, `StopMatcher` applies
  the stop sequences here and reports the match the way vLLM does.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from flagdeploy.server.errors import APIError

RETRY_AFTER_S = 5  # what a client is told to wait after an upstream failure; engines restart in seconds


# ---- requests ------------------------------------------------------------------------------------


def prepare_request(body: dict[str, Any], upstream_model: str | None) -> tuple[dict[str, Any], bool]:
    """The body to send upstream, and whether the client asked for stream usage.

    The upstream's own model name replaces ours (vLLM refuses names it does not serve). In a stream,
    usage is always requested: the gateway needs the counts, and drops the chunk if the client did
    not ask for it.
    """
    out = dict(body)
    if upstream_model:
        out["model"] = upstream_model
    options = body.get("stream_options")
    wants_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    if body.get("stream"):
        out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    else:
        out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    return out, wants_usage


# ---- messages and deltas -------------------------------------------------------------------------


def mirror_reasoning(part: dict[str, Any]) -> None:
    """Fill both `reasoning_content` and `reasoning` from whichever the engine sent (in place)."""
    thought = part.get("reasoning_content")
    if thought is None:
        thought = part.get("reasoning")
    if thought is not None:
        part["reasoning_content"] = thought
        part["reasoning"] = thought


def normalize_response(body: dict[str, Any], model: str) -> dict[str, Any]:
    """A non-streamed chat or text completion: our model name, both reasoning fields, typed tool calls."""
    body = dict(body)
    body["model"] = model
    for choice in body.get("choices") or []:
        message = choice.get("message")
        if isinstance(message, dict):
            mirror_reasoning(message)
            for call in message.get("tool_calls") or []:
                call.setdefault("type", "function")
    return body


@dataclass
class _ToolCalls:
    """What one choice has streamed of its tool calls: upstream index/id -> our index, names sent."""

    by_id: dict[str, int] = field(default_factory=dict)
    by_upstream_index: dict[int, int] = field(default_factory=dict)
    opened: set[int] = field(default_factory=set)
    last: int | None = None

    def place(self, delta: dict[str, Any]) -> int:
        """Our index for one tool-call delta. An id not seen before opens a new call; a delta with
        neither a known index nor an id continues the last call (what engines that omit `index` mean)."""
        call_id = delta.get("id")
        up = delta.get("index")
        if isinstance(up, int) and up in self.by_upstream_index:
            index = self.by_upstream_index[up]
        elif call_id and call_id in self.by_id:
            index = self.by_id[call_id]
        elif call_id or self.last is None or isinstance(up, int):
            index = self._next()
        else:
            index = self.last
        if isinstance(up, int):
            self.by_upstream_index.setdefault(up, index)
        if call_id:
            self.by_id.setdefault(call_id, index)
        self.last = index
        return index

    def _next(self) -> int:
        known = set(self.by_id.values()) | set(self.by_upstream_index.values()) | self.opened
        return max(known) + 1 if known else 0


def _normalize_tool_deltas(calls: _ToolCalls, deltas: list[Any]) -> list[dict[str, Any]]:
    out = []
    for raw in deltas:
        if not isinstance(raw, dict):
            continue
        index = calls.place(raw)
        fn = dict(raw.get("function") or {})
        delta: dict[str, Any] = {"index": index}
        if index not in calls.opened:
            calls.opened.add(index)
            delta["id"] = raw.get("id") or f"call_{secrets.token_hex(12)}"
            delta["type"] = raw.get("type") or "function"
            first_fn = {"name": fn.get("name") or ""}
            if fn.get("arguments"):
                first_fn["arguments"] = fn["arguments"]
            else:
                first_fn["arguments"] = ""
            delta["function"] = first_fn
        else:
            if fn.get("arguments"):
                delta["function"] = {"arguments": fn["arguments"]}
            else:
                continue  # only a repeated id/name: nothing left to send
        out.append(delta)
    return out


# ---- stop sequences ------------------------------------------------------------------------------

STOP_SIGNALS = ("stop_reason", "matched_stop")  # vLLM's, SGLang's: the stop string (or token id) that hit


def matched_stop(choice: dict[str, Any]) -> Any:
    """The engine's own word on what ended a finished choice: the stop string, a stop token id, or
    None (EOS, the length limit, or an engine that does not say)."""
    return next((choice[k] for k in STOP_SIGNALS if choice.get(k) is not None), None)


def says_which_stop(choice: dict[str, Any]) -> bool:
    """Whether a finished choice comes from an engine that reports its stop: vLLM and SGLang put
    the key in every finished choice (null after EOS); the others never do."""
    return choice.get("finish_reason") is not None and any(k in choice for k in STOP_SIGNALS)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(where, which) of the earliest stop sequence in `text`."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could still grow into a stop sequence."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def counted_usage(output_chunks: int) -> dict[str, Any]:
    """Usage when the upstream sent none: completion tokens are the chunks that carried output
    (engines stream one token per chunk; a multi-byte character held back makes it a slight
    undercount); the prompt is not tokenized here, so prompt_tokens is 0. `estimated` marks it."""
    return {"prompt_tokens": 0, "completion_tokens": output_chunks, "total_tokens": output_chunks, "estimated": True}


def _carries_output(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


class StopMatcher:
    """Stop sequences applied to a normalised chat stream, for an engine that cannot say which one
    stopped it (it is then not sent them): the answer's text, minus the end that could still grow
    into a stop sequence, goes on chunk by chunk; on a match, the text before it goes out in a
    finishing chunk shaped as vLLM's (finish_reason "stop", stop_reason: the sequence), then a
    counted usage chunk (the engine's own would come at the end, which is not waited for), and `done`
    is set: the caller leaves the upstream stream, and closing it aborts the generation.
    Stop sequences apply to the answer's text, not to reasoning or tool-call arguments."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.done = False
        self._held = ""
        self._chunks = 0
        self._last: dict[str, Any] = {}

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks one normalised chunk becomes (0 to 2)."""
        if self.done or not chunk.get("choices"):
            return [] if self.done else [chunk]
        self._last = chunk
        choice = dict(chunk["choices"][0])
        delta = dict(choice.get("delta") or {})
        self._chunks += int(_carries_output(delta))
        text = self._held + (delta.get("content") or "")
        hit = _first_stop(text, self.stops)
        if hit is not None:
            self.done = True
            choice.update(delta=delta | {"content": text[:hit[0]]}, finish_reason="stop", stop_reason=hit[1])
            usage = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
            return [chunk | {"choices": [choice]}, usage | {"choices": [], "usage": counted_usage(self._chunks)}]
        keep = 0 if choice.get("finish_reason") else _partial_stop(text, self.stops)
        self._held = text[len(text) - keep:] if keep else ""
        if text or "content" in delta:
            delta["content"] = text[:len(text) - keep]
        return [chunk | {"choices": [choice | {"delta": delta}]}]

    def end(self) -> list[dict[str, Any]]:
        """The text still held back when the upstream stream ended without a finishing chunk."""
        if self.done or not self._held or not self._last:
            return []
        held, self._held = self._held, ""
        return [self._last | {"choices": [{"index": 0, "delta": {"content": held}, "finish_reason": None}]}]


# ---- streams -------------------------------------------------------------------------------------


class StreamNormalizer:
    """Rewrites one upstream SSE stream, event by event, into what clients expect.

    Feed each `data:` payload (the JSON text, or `[DONE]`) to `event`; it returns the payloads to send
    (possibly none). Call `end` when the upstream stream ended: it returns what is still owed (the
    usage chunk, `[DONE]`) if the upstream did not send it.
    """

    def __init__(self, model: str, wants_usage: bool, kind: str = "chat"):
        self.model = model
        self.wants_usage = wants_usage
        self.kind = kind  # "chat" (chat.completion.chunk) or "text" (text_completion)
        self.usage: dict[str, Any] | None = None
        self.usage_sent = False
        self.done = False
        self.content_chunks = 0  # chunks that carried generated text: the counted completion tokens
        self.says_which_stop = False  # a finished choice carried vLLM's / SGLang's stop key
        self._template: dict[str, Any] = {}
        self._tools: dict[int, _ToolCalls] = {}

    def event(self, data: str) -> list[str]:
        if self.done:
            return []
        if data.strip() == "[DONE]":
            return self.end()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            return []  # not JSON: nothing a client could parse either
        if not isinstance(chunk, dict):
            return []
        if ("error" in chunk or chunk.get("object") == "error") and "choices" not in chunk:
            message, type_, param, code = _error_fields(chunk)
            self.done = True  # an error event ends the stream (clients raise on it)
            return [_dumps({"error": {"message": message or "The engine failed mid-stream.",
                                      "type": type_ or "server_error", "param": param,
                                      "code": code if isinstance(code, str) else None}})]
        return [_dumps(c) for c in self.chunk(chunk)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks (0 or 1) that one upstream chunk becomes."""
        chunk = dict(chunk)
        chunk["model"] = self.model
        if not self._template:
            self._template = {k: chunk[k] for k in ("id", "object", "created") if k in chunk}
        usage = chunk.pop("usage", None)
        if usage:
            self.usage = usage
        choices = chunk.get("choices")
        if not choices:  # the usage chunk (choices: []), or an empty keep-alive
            return self._usage_chunk() if usage else []
        chunk["choices"] = [self._choice(c) for c in choices if isinstance(c, dict)]
        if self.wants_usage:
            chunk["usage"] = None  # OpenAI: usage null on every chunk but the last
        return [chunk]

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        choice = dict(choice)
        self.says_which_stop |= says_which_stop(choice)
        if self.kind == "text":
            if choice.get("text"):
                self.content_chunks += 1
            return choice
        delta = dict(choice.get("delta") or {})
        mirror_reasoning(delta)
        if delta.get("content") or delta.get("reasoning_content"):
            self.content_chunks += 1
        if delta.get("tool_calls"):
            calls = self._tools.setdefault(choice.get("index", 0), _ToolCalls())
            tool_deltas = _normalize_tool_deltas(calls, delta["tool_calls"])
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
                self.content_chunks += 1
            else:
                delta.pop("tool_calls")
        elif "tool_calls" in delta and not delta["tool_calls"]:
            delta.pop("tool_calls")  # vLLM sends `tool_calls: []`; some clients index [0]
        choice["delta"] = delta
        return choice

    def _usage_chunk(self) -> list[dict[str, Any]]:
        """The one usage chunk the client asked for, once."""
        if not self.wants_usage or self.usage_sent:
            return []
        self.usage_sent = True
        usage = self.usage if self.usage is not None else self.counted_usage()
        body = {**self._template, "object": self._template.get("object", "chat.completion.chunk"),
                "model": self.model, "choices": [], "usage": usage}
        return [body]

    def counted_usage(self) -> dict[str, Any]:
        return counted_usage(self.content_chunks)

    def end(self) -> list[str]:
        """What the stream still owes when the upstream ended (with or without `[DONE]`)."""
        if self.done:
            return []
        self.done = True
        return [_dumps(c) for c in self._usage_chunk()] + ["[DONE]"]


def _dumps(body: Any) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


# ---- errors --------------------------------------------------------------------------------------


def _error_fields(body: Any) -> tuple[str | None, str | None, str | None, Any]:
    """(message, type, param, code) from any error shape engines send."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):  # OpenAI, llama-cpp-python, SGLang >= 0.4
            return err.get("message"), err.get("type"), err.get("param"), err.get("code")
        if isinstance(err, str):  # {"error": "text"} (TGI, some proxies)
            return err, body.get("error_type") or body.get("type"), None, None
        if body.get("object") == "error" or "message" in body:  # vLLM < 0.9, SGLang: ErrorResponse at top level
            return body.get("message"), body.get("type"), body.get("param"), body.get("code")
        detail = body.get("detail")  # FastAPI (HTTPException or request validation)
        if isinstance(detail, str):
            return detail, None, None, None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            return (f"Invalid value for '{loc}': {first.get('msg')}" if loc else first.get("msg")), None, loc or None, None
    if isinstance(body, str) and body.strip():
        return body.strip()[:500], None, None, None
    return None, None, None, None


def upstream_error(status: int, body: Any, headers: Any = None) -> APIError:
    """Our APIError for an upstream's error answer (status and parsed body, or its text; `headers` its
    response headers).

    4xx keep their status (the client's request is at fault, whichever engine said so), except 422
    which becomes 400; a 429's Retry-After stays with it (the SDKs wait that long). 5xx become 503 with
    Retry-After: the engine failed, not the request.
    """
    message, type_, param, code = _error_fields(body)
    code = code if isinstance(code, str) else None  # vLLM puts the HTTP status number in `code`
    if 400 <= status < 500:
        status = 400 if status == 422 else status
        if status == 400 and message and ("context length" in message.lower() or "context window" in message.lower()
                                          or "maximum context" in message.lower()) and not code:
            code = "context_length_exceeded"
        retry = (headers or {}).get("retry-after") if status == 429 else None
        return APIError(status, message or f"The engine refused the request (HTTP {status}).",
                        type=type_ if type_ and type_ != "BadRequestError" else "invalid_request_error",
                        param=param, code=code, headers={"Retry-After": retry} if retry else None)
    detail = f": {message}" if message else ""
    return APIError(503, f"The model's engine failed to answer (upstream HTTP {status}{detail}). Retry shortly.",
                    type="service_unavailable_error", code="upstream_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def upstream_unavailable(model: str, why: str, retry_after: int = RETRY_AFTER_S) -> APIError:
    """503 for a model whose engine cannot take the request now (down, restarting, unreachable)."""
    return APIError(503, f"The engine serving `{model}` is not available ({why}). Retry in {retry_after} s; "
                         f"/ready shows each engine's state.", type="service_unavailable_error",
                    code="upstream_unavailable", headers={"Retry-After": str(retry_after)})


def upstream_body(raw: bytes) -> Any:
    """An upstream body as JSON if it is JSON, else as text."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw.decode("utf-8", "replace")
