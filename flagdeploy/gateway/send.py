"""A whole JSON answer sent on raw ASGI (the gateway is an ASGI app, not a framework's routes): what the
gateway's own routes, the proxy and each protocol dialect send when the answer is not a relayed stream."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Send

from flagdeploy.server.errors import APIError


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(body, status_code=status, headers=headers)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


async def send_error(send: Send, error: APIError) -> None:
    await send_json(send, error.status, error.body(), error.headers)
