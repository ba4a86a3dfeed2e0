"""Images and video in a chat request, for a served model that takes them: from the request's content
parts to the prompt's expanded placeholders and the engine's `MediaItem`s.

Every route brings its messages to OpenAI chat form first (Anthropic `image` blocks and Responses
`input_image` parts become `image_url` parts, as for the gateway), so one path serves all three:

    check      the operator's media policy (allowed hosts, items per request), as the gateway checks it
    flatten    each media part becomes the placeholder the model's chat template writes for it
    load       fetch (data: URLs, allowed http(s) hosts), decode and lay out the pixels, on a worker thread
    expand     after the template: each placeholder widens to one token per encoder row, then the prompt
               is tokenized and each item learns the positions its rows replace

Anything wrong with a medium is the client's to fix and is a 400 naming the item and the limit; a
failure in one request never reaches the engine, so nothing else in the batch is affected.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flagdeploy.engine.multimodal import MediaItem
from flagdeploy.media import (
    FetchLimits,
    MediaError,
    content_hash,
    decode_image,
    decode_video,
    fetch_bytes,
)
from flagdeploy.media_policy import MediaPolicy, media_items

from .errors import APIError

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

# content part type → medium, for the parts this path turns into placeholders (the rest were refused)
_PARTS = {"image_url": "image", "video_url": "video"}


# the builtin engine's own items per request, for a modality `--limit-mm-per-prompt` leaves out: each item
# is fetched, decoded and encoded before anything else runs, so the count is never unbounded
BUILTIN_LIMITS = {"image": 16, "video": 2}


@dataclass(frozen=True)
class MediaSettings:
    """The operator's media settings for the builtin engine: `--limit-mm-per-prompt`,
    `--allowed-media-domains` (one meaning with the gateway's) and the fetch limits."""

    policy: MediaPolicy = field(default_factory=MediaPolicy)
    limits: FetchLimits = field(default_factory=FetchLimits)

    def checked_policy(self) -> MediaPolicy:
        """The policy with BUILTIN_LIMITS for the modalities the operator did not limit."""
        return MediaPolicy({**BUILTIN_LIMITS, **(self.policy.limits or {})}, self.policy.domains)


@dataclass(frozen=True)
class _Loaded:
    kind: str
    key: str
    inputs: Any  # the processor's PixelInputs
    timestamps: list[float] | None


@dataclass(frozen=True)
class MediaPrompt:
    """A request's media, loaded and laid out, waiting for the rendered prompt (`expand`)."""

    items: list[_Loaded]

    def expand(self, engine: "AsyncEngine", text: str) -> tuple[list[int], list[MediaItem]]:
        """Token ids of the rendered `text` with each placeholder widened, and the engine's items."""
        processor = engine.media_processor
        pairs = [(item.inputs, item.timestamps) for item in self.items]
        try:
            ids = engine.tokenizer.encode(processor.expand(text, pairs))
            positions = processor.positions(ids, pairs)
        except ValueError as exc:
            raise APIError(400, f"The request's media do not line up with its prompt: {exc}.", param="messages",
                           code="invalid_media_placeholders") from None
        return ids, [MediaItem(item.kind, item.key, pos, item.inputs.pixel_values, item.inputs.grid_thw)
                     for item, pos in zip(self.items, positions)]


def takes_media(engine) -> bool:
    """Whether the served model takes images and video (it has a media processor)."""
    return getattr(engine, "media_processor", None) is not None


def has_media(messages: list[dict[str, Any]]) -> bool:
    return any(True for _ in media_items(messages))


async def prepare(engine: "AsyncEngine", messages: list[dict[str, Any]],
                  settings: MediaSettings) -> tuple[list[dict[str, Any]], MediaPrompt | None]:
    """(messages for the chat template, their media) for chat-form `messages`: (messages, None) when
    they carry no image or video. The messages' content arrays become text, each media part its
    model's placeholder in place."""
    if not has_media(messages):
        return messages, None
    settings.checked_policy().check({"messages": messages})  # hosts and counts, before any fetch
    processor = engine.media_processor
    as_parts = engine.tokenizer.content_format == "openai"
    flat, refs = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": _flatten(content, processor, refs, as_parts)}
        flat.append(message)
    loaded = await asyncio.to_thread(_load_all, processor, refs, settings, engine.max_model_len)
    return flat, MediaPrompt(loaded)


def _flatten(content: list[Any], processor, refs: list[tuple[str, str]], as_parts: bool = False) -> str | list:
    """Text parts joined by newlines (as a text-only message's are), each image / video part its
    placeholder where it stands; (medium, URL) of those parts appended to `refs` in order. `as_parts`: for a
    template that reads content as typed parts (it writes the placeholders itself), the text parts as they
    are and each medium a bare `{"type": "image"}` / `{"type": "video"}` part."""
    out: list[Any] = []
    prev_text = False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]} if as_parts else ("\n" if prev_text else "") + part["text"])
            prev_text = True
        elif kind in _PARTS:
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise APIError(400, f"An {kind} part needs a URL (`{kind}: {{\"url\": ...}}`, a data: URL or an "
                                    f"http(s) URL), but it has {ref!r:.80}.", param="messages", code="invalid_media")
            refs.append((_PARTS[kind], url))
            out.append({"type": _PARTS[kind]} if as_parts else processor.placeholder(_PARTS[kind]))
            prev_text = False
    return out if as_parts else "".join(out)


def _load_all(processor, refs: list[tuple[str, str]], settings: MediaSettings, max_model_len: int) -> list[_Loaded]:
    """Fetch, decode and lay out each medium (a worker thread: this is the slow part). Once the media laid
    out so far fill more positions than the context holds the request is refused, before the rest is
    decoded (16 blank 4096 x 4096 PNGs, 46 KB of body, took 40 s and 2 GB to be refused as too long)."""
    loaded, seen, positions = [], {"image": 0, "video": 0}, 0
    for medium, url in refs:
        seen[medium] += 1
        what = f"{medium.capitalize()} {seen[medium]} of this request"
        try:
            data = fetch_bytes(url, settings.policy, settings.limits, what)
            if medium == "image":
                inputs, stamps = processor.image_inputs(decode_image(data, settings.limits, what)), None
            else:
                video = decode_video(data, settings.limits, what)
                inputs, stamps = processor.video_inputs(video.frames, video.timestamps)
        except MediaError as exc:
            raise APIError(400, str(exc), param="messages", code=exc.code) from None
        except ValueError as exc:  # the processor refuses what it cannot lay out (e.g. a degenerate size)
            raise APIError(400, f"{what} could not be prepared for the model: {exc}.", param="messages",
                           code="media_unprocessable") from None
        loaded.append(_Loaded(medium, f"{medium}:{content_hash(data)}", inputs, stamps))
        positions += inputs.num_tokens
        if positions >= max_model_len:
            raise APIError(400, f"The prompt is too long: its first {len(loaded)} image(s) and video(s) alone fill "
                                f"{positions} positions, and this model's context is {max_model_len} tokens. Send "
                                "fewer or smaller images and videos.", param="messages",
                           code="context_length_exceeded")
    return loaded
