"""The prompt tokens of a request to an upstream model, counted before it is sent.

Claude Code calls `/v1/messages/count_tokens`, and tracks its context from the `input_tokens` of a
streamed `message_start`, which is due before the engine has answered anything (vLLM and SGLang
report usage only at the end of a stream, llama-cpp-python never). What the engine sees is the chat
template applied to the translated request (system prompt, tools, thinking switch), so that is what
is counted, by the first of these ways a replica offers (found on first use, then reused):

- the engine renders and counts the chat itself (exact):
  vLLM / vLLM-Ascend `POST /tokenize {model, messages, tools, chat_template_kwargs}` -> `count`;
  llama.cpp's llama-server `POST /v1/chat/completions/input_tokens` (the chat body) -> `input_tokens`,
  or on builds before that route `POST /apply-template` -> `prompt`, then `POST /tokenize {content,
  add_special: true}` -> `tokens` (its chat route tokenizes a prompt that way);
- the engine tokenizes text only: the template is rendered here from the model's own files
  (`tokenizer.chat_template` of a GGUF; a directory's as the builtin engine reads it,
  `flagdeploy.tokenizer.chat_template_source`) the way transformers and llama-cpp-python render it, and
  the engine counts the text:
  SGLang `POST /tokenize {model, prompt, add_special_tokens: false}` -> `count`, llama-cpp-python
  `POST /extras/tokenize/count {input}` -> `count`. What a route adds to any text (llama-cpp-python
  adds the vocabulary's BOS) is measured on an empty text and taken off: the engines' chat routes
  add nothing to a rendered template, which spells its own special tokens. Exact when the engine
  renders the model's own template (llama-cpp-python: unless started with another --chat_format);
- the same, without model files (an attached engine without `model:`): the messages are laid out
  as ChatML (`<|im_start|>role ... <|im_end|>`, tools as JSON in a system turn). An approximation,
  off by the difference between the template's wording and ChatML's.

An engine with none of these routes (MindIE) cannot be counted: `count` raises a 400 saying so.
flagdeploy's own replicas (`--dp`) count the client's Anthropic request itself (`count_on_builtin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import httpx
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flagdeploy.errors import FlagdeployError
from flagdeploy.checkpoints.gguf_metadata import gguf_metadata
from flagdeploy.server.errors import APIError

from .normalize import upstream_unavailable

log = logging.getLogger(__name__)

Ask = Callable[[str, dict[str, Any]], Awaitable[Any]]  # POST path and body -> the JSON answer


# ---- the chat template, rendered here for engines that only tokenize text -----------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` (HF templates mark assistant turns with it for training masks) renders
    its body unchanged, as in transformers."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


_JINJA = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols, _GenerationTag])
_JINJA.filters["tojson"] = _tojson
_JINJA.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f))


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    return _JINJA.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the spellings of the special tokens it refers to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, chat: dict[str, Any]) -> str:
        """The prompt text of a chat request, rendered as transformers' apply_chat_template and
        llama-cpp-python's Jinja2ChatFormatter do (same environment, same variables)."""
        return _compiled(self.source).render(
            messages=chat.get("messages") or [], tools=chat.get("tools") or None, add_generation_prompt=True,
            bos_token=self.bos_token, eos_token=self.eos_token, **(chat.get("chat_template_kwargs") or {}))


# What a request is counted with when the model's own template is unknown: an approximation (of a
# content array, the text parts: media are not counted, rather than their URLs' or data's characters).
CHATML = ChatTemplate(
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string or not m.content %}{{ m.content or '' }}"
    "{% else %}{{ m.content | selectattr('text') | map(attribute='text') | join('\\n') }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n")


def load_template(model: str | None) -> ChatTemplate | None:
    """The chat template in a model's own files (a GGUF file, or a directory with a tokenizer
    config), found offline the way `serve --model` finds models; None if there is none to read."""
    from flagdeploy.checkpoints.source import resolve

    if model is None:
        return None
    try:
        src = resolve(model, download=False, weights=False)
    except FlagdeployError as exc:
        log.info("no local files for %s (%s): its prompt tokens are counted by the engine or approximated", model, exc)
        return None
    return _gguf_template(src.path) if src.format == "gguf" else _dir_template(src.path)


def _gguf_template(path: Path) -> ChatTemplate | None:
    fields = gguf_metadata(path, {"tokenizer.chat_template", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id",
                                  "tokenizer.ggml.eos_token_id"})
    source, tokens = fields.get("tokenizer.chat_template"), fields.get("tokenizer.ggml.tokens") or []
    if not isinstance(source, str):
        return None

    def spelling(key: str) -> str:
        token_id = fields.get(key)
        return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else ""

    return ChatTemplate(source, spelling("tokenizer.ggml.bos_token_id"), spelling("tokenizer.ggml.eos_token_id"))


def _dir_template(path: Path) -> ChatTemplate | None:
    from flagdeploy.tokenizer import chat_template_source

    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = chat_template_source(path)  # the builtin engine's own lookup
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None

    def spelling(token: Any) -> str:
        return token.get("content", "") if isinstance(token, dict) else token or ""

    return ChatTemplate(source, spelling(config.get("bos_token")), spelling(config.get("eos_token")))


# ---- the engines' routes ---------------------------------------------------------------------------


class _NotServed(Exception):
    """The engine does not serve this route in this shape (a 4xx, an answer without the count)."""


def _chat_fields(chat: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat request that decide its prompt."""
    return {k: chat[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if chat.get(k) is not None}


def _read(answer: Any, key: str) -> int:
    """The count under `key` (an int, or a list of tokens) in an engine's answer."""
    value = answer.get(key) if isinstance(answer, dict) else None
    if isinstance(value, list):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _NotServed(f"its answer has no `{key}`")


async def vllm_chat(ask: Ask, chat: dict[str, Any]) -> int:
    """vLLM's /tokenize renders the chat itself. (llama-server answers this body with no count,
    SGLang refuses `messages`: neither passes for vLLM.)"""
    return _read(await ask("/tokenize", _chat_fields(chat) | {"add_generation_prompt": True,
                                                              "add_special_tokens": False}), "count")


async def llama_server_chat(ask: Ask, chat: dict[str, Any]) -> int:
    """llama-server counts a chat body; builds before that route render it with /apply-template and
    tokenize the prompt with special tokens added, as their chat route does."""
    try:
        return _read(await ask("/v1/chat/completions/input_tokens", _chat_fields(chat)), "input_tokens")
    except _NotServed:
        rendered = await ask("/apply-template", _chat_fields(chat))
    prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
    if not isinstance(prompt, str):
        raise _NotServed("/apply-template gave no prompt")
    return _read(await ask("/tokenize", {"content": prompt, "add_special": True, "parse_special": True}), "tokens")


@dataclass(frozen=True)
class TextRoute:
    """An engine route that counts plain text."""

    path: str
    body: Callable[[str | None, str], dict[str, Any]]  # (the upstream's model name, text) -> request body

    async def count(self, ask: Ask, model: str | None, text: str) -> int:
        return _read(await ask(self.path, self.body(model, text)), "count")


SGLANG_TEXT = TextRoute("/tokenize", lambda model, text: {"model": model, "prompt": text, "add_special_tokens": False})
LLAMA_CPP_PYTHON_TEXT = TextRoute("/extras/tokenize/count", lambda model, text: {"input": text})
CHAT_ROUTES: tuple[Callable[[Ask, dict[str, Any]], Awaitable[int]], ...] = (vllm_chat, llama_server_chat)
TEXT_ROUTES = (SGLANG_TEXT, LLAMA_CPP_PYTHON_TEXT)


@dataclass(frozen=True)
class _Way:
    """How one replica counts: a chat route, else a text route and what it adds to any text."""

    chat: Callable[[Ask, dict[str, Any]], Awaitable[int]] | None = None
    text: TextRoute | None = None
    added: int = 0


class TokenCounter:
    """Counts the prompt tokens of chat requests for one upstream model. `model`: the model's files
    (GGUF or directory, offline), for engines that cannot render the chat template themselves."""

    def __init__(self, model: str | None = None):
        self.model = model
        self._ways: dict[str, _Way] = {}
        self._template: ChatTemplate | None = None
        self._template_read = False
        self._lock = asyncio.Lock()

    async def template(self) -> ChatTemplate:
        """The model's own template (read once, off the event loop), else ChatML."""
        async with self._lock:
            if not self._template_read:
                try:
                    self._template = await asyncio.to_thread(load_template, self.model)
                except Exception as exc:  # noqa: BLE001 - a broken file only makes the count approximate
                    log.warning("cannot read the chat template of %s (%s); prompt tokens are approximated",
                                self.model, exc)
                self._template_read = True
        return self._template or CHATML

    async def count(self, client: httpx.AsyncClient, upstream: Any, chat: dict[str, Any]) -> int:
        """The prompt tokens of `chat` (a chat-completions body, with the upstream's model name) on
        `upstream` (url, api_key). APIError: 503 if the engine cannot be reached or fails, 400 if it
        has no way to count or refuses the request (its message is kept)."""
        ask = _asker(client, upstream)
        with _api_errors(upstream):
            way = self._ways.get(upstream.url)
            if way is None:
                way, counted = await self._detect(ask, chat)
                if counted is not None:  # not kept otherwise: a refusal may pass (a wrong key, a restart)
                    self._ways[upstream.url] = way
                    return counted
            if way.chat is not None:
                return await way.chat(ask, chat)
            if way.text is not None:
                return await way.text.count(ask, chat.get("model"), await self._render(chat)) - way.added
        raise APIError(400, f"The engine at {upstream.url} offers no route that counts tokens (vLLM's or SGLang's "
                            f"/tokenize, llama.cpp's /tokenize, llama-cpp-python's /extras/tokenize), so the prompt "
                            f"tokens of this model cannot be counted.", param="model")

    async def _detect(self, ask: Ask, chat: dict[str, Any]) -> tuple[_Way, int | None]:
        """The first route that answers in its engine's shape; for a chat route, also its count."""
        for route in CHAT_ROUTES:
            try:
                return _Way(chat=route), await route(ask, chat)
            except _NotServed:
                continue
        prompt = await self._render(chat)
        for text in TEXT_ROUTES:
            try:
                added = await text.count(ask, chat.get("model"), "")
            except _NotServed:
                continue
            return _Way(text=text, added=added), await text.count(ask, chat.get("model"), prompt) - added
        return _Way(), None

    async def _render(self, chat: dict[str, Any]) -> str:
        template = await self.template()
        try:
            return template.render(chat)
        except Exception as exc:  # noqa: BLE001 - any template error; raise_exception's says what it wants
            raise APIError(400, f"The model's chat template refused these messages: {exc}") from None


async def count_on_builtin(client: httpx.AsyncClient, upstream: Any, request: dict[str, Any]) -> int:
    """The prompt tokens of an Anthropic `request` on one of flagdeploy's own replicas: its
    /v1/messages/count_tokens applies the model's template with its own engine (exact)."""
    with _api_errors(upstream):
        answer = await _asker(client, upstream)("/v1/messages/count_tokens", request | {"model": upstream.model_id})
        return _read(answer, "input_tokens")


@contextlib.contextmanager
def _api_errors(upstream: Any) -> Iterator[None]:
    """What went wrong while counting, as the client's error: the engine refused (400, its message
    kept), or could not be reached or failed (503, retry)."""
    try:
        yield
    except _NotServed as exc:
        raise APIError(400, f"The engine at {upstream.url} could not count this request: {exc}") from None
    except httpx.HTTPError as exc:
        raise upstream_unavailable(upstream.model_id or upstream.url,
                                   f"counting tokens: {type(exc).__name__}: {exc}") from None


def _asker(client: httpx.AsyncClient, upstream: Any) -> Ask:
    """POST to the replica and return the JSON answer. A 4xx or an answer that is not JSON is
    _NotServed (not this engine's route, or not this shape); unreachable and 5xx raise httpx errors."""
    headers = {"Authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}

    async def ask(path: str, body: dict[str, Any]) -> Any:
        response = await client.post(f"{upstream.url}{path}", json=body, headers=headers)
        if 400 <= response.status_code < 500:
            raise _NotServed(f"{path} answered {response.status_code}: {response.text[:300]}")
        response.raise_for_status()
        try:
            return response.json()
        except ValueError:
            raise _NotServed(f"{path} answered something that is not JSON") from None

    return ask
