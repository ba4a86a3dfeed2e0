"""Running one HTTP request's engine requests: fan-out over choices, merging, disconnects, aborts.

A request with `n` choices (or several prompts) is several engine requests. They run concurrently,
their outputs are merged in arrival order, and whatever ends the HTTP exchange (completion, a
failure, the client hanging up) aborts the ones still running so that no KV cache or compute is
spent on answers nobody will read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flagdeploy.engine.request import RequestOutput, SamplingParams

from . import errors
from .disconnect import ClientDisconnected, until_disconnect

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)

@dataclass
class Job:
    """One engine request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    media: list | None = None  # the prompt's images and videos (engine/multimodal.py MediaItem)


class Generation:
    """The engine requests of one HTTP request, run concurrently, outputs merged as they come."""

    def __init__(self, engine: "AsyncEngine", jobs: list[Job], timeout: float | None = None):
        self.engine = engine
        self.jobs = jobs
        self.timeout = timeout
        self._deadline: float | None = None
        self.finals: dict[int, RequestOutput] = {}
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self) -> "Generation":
        """Submit every engine request now, on the caller's turn of the event loop (the admission
        check just before counted on exactly that), and pump their outputs in tasks."""
        if self.timeout is not None:
            self._deadline = time.monotonic() + self.timeout
        for job in self.jobs:
            try:
                media = {"media": job.media} if job.media else {}
                stream = self.engine.generate(job.prompt_ids, job.params, job.request_id, **media)
            except Exception as exc:  # a bad prompt: handed to the consumer like any failure
                self._queue.put_nowait((job.index, exc))
                continue
            self._tasks.append(asyncio.create_task(self._pump(job, stream), name=job.request_id))
        return self

    async def _pump(self, job: Job, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((job.index, out))
                if out.finished:
                    return
            # Without this the consumer would wait forever for a final output.
            raise RuntimeError(f"the engine stream of {job.request_id} ended without a final output")
        except Exception as exc:  # handed to the consumer, which decides what the client sees
            self._queue.put_nowait((job.index, exc))

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.jobs)

    async def next(self) -> tuple[int, RequestOutput]:
        """The next output of any choice; re-raises a choice's failure here, in the consumer."""
        if self._deadline is None:
            index, item = await self._queue.get()
        else:
            try:
                index, item = await asyncio.wait_for(self._queue.get(), max(self._deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise errors.request_timeout(self.timeout) from None
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.finals[index] = item
        return index, item

    def close(self) -> None:
        """Stop every unfinished engine request. Synchronous on purpose: it runs in `finally`
        blocks of cancelled tasks, where any await would be cancelled again before it ran."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for job in self.jobs:
            if job.index not in self.finals:
                log.debug("aborting %s", job.request_id)
                self.engine.abort(job.request_id)

    def prompt_usage(self) -> tuple[int, int]:
        """(prompt tokens, cached prompt tokens), each prompt counted once however many choices."""
        prompt_tokens = cached = 0
        seen: set[int] = set()
        for job in self.jobs:
            if job.prompt_index in seen:
                continue
            seen.add(job.prompt_index)
            prompt_tokens += len(job.prompt_ids)
            hits = [self.finals[j.index].num_cached_tokens for j in self.jobs
                    if j.prompt_index == job.prompt_index and j.index in self.finals]
            cached += min(hits, default=0)
        return prompt_tokens, cached

    def completion_tokens(self) -> int:
        return sum(out.num_output_tokens for out in self.finals.values())


async def collect(request: Request, gen: Generation, param: str) -> dict[int, list[RequestOutput]] | None:
    """Run every choice to its end; the outputs of each choice by index, or None when the client left
    (the generation is then aborted). A failed generation is raised as the API error it maps to, naming
    the request field `param` (the prompt, messages or input)."""
    outputs: dict[int, list[RequestOutput]] = {job.index: [] for job in gen.jobs}

    async def run() -> None:
        while not gen.done:
            index, out = await gen.next()
            outputs[index].append(out)

    try:
        await until_disconnect(request.receive, run())
    except ClientDisconnected:
        log.info("client disconnected, aborted")
        return None
    except Exception as exc:
        raise errors.from_generation(exc, param) from None
    finally:
        gen.close()
    return outputs


def sse(payload: Any) -> str:
    """One server-sent event in the framing every client parses: `data: <compact json>` + LF LF."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class EventStream(StreamingResponse):
    """`text/event-stream` whose `on_close` runs however the response ends (done, failed, or the
    client gone: Starlette then cancels the body iterator without closing it)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
