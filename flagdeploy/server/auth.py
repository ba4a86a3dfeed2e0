"""The optional API key: which header carries it, and the check every protected route depends on."""

from __future__ import annotations

import hmac
from typing import Any, Callable

from fastapi import Request

from . import errors


def presented_key(request: Request) -> str | None:
    """OpenAI clients send `Authorization: Bearer`, Anthropic-style ones `x-api-key`."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else auth.strip()
    return request.headers.get("x-api-key")


def api_key_check(api_key: str | None) -> Callable[[Request], Any]:
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = presented_key(request)
        if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise errors.invalid_api_key(given)

    return check_api_key
