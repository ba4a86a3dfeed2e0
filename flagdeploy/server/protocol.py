"""Wire models of the OpenAI protocol (chat completions, completions, models).

Requests are lenient on purpose: LangChain, Dify and CC Switch send fields we do not know
(`parallel_tool_calls`, `reasoning_effort`, `chat_template_kwargs`, ...), `content: null` on
assistant turns and the `developer` role. A strict model would turn those into errors, so unknown
fields are kept but ignored, and roles are plain strings. Responses are strict: every key the
clients read by index (`choices`, `logprobs`, `finish_reason`, `usage`) is always present.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_serializer


def new_id(prefix: str) -> str:
    """OpenAI-style ids (`chatcmpl-…`, `cmpl-…`); also the engine request ids' stem, so unique."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- requests ------------------------------------------------------------------------------------


class Lenient(BaseModel):
    """The base of every protocol's request models (OpenAI here, Anthropic, Responses): fields a client
    sends that we do not know pass through (SDKs add new ones before servers learn them)."""

    model_config = ConfigDict(extra="allow")


class ContentPart(Lenient):
    """One element of a content array; only `text` parts reach a text-only model."""

    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message as plain text: text parts joined by newlines, `None` as empty."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if p.type == "text" and p.text is not None)

    def to_template(self, media: bool = False) -> dict[str, Any]:
        """The dict a chat template expects; `developer` (o-series clients) means `system`. `media`: a
        content array stays one (its image and video parts for server/media.py to place), else text."""
        content = [p.model_dump(exclude_none=True) for p in self.content] \
            if media and isinstance(self.content, list) else self.text()
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                msg[key] = value
        return msg


class StreamOptions(Lenient):
    include_usage: bool | None = False


class SamplingFields(Lenient):
    """Fields shared by both generation routes (OpenAI's, plus vLLM's `top_k`, `stop_token_ids`,
    `ignore_eos`). Ranges are checked here so that a bad value is a 400 naming its field."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(default=None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)  # vLLM's
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's keys) -> bias in [-100, 100]
    # vLLM's prefill-decode two-step (a router sets it; engine/kv_transfer.py): {"do_remote_decode": true} asks a
    # prefill instance to stage the prompt's caches; a prefill instance's answer points a decode instance at them
    kv_transfer_params: dict[str, Any] | None = None

    def token_biases(self) -> dict[int, float]:
        """`logit_bias` with int keys; a key that is no token id is a 400 naming it."""
        try:
            return {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            bad = next(k for k in self.logit_bias or {} if not k.strip().lstrip("-").isdigit())
            raise ValueError(f"logit_bias keys are token ids, but {bad!r} is not one") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        """The stop strings; an empty one stops nothing (it would match before the first character)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]


# Arguments the server itself gives the template; a request may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                       "return_dict", "continue_final_message", "chat_template"})


def _unreserved(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's template variables without those the server gives the template itself."""
    return {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}


def thinking_switch(thinking: Any) -> bool | None:
    """`thinking: {"type": "enabled"|"adaptive"|"disabled"}` (Anthropic, Zhipu) as on/off."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    return {"enabled": True, "adaptive": True, "disabled": False}.get(kind) if isinstance(kind, str) else None


def thinking_template_kwargs(on: bool | None) -> dict[str, Any]:
    """Both spellings templates use for the switch: `enable_thinking` (Qwen3, GLM) and `thinking`
    (DeepSeek-V3.1+). A template ignores variables it does not read."""
    return {} if on is None else {"enable_thinking": on, "thinking": on}


class FunctionChoice(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: FunctionChoice


class ResponseFormat(Lenient):
    """`text`, `json_object`, or `json_schema` with `json_schema: {name, schema, strict}` (OpenAI);
    Dify sends the schema itself under `json_schema`, so both nestings are read."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def schema(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"type": "object"}
        if self.type != "json_schema":
            return None
        spec = self.json_schema or {}  # checked before: validate.check_response_format
        if "schema" in spec:
            return spec["schema"]
        return {k: v for k, v in spec.items() if k not in ("name", "strict", "description")} or {"type": "object"}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    guided_json: dict[str, Any] | str | None = None  # vLLM's spellings of structured output
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM / SGLang: extra template variables
    reasoning_effort: str | None = None
    thinking: Any = None  # Dify "extended" mode sends Zhipu's {"type": "enabled"|"disabled"}
    enable_thinking: bool | None = None  # Dify "extended" mode, top level

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages: the reasoning switches clients send
        in their various places (clients.md §2.3, §4.3), then `chat_template_kwargs`, which wins."""
        on = self.enable_thinking if self.enable_thinking is not None else thinking_switch(self.thinking)
        kwargs = thinking_template_kwargs(on)
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        kwargs.update(self.chat_template_kwargs or {})
        return _unreserved(kwargs)

    def requested_max_tokens(self) -> int | None:
        """LangChain sends only `max_completion_tokens`; it wins when both are present."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Lenient):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` (with `tools`, `chat_template_kwargs`) rendered by
    the model's chat template as a chat completion renders them (the generation prompt always added)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's BOS; a rendered chat carries its own special tokens
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        return _unreserved(self.chat_template_kwargs or {})


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        # OpenAI's legacy default is 16 tokens; we keep "whatever fits" like chat, which is what
        # Dify's completion mode and vLLM users expect.
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Normalise the four accepted prompt shapes to a list of text-or-token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ---- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """With a reasoning parser on, the thinking goes in both `reasoning_content` (DeepSeek, SGLang,
    most clients) and `reasoning` (vLLM >= 0.11, read first by Dify); without one neither appears.
    `tool_calls` appears only when the model called a tool."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler):
        optional = ("reasoning_content", "reasoning", "tool_calls")
        return {k: v for k, v in handler(self).items() if v is not None or k not in optional}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed delta carries only what changed: keys that are None are left out."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # deltas: index always, id/type/name only first

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """Both the non-stream body and each streamed chunk of /v1/completions (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """OpenAI's model fields plus Anthropic's (`type`, `display_name`, `created_at`), so that one
    /v1/models serves both CC Switch's "Fetch Models" and Claude Code's gateway discovery."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flagdeploy"
    max_model_len: int | None = None
    type: Literal["model"] = "model"

    @computed_field
    def display_name(self) -> str:
        return self.id

    @computed_field
    def created_at(self) -> str:
        return datetime.fromtimestamp(self.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False  # Anthropic's paging fields: one page holds every model

    @computed_field
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @computed_field
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None


def request_field_names() -> frozenset[str]:
    """Every field name of the request models: lets error reporting tell a field in a validation
    error's location from pydantic's union-member tags (`str`, `list[str]`, ...)."""
    models = (ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions, ResponseFormat,
              NamedToolChoice, FunctionChoice, TokenizeRequest)
    return frozenset(name for m in models for name in m.model_fields)
