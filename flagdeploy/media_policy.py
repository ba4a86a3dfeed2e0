"""One media policy for every command and engine: `--limit-mm-per-prompt` and `--allowed-media-domains`.

    --limit-mm-per-prompt image=2,video=0          (or vLLM's JSON: '{"image":2,"video":0}')
    --allowed-media-domains images.example.com,cdn.example.com

A limit caps the media items of one request, per modality; a modality left out keeps the engine's
own limit. Allowed domains are the hosts whose http(s) media URLs are accepted, matched exactly (as
vLLM matches them: a subdomain is its own entry); none by default: media arrive inline as `data:`
URLs until an operator allows hosts, so that a client cannot make an engine fetch from the network
it runs in (or read its files: other URLs and paths are refused too). The same values mean the same
on `serve` (checked by the gateway on every request it forwards, and passed to engines that have an
equivalent flag), in serve.yaml and in a deployment profile (`plan --emit`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from flagdeploy.errors import FlagdeployError

MODALITIES = ("image", "video", "audio")
_EXAMPLE = "write image=2,video=0 or vLLM's JSON '{\"image\":2,\"video\":0}'"
_HTTP = re.compile(r"^(https?)://([^/?#]*)", re.IGNORECASE)
_HOST = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


class MediaPolicyError(FlagdeployError, ValueError):
    """A media limit or domain list that cannot be used; the message says what to write instead."""


def parse_limits(value: str | Mapping[str, Any] | None) -> dict[str, int] | None:
    """`image=2,video=0`, vLLM's JSON spelling of it, or the mapping (serve.yaml, a profile), as
    {modality: count}; None when not set."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise MediaPolicyError(f"{value!r} is not valid JSON ({exc.msg}); {_EXAMPLE}") from None
        else:
            pairs = [item.strip() for item in text.split(",") if item.strip()]
            if any("=" not in item for item in pairs):
                bad = next(item for item in pairs if "=" not in item)
                raise MediaPolicyError(f"{bad!r} is not MODALITY=COUNT; {_EXAMPLE}")
            items = [tuple(part.strip() for part in item.split("=", 1)) for item in pairs]
            if len({k for k, _ in items}) < len(items):
                twice = next(k for k, n in Counter(k for k, _ in items).items() if n > 1)
                raise MediaPolicyError(f"{twice} is given twice in {value!r}; give each modality once")
            value = {k: int(v) if v.isdigit() else v for k, v in items}
    if not isinstance(value, Mapping) or not value:
        raise MediaPolicyError(f"{value!r} gives no limit; {_EXAMPLE}")
    limits = {}
    for modality, count in value.items():
        if modality not in MODALITIES:
            raise MediaPolicyError(f"unknown modality {modality!r}; the modalities are {', '.join(MODALITIES)} "
                                   f"({_EXAMPLE})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise MediaPolicyError(f"{modality}={json.dumps(count)}: a limit is a whole number of items per request, "
                                   f"0 or more (0 refuses that modality), not a per-item size; {_EXAMPLE}")
        limits[modality] = count
    return limits


def parse_domains(value: str | Sequence[str] | None) -> list[str] | None:
    """Comma-separated host names (or a list of them) as a list, lower-cased; None when not set."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(h, str) for h in items):
        raise MediaPolicyError(f"{value!r} is not a list of host names; write images.example.com,cdn.example.com")
    hosts = [h.strip().lower() for h in items if h.strip()]
    if not hosts:
        raise MediaPolicyError("no host given; name the hosts whose media URLs are accepted "
                               "(images.example.com,cdn.example.com), or leave the setting out to take "
                               "data: URLs only")
    for host in hosts:
        if not _HOST.match(host):
            raise MediaPolicyError(f"{host!r} is not a host name; give host names only (images.example.com, "
                                   f"10.0.0.7), without scheme, port, path or wildcard: each host is matched exactly")
    return list(dict.fromkeys(hosts))


@dataclass(frozen=True)
class MediaPolicy:
    """What media one request may carry. `limits`: {modality: most items per request}, None when not
    set; `domains`: hosts whose http(s) media URLs are accepted, None when not set (data: URLs only)."""

    limits: Mapping[str, int] | None = None
    domains: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, limits: str | Mapping[str, Any] | None = None,
              domains: str | Sequence[str] | None = None) -> "MediaPolicy":
        hosts = parse_domains(domains)
        return cls(parse_limits(limits), None if hosts is None else tuple(hosts))

    def profile_fields(self) -> dict[str, Any]:
        """The settings given, as profile / serve.yaml fields (a mapping, a list)."""
        fields: dict[str, Any] = {}
        if self.limits is not None:
            fields["limit_mm_per_prompt"] = dict(self.limits)
        if self.domains is not None:
            fields["allowed_media_domains"] = list(self.domains)
        return fields

    def check(self, chat: Mapping[str, Any]) -> None:
        """Refuse (APIError 400) a chat-completions body whose media break the policy: a URL other
        than a data: URL or an http(s) URL of an allowed host, or more items of a modality than its
        limit."""
        from flagdeploy.server.errors import APIError

        counts: Counter[str] = Counter()
        for medium, url in media_items(chat.get("messages")):
            counts[medium] += 1
            problem = None if url is None else self.url_problem(url)
            if problem is not None:
                takes = f"data: URLs and http(s) URLs of {', '.join(self.domains)}" if self.domains else "data: URLs only"
                raise APIError(400, f"{medium.capitalize()} {counts[medium]} of this request ({url[:120]}) {problem}; "
                                    f"this server takes {takes}. Send the {medium} inline as a base64 data: URL "
                                    f"(data:<type>;base64,...), or have the operator allow its host "
                                    f"(--allowed-media-domains).", code="media_url_not_allowed")
        for medium, count in counts.items():
            limit = (self.limits or {}).get(medium)
            if limit is not None and count > limit:
                takes = f"takes at most {limit} per request" if limit else f"takes no {medium} input"
                raise APIError(400, f"This request carries {count} {medium} items; this server {takes} "
                                    f"(--limit-mm-per-prompt {medium}={limit}). Send fewer (split the request), or "
                                    f"have the operator raise the limit.", code="too_many_media_items")

    def url_problem(self, url: str) -> str | None:
        """Why a media URL is not taken, or None. Fail closed: a host that parsers could read two
        ways (credentials, a backslash, spaces or control characters) is not an allowed one."""
        text = url.strip()
        if text[:5].lower() == "data:":
            return None
        http = _HTTP.match(text)
        if http is None:
            return "is neither a data: URL nor an http(s) URL"
        authority = http.group(2)
        if "@" in authority or "\\" in text or any(c.isspace() or ord(c) < 32 for c in text):
            return "names its host ambiguously (credentials, a backslash or spaces)"
        host = re.sub(r":\d*$", "", authority).strip("[]").lower()
        if host in (self.domains or ()):
            return None
        return f"is a URL of host {host!r}, which this server does not fetch from"


def media_items(messages: Any) -> Iterator[tuple[str, str | None]]:
    """(modality, URL or None) of each image / video / audio part of chat messages, in order:
    `image_url`, `video_url`, `audio_url` (a URL, as {"url": ...} or the string itself) and
    `input_audio` (inline data, no URL)."""
    from flagdeploy.server.validate import MEDIA_PARTS

    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            medium = MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
            if medium not in MODALITIES:
                continue
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            yield medium, url if isinstance(url, str) else None

