"""The path every generation route shares (OpenAI chat and completions, Anthropic messages, Responses),
from a validated request to running engine requests: the prompt, the tools and grammar, the engine
requests with their sampling, admission, and the first output.

Two rules hold here for every route. Nothing slow runs on the event loop: the chat template and the
tokenizer run on a worker thread, after a cheap bound has refused a text that cannot fit the context
whatever its tokenization. And admission is counted where it is decided: the check and the submission
happen on one turn of the event loop, so a burst cannot slip past `--max-waiting`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import jinja2
from starlette.requests import Request

from flagdeploy.engine.grammar import GrammarError, GrammarSpec
from flagdeploy.engine.grammar import validate as validate_grammar
from flagdeploy.engine.multimodal import MediaItem
from flagdeploy.engine.request import RequestOutput, SamplingParams
from flagdeploy.errors import PromptTooLongError

from . import errors
from .errors import APIError
from .disconnect import ClientDisconnected, until_disconnect
from .generation import Generation, Job
from .media import MediaSettings, takes_media
from .media import prepare as prepare_media
from .protocol import SamplingFields
from .reasoning import ReasoningStyle
from .tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)

MAX_CHOICES = 128  # engine requests one HTTP request may start (prompts x n): a queue, not a flood

MaxTokensPolicy = Literal["auto", "error", "clamp"]


@dataclass(frozen=True)
class ServerSettings:
    """What the operator chose at startup that every generation route applies (see create_app).

    `max_tokens_policy`: what a `max_tokens` that cannot fit after the prompt gets: "error" (a 400 with
    the numbers, as OpenAI and vLLM answer), "clamp" (generate what fits: for clients that send one
    large value to every model), or "auto": clamp on the Anthropic route, whose main client does just
    that (Claude Code asks every model for 32,000 tokens), error on the OpenAI routes."""

    default_temperature: float = 0.0
    style: ReasoningStyle | None = None
    max_waiting: int | None = None
    tool_call_parser: str = "auto"
    request_timeout: float | None = None
    max_tokens_policy: MaxTokensPolicy = "auto"
    media: MediaSettings = MediaSettings()

    def clamps(self, anthropic: bool) -> bool:
        """Whether a max_tokens that cannot fit is cut to what fits on this route (else a 400)."""
        return self.max_tokens_policy == "clamp" or (self.max_tokens_policy == "auto" and anthropic)

    def generation(self, engine: "AsyncEngine", jobs: list[Job], overload_status: int = 429) -> Generation:
        """The request's engine requests, admitted (or refused: backpressure) and submitted, with no
        await in between."""
        admit(engine, len(jobs), self.max_waiting, overload_status)
        return Generation(engine, jobs, self.request_timeout).start()


# ---- admission -----------------------------------------------------------------------------------


def admit(engine: "AsyncEngine", n: int, max_waiting: int | None, status: int = 429) -> None:
    """Backpressure: refuse at once, with Retry-After, `n` engine requests that would push the wait
    queue past `max_waiting`, instead of queueing without bound (every SDK retries 429 and 529 after
    Retry-After, so a burst is spread out rather than piled up). `status` is 429 for the OpenAI routes
    and 529 (Anthropic's overloaded_error) for the Anthropic ones.

    A request larger than the sequence slots plus the waiting places could never be admitted; a 429
    would make SDKs retry it forever, so it is a 400 that says why."""
    if max_waiting is None:
        return
    capacity = engine.max_num_seqs + max_waiting
    if n > capacity:
        raise APIError(400, f"This request needs {n} sequences at once (prompts x n), but this server runs at most "
                            f"{engine.max_num_seqs} (--max-num-seqs) and queues {max_waiting} more (--max-waiting), "
                            f"so it can never be admitted. Ask for at most {capacity} (fewer choices `n` or prompts).",
                       param="n")
    if engine.would_wait(n) > max_waiting:
        raise errors.overloaded(max_waiting, status)


# ---- prompts -------------------------------------------------------------------------------------


def check_length_bound(engine: "AsyncEngine", num_chars: int, param: str) -> None:
    """Refuse, before any tokenizer runs, a text that cannot fit the context however it tokenizes: no
    token is longer than `max_token_chars`, so `num_chars` characters need at least that many tokens.
    A 10 MB message used to hold the event loop for seconds only to be refused."""
    at_least = -(-num_chars // engine.tokenizer.max_token_chars)
    if at_least >= engine.max_model_len:
        raise APIError(400, f"The prompt is too long: its {num_chars} characters are at least {at_least} tokens, and "
                            f"this model's maximum context length is {engine.max_model_len} tokens. Shorten the "
                            "prompt or the conversation, or restart the server with a larger --max-model-len.",
                       param=param, code="context_length_exceeded")


def text_size(value: Any) -> int:
    """Characters of every string in a JSON-like value (messages, tool definitions)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _in_field(exc: APIError, param: str) -> APIError:
    """A media error (server/media.py names `messages`) in the route's own field (Responses: `input`)."""
    if exc.param == "messages":
        exc.param = param
    return exc


async def chat_prompt(engine: "AsyncEngine", messages: list[dict[str, Any]],
                      template_kwargs: dict[str, Any] | None = None, tools: ToolPlan | None = None,
                      param: str = "messages", media: MediaSettings | None = None
                      ) -> tuple[list[int], str, list[MediaItem] | None]:
    """Token ids, text and media items of `messages` (template dicts) through the model's chat
    template; `template_kwargs` are extra template variables (enable_thinking, reasoning_effort, ...),
    `tools` how the request's tools reach the prompt. The text tells whether the template opened a
    reasoning section for the output. Rendering and tokenizing run on a worker thread.
    `media`: for a model that takes images and video, the settings their parts are loaded under
    (server/media.py); the items are None when the prompt has none."""
    kwargs = dict(template_kwargs or {})
    loaded = None
    if media is not None and takes_media(engine):
        try:
            messages, loaded = await prepare_media(engine, messages, media)
        except APIError as exc:
            raise _in_field(exc, param) from None
    if tools is not None:
        messages = tools.messages(messages)
        kwargs["tools"] = tools.template_tools()
    check_length_bound(engine, text_size(messages) + text_size(kwargs.get("tools")), param)

    def render() -> tuple[list[int], str, list[MediaItem] | None]:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        if loaded is not None:
            try:
                ids, items = loaded.expand(engine, text)
            except APIError as exc:
                raise _in_field(exc, param) from None
            return ids, text, items
        return engine.tokenizer.encode(text), text, None  # the template already carries the special tokens

    try:
        return await asyncio.to_thread(render)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        # The template rejects the conversation (roles out of order, no template, ...): the
        # client can fix that, so 400 rather than 500.
        raise APIError(400, f"The messages could not be formatted with the model's chat template: {exc}",
                       param=param) from None


async def encode_text(engine: "AsyncEngine", text: str, param: str) -> list[int]:
    """A plain prompt's token ids (with the model's BOS), bounded and off the event loop like chat."""
    check_length_bound(engine, len(text), param)
    return await asyncio.to_thread(engine.tokenizer.encode, text, True)


def tool_plan(engine: "AsyncEngine", definitions: list[dict[str, Any]] | None, choice: str | None,
              parser: str) -> ToolPlan | None:
    try:
        return plan_tools(engine.tokenizer, definitions, choice, parser)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None


def check_grammar(engine: "AsyncEngine", spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """Check a request's grammar before anything is queued: a schema the library refuses is a 400."""
    if spec is not None:
        try:
            validate_grammar(engine.tokenizer, spec)
        except GrammarError as exc:
            raise APIError(400, f"The {param} cannot be enforced: {exc}", param=param) from None
    return spec


# ---- engine requests -----------------------------------------------------------------------------


def sampling_params(req: SamplingFields, max_tokens: int, seed: int | None, default_temperature: float,
                    **engine_fields: Any) -> SamplingParams:
    """`engine_fields`: the SamplingParams a route adds (grammar, logprobs, prompt_logprobs)."""
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
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            logit_bias=req.token_biases(),
            kv_transfer_params=req.kv_transfer_params,
            **engine_fields,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams complaint names (its messages open with the field's name)."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingFields.model_fields else None


def make_jobs(engine: "AsyncEngine", settings: ServerSettings, req: SamplingFields, requested_max: int | None,
              prompts: list[list[int]], stem: str, max_tokens_param: str = "max_tokens", prompt_param: str = "messages",
              media: list[MediaItem] | None = None, anthropic: bool = False, **engine_fields: Any) -> list[Job]:
    """One engine request per (prompt, choice); choice i of a seeded request uses seed + i so that
    the n answers differ yet the whole request is reproducible. Without `requested_max`: whatever fits.
    `media`: the items of a chat prompt (one prompt), shared by its choices (the encoder cache sees
    them once)."""
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(400, f"This request asks for {len(prompts) * n} completions (prompts x n); at most "
                            f"{MAX_CHOICES} are served per request. Split it into several requests.", param="n")
    if req.kv_transfer_params and len(prompts) * n > 1:
        raise APIError(400, "kv_transfer_params (prefill-decode disaggregation) applies to one prompt and n=1; a "
                            "router sends each request on its own", param="kv_transfer_params")
    jobs = []
    for p, prompt_ids in enumerate(prompts):
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise errors.from_generation(PromptTooLongError(len(prompt_ids), engine.max_model_len), prompt_param)
        if requested_max is not None and requested_max > room and not settings.clamps(anthropic):
            raise errors.max_tokens_too_large(engine.max_model_len, len(prompt_ids), requested_max, max_tokens_param)
        max_tokens = room if requested_max is None else min(requested_max, room)
        for i in range(n):
            seed = None if req.seed is None else req.seed + i
            index = p * n + i
            params = sampling_params(req, max_tokens, seed, settings.default_temperature, **engine_fields)
            try:
                engine.check_params(params)
            except ValueError as exc:
                raise APIError(400, str(exc), param=_param_of(str(exc))) from None
            jobs.append(Job(index, p, prompt_ids, params, f"{stem}-{index}", media))
    return jobs


async def first_output(request: Request, gen: Generation, prompt_param: str) -> tuple[int, RequestOutput] | None:
    """Wait for the first output before committing to a 200 stream, so that a prompt that is too
    long or a bad sampling value still gets a proper 4xx instead of an error event. None: the
    client left meanwhile."""
    try:
        return await until_disconnect(request.receive, gen.next())
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
