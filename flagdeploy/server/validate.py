"""What a request body must be before anything runs: JSON of sane depth, text that is text, media the
served model can take, and tool definitions the model can be told about.

Each failure is a 400 naming the offending field, in the path style of the protocol that was spoken
(`messages[0].content` for OpenAI, `messages.0.content` for Anthropic), so that a client mistake never
reaches the tokenizer, the chat template or the grammar compiler, where it used to become a 500 or,
worse, a silently different request (a dropped image, a tool the model never saw).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from starlette.requests import Request

from . import errors
from .errors import APIError

# Deeper than any real request (a tool schema nests a few levels per object); json's own C parser
# recurses, so a body of 10,000 brackets would otherwise surface as RecursionError.
MAX_JSON_DEPTH = 100

# Content part / block types that carry a medium, and the medium. OpenAI chat: image_url, input_audio,
# file (and vLLM's video_url, audio_url); Responses: input_image, input_file, input_audio; Anthropic:
# image, document.
MEDIA_PARTS = {
    "image_url": "image", "input_image": "image", "image": "image",
    "video_url": "video", "video": "video",
    "input_audio": "audio", "audio_url": "audio",
    "file": "file", "input_file": "file", "document": "file",
}


@dataclass(frozen=True)
class PathStyle:
    """How a protocol spells the location of a field."""

    anthropic: bool = False

    def join(self, base: str, key: str | int) -> str:
        if isinstance(key, int):
            return f"{base}.{key}" if self.anthropic else f"{base}[{key}]"
        return f"{base}.{key}" if base else key


OPENAI = PathStyle()
ANTHROPIC = PathStyle(anthropic=True)


# ---- the body ------------------------------------------------------------------------------------


async def read_body(request: Request, style: PathStyle = OPENAI) -> Any:
    """The request's JSON body (`parse_body`), read only when it comes unencoded."""
    check_content_encoding(request.headers.get("content-encoding", ""))
    return parse_body(await request.body(), style)


def check_content_encoding(encoding: str) -> None:
    """A compressed body would otherwise be "not JSON", a cause no client could guess."""
    encoding = encoding.strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"The request body is sent with Content-Encoding {encoding!r}, which this server does "
                            "not decode. Send the JSON body uncompressed.", code="unsupported_content_encoding")


def parse_body(raw: bytes, style: PathStyle = OPENAI) -> Any:
    """Decode a request body (whatever its Content-Type, as `curl -d` sends form type) and check that
    it nests at most MAX_JSON_DEPTH levels and that every string is valid Unicode text."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep("the body") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise errors.bad_json() from None
    check_tree(body, style)
    return body


def check_tree(body: Any, style: PathStyle = OPENAI) -> None:
    """Iterative (the point is to survive what recursion cannot): depth, and lone UTF-16 surrogates
    (`"\\ud800"` is valid JSON but no text a tokenizer can encode)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(f"`{path}`" if path else "the body")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str):
                _check_text(key, path or "body")
            stack.append((child, style.join(path, key), depth + 1))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise APIError(400, f"Invalid value for '{path}': the text holds a lone UTF-16 surrogate "
                            f"(\\u{ord(bad):04x} at character {exc.start}), which is not a character. Send valid "
                            "UTF-8 text (escape a surrogate pair as both halves, or as the character itself).",
                       param=path or None) from None


def _too_deep(where: str) -> APIError:
    return APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels (at {where}). No request "
                         "needs that; flatten the JSON.")


# ---- conversations -------------------------------------------------------------------------------
# What the routes read from a conversation is checked for type and vocabulary before anything reads it:
# a part of an unknown type was dropped without a word, a text that was no string failed as a 500, an
# unknown role reached the chat template.

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
CHAT_PARTS = ("text", "image_url", "input_audio", "file", "refusal", "video_url", "audio_url")  # OpenAI's, vLLM's
RESPONSES_ROLES = ("user", "assistant", "system", "developer")
RESPONSES_PARTS = ("input_text", "output_text", "refusal", "input_image", "input_file", "input_audio")
ANTHROPIC_ROLES = ("user", "assistant", "system")  # system inside messages: Claude Code >= 2.1.154


def one_of(value: Any, allowed: tuple[str, ...], where: str) -> None:
    if value not in allowed:
        raise APIError(400, f"Invalid value for '{where}': {json.dumps(value)}. Supported values are: "
                            f"{', '.join(repr(a) for a in allowed)}.", param=where)


def check_chat_messages(messages: list[Any]) -> None:
    """Chat's messages (`protocol.ChatMessage`): a known role each, content parts of known types."""
    for i, m in enumerate(messages):
        where = OPENAI.join("messages", i)
        one_of(m.role, CHAT_ROLES, f"{where}.role")
        for k, part in enumerate(m.content if isinstance(m.content, list) else []):
            one_of(part.type, CHAT_PARTS, f"{where}.content[{k}].type")


def check_responses_input(items: str | list[dict[str, Any]]) -> None:
    """Responses' `input`: of the items this server reads (messages, function calls, their outputs) every
    field it reads has its type; other items (reasoning, built-in tools' calls) carry nothing it reads.
    An `item_reference` names an item stored by the server, and this one stores none."""
    for i, item in enumerate([] if isinstance(items, str) else items):
        where = OPENAI.join("input", i)
        kind = item.get("type", "message")
        if kind == "message":
            one_of(item.get("role", "user"), RESPONSES_ROLES, f"{where}.role")
            _responses_content(item.get("content"), f"{where}.content")
        elif kind == "function_call":
            _string(_required(item, "name", where), f"{where}.name")
            _string(item.get("call_id") or _required(item, "id", where), f"{where}.call_id")
            if item.get("arguments") is not None:
                _string(item["arguments"], f"{where}.arguments")
        elif kind == "function_call_output":
            _string(_required(item, "call_id", where), f"{where}.call_id")
            if not isinstance(item.get("output"), str):
                _responses_content(_required(item, "output", where), f"{where}.output")
        elif kind == "item_reference":
            raise APIError(400, f"'{where}' is an item_reference, but this server stores no items (store=false): "
                                "send the item itself in `input`.", param=where)


def _responses_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise APIError(400, f"Invalid type for '{where}': expected a string or an array of content parts, but got "
                            f"{_json_type(content)} instead.", param=where)
    for k, part in enumerate(content):
        at = OPENAI.join(where, k)
        part = _object(part, at)
        kind = _required(part, "type", at)
        one_of(kind, RESPONSES_PARTS, f"{at}.type")
        key = "refusal" if kind == "refusal" else "text" if kind in ("input_text", "output_text") else None
        if key is not None:
            _string(_required(part, key, at), f"{at}.{key}")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"Invalid type for '{where}': expected a string, but got {_json_type(value)} instead.",
                       param=where)
    return value


def check_response_format(fmt: Any) -> None:
    """Chat's `response_format` (`protocol.ResponseFormat`): a json_schema format carries its schema, as
    `{"name", "schema": {...}}` (OpenAI) or as the schema itself (Dify), never a schema that is no object
    (it used to constrain the answer to `null`)."""
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None:
        raise APIError(400, "Missing required parameter: 'response_format.json_schema' (a json_schema format needs "
                            "`{\"name\": ..., \"schema\": {...}}`; `{\"type\": \"json_object\"}` asks for any JSON "
                            "object).", param="response_format.json_schema")
    if "schema" in fmt.json_schema and not isinstance(fmt.json_schema["schema"], dict):
        raise APIError(400, "Invalid type for 'response_format.json_schema.schema': expected a JSON Schema object, "
                            f"but got {_json_type(fmt.json_schema['schema'])} instead.",
                       param="response_format.json_schema.schema")


# ---- media ---------------------------------------------------------------------------------------


def refuse_media(parts: Iterable[tuple[str, str]], accepted: frozenset[str], model: str) -> None:
    """`parts`: (path, part type) of every content part of the request. A medium the served model does
    not take is refused rather than dropped: dropping it made the model answer about an image it
    never saw."""
    for path, kind in parts:
        medium = MEDIA_PARTS.get(kind)
        if medium is not None and medium not in accepted:
            takes = " and ".join(sorted(accepted))
            raise APIError(400, f"The served model `{model}` takes {takes} only, but '{path}' is {_an(medium)} "
                                f"(a `{kind}` part). Send the content as text, or serve a model that accepts "
                                f"{medium} input.", param=path, code="unsupported_content")


def _an(medium: str) -> str:
    return f"an {medium}" if medium[0] in "aeiou" else f"a {medium}"


def content_parts(content: Any, path: str, style: PathStyle, nested: str | None = None) -> Iterator[tuple[str, str]]:
    """(path, type) of each typed part of a content array; `nested` names a key whose value is again
    content (Anthropic's tool_result blocks carry their own blocks, images included)."""
    if not isinstance(content, list):
        return
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        where = style.join(path, i)
        if isinstance(part.get("type"), str):
            yield where, part["type"]
        if nested is not None:
            yield from content_parts(part.get(nested), style.join(where, nested), style, nested)


# ---- tools ---------------------------------------------------------------------------------------


def check_openai_tools(tools: list[Any] | None, choice: Any) -> None:
    """Chat completions' `tools`: each `{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`, names unique; and a `tool_choice` other than none/auto needs tools."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = OPENAI.join("tools", i)
        tool = _object(tool, where)
        kind = tool.get("type", "function")
        if kind != "function":
            raise APIError(400, f"Invalid value for '{where}.type': {kind!r}. Supported values are: 'function'.",
                           param=f"{where}.type")
        _check_function(_object(_required(tool, "function", where), f"{where}.function"), f"{where}.function",
                        "parameters", OPENAI, names)
    _check_choice(tools, choice, ("none", "auto"), "tool_choice")


def check_responses_tools(tools: list[Any] | None, choice: Any) -> None:
    """Responses' `tools`: function tools are flat (`{"type": "function", "name", "parameters"}`);
    built-in tools (web_search, ...) are other types and are not run here, so they are not checked."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = OPENAI.join("tools", i)
        tool = _object(tool, where)
        if _required(tool, "type", where) == "function":
            _check_function(tool, where, "parameters", OPENAI, names)
    if isinstance(choice, dict):
        kind = choice.get("type")
        one_of(kind, ("function", "allowed_tools"), "tool_choice.type")  # a built-in tool cannot run here
        if kind == "function":
            _string(_required(choice, "name", "tool_choice"), "tool_choice.name")
        else:
            one_of(choice.get("mode", "auto"), ("auto", "required"), "tool_choice.mode")
            allowed = _required(choice, "tools", "tool_choice")
            if not isinstance(allowed, list):
                raise APIError(400, f"Invalid type for 'tool_choice.tools': expected an array, but got "
                                    f"{_json_type(allowed)} instead.", param="tool_choice.tools")
            for k, tool in enumerate(allowed):
                where = OPENAI.join("tool_choice.tools", k)
                _string(_required(_object(tool, where), "name", where), f"{where}.name")
    elif choice is not None:
        one_of(choice, ("none", "auto", "required"), "tool_choice")
    _check_choice(tools, choice, ("none", "auto"), "tool_choice")


def check_anthropic_tools(tools: list[Any] | None, choice: Any) -> None:
    """Messages' `tools`: a client tool (no `type`, or `custom`) needs `name` and an object
    `input_schema`; typed server tools (web_search_20250305, ...) carry no schema and run nowhere here."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = ANTHROPIC.join("tools", i)
        tool = _object(tool, where)
        if tool.get("type", "custom") == "custom":
            _required(tool, "input_schema", where)
            _check_function(tool, where, "input_schema", ANTHROPIC, names)
    kind = None
    if choice is not None:
        kind = _required(_object(choice, "tool_choice"), "type", "tool_choice")
        one_of(kind, ("auto", "any", "tool", "none"), "tool_choice.type")
        if kind == "tool":
            _string(_required(choice, "name", "tool_choice"), "tool_choice.name")
    _check_choice(tools, kind, ("none", "auto", None), "tool_choice.type")


def _check_function(fn: dict[str, Any], where: str, schema_key: str, style: PathStyle, names: set[str]) -> None:
    name = _required(fn, "name", where)
    if not isinstance(name, str) or not name.strip():
        raise APIError(400, f"Invalid type for '{where}.name': expected a non-empty string, but got "
                            f"{_json_type(name)} instead.", param=f"{where}.name")
    if name in names:
        raise APIError(400, f"Invalid value for '{where}.name': the tool name {name!r} is used twice; tool names "
                            "must be unique.", param=f"{where}.name")
    names.add(name)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise APIError(400, f"Invalid type for '{where}.description': expected a string, but got "
                            f"{_json_type(fn['description'])} instead.", param=f"{where}.description")
    if fn.get(schema_key) is not None:
        check_schema(fn[schema_key], f"{where}.{schema_key}", f"the parameters of tool {name!r}")
    elif style is ANTHROPIC:
        raise APIError(400, f"{where}.{schema_key}: Field required", param=f"{where}.{schema_key}")


def check_schema(schema: Any, where: str, what: str) -> None:
    """A JSON Schema (draft 2020-12, which OpenAI and Anthropic take) describing an object."""
    if not isinstance(schema, dict):
        raise APIError(400, f"Invalid type for '{where}': {what} must be a JSON Schema object, but got "
                            f"{_json_type(schema)} instead.", param=where)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise APIError(400, f"Invalid schema for '{where}{at}': {exc.message}.", param=where) from None
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise APIError(400, f"Invalid schema for '{where}': {what} must describe an object (`\"type\": "
                            f"\"object\"`), but its type is {json.dumps(kind)}.", param=where)


def _check_choice(tools: list[Any] | None, choice: Any, without_tools: tuple[Any, ...], param: str) -> None:
    """`required`/`any` or a named tool asks for a call; with no tools the answer could only be text."""
    if not tools and choice is not None and choice not in without_tools:
        raise APIError(400, f"Invalid value for '{param}': {json.dumps(choice)} asks for a tool call, but the request "
                            "has no tools. Send `tools`, or drop the tool_choice.", param=param)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, f"Invalid type for '{where}': expected an object, but got {_json_type(value)} instead.",
                       param=where)
    return value


def _required(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj or obj[key] is None:
        raise APIError(400, f"Missing required parameter: '{where}.{key}'.", param=f"{where}.{key}")
    return obj[key]


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
