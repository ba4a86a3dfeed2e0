"""Awaiting work unless the client hangs up: the one disconnect watcher of the builtin routes
(server/generation.py, server/pipeline.py) and of the gateway's proxy (gateway/proxy.py)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; nothing is left to send."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then `work` is cancelled, allowed to unwind
    (close what it holds), and ClientDisconnected is raised.

    The request body was read already, so `receive()` only returns when the client goes away: watching
    costs nothing while the connection is alive (no polling)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
