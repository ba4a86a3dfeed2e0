"""Choose a replica for a request: least outstanding requests, with prefix affinity.

Why affinity: engines keep a prefix cache (vLLM's automatic prefix caching, SGLang's radix cache,
llama.cpp's slot cache). Requests that share a system prompt or the start of a conversation are
cheaper on the replica that saw that prefix already. So the first characters of the prompt choose a
preferred replica (rendezvous hashing: adding or losing a replica moves only the keys that were on
it), and that replica is taken unless its load is more than `slack` above the least-loaded one; then
load wins, so one hot prefix cannot pile everything onto one replica.

Pure data: the caller says which replicas are ready and brackets each request with
`acquire`/`release`; nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

AFFINITY_CHARS = 512  # enough to cover a system prompt's opening; short enough to hash per request


@dataclass
class Replica:
    url: str
    outstanding: int = 0  # requests sent and not yet finished
    served: int = 0  # requests ever sent (for /ready and tests)


class Balancer:
    """The replicas of one model, and the choice among them."""

    def __init__(self, urls: Iterable[str], slack: int = 2):
        self.replicas = [Replica(u) for u in urls]
        if not self.replicas:
            raise ValueError("a balancer needs at least one replica URL")
        self.slack = slack
        self._turn = 0  # round-robin among equally loaded replicas when there is no key

    def pick(self, key: str | None, ready: set[str] | None = None) -> Replica | None:
        """The replica for a request whose affinity key is `key` (None: no affinity), among the
        `ready` URLs (None: all). None when no replica is ready."""
        candidates = [r for r in self.replicas if ready is None or r.url in ready]
        if not candidates:
            return None
        least = min(r.outstanding for r in candidates)
        if key:
            preferred = max(candidates, key=lambda r: _score(key, r.url))
            if preferred.outstanding <= least + self.slack:
                return preferred
        idle = [r for r in candidates if r.outstanding == least]
        self._turn += 1
        return idle[self._turn % len(idle)]

    def acquire(self, replica: Replica) -> None:
        replica.outstanding += 1
        replica.served += 1

    def release(self, replica: Replica) -> None:
        replica.outstanding = max(0, replica.outstanding - 1)


def _score(key: str, url: str) -> int:
    """Rendezvous (highest-random-weight) score of `url` for `key`."""
    return int.from_bytes(hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest(), "big")


def affinity_key(body: dict[str, Any], chars: int = AFFINITY_CHARS) -> str | None:
    """The first `chars` characters of what the model reads first: the prompt of a completion, or
    the opening messages of a chat (role and text, in order). None when there is nothing to key on."""
    prompt = body.get("prompt")
    if prompt is not None:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[: chars + 2]
        return text[:chars] or None
    parts: list[str] = []
    size = 0
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        part = f"{message.get('role', '')}:{content or ''}\x00"
        parts.append(part)
        size += len(part)
        if size >= chars:
            break
    return "".join(parts)[:chars] or None
