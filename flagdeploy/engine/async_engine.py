"""The engine loop on its own thread, with an asyncio face for the server.

torch releases the GIL inside its kernels, so the event loop keeps accepting and streaming while a
step runs. Requests and aborts cross into the loop thread through a queue; outputs come back through
`call_soon_threadsafe` into one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from .llm_engine import LLMEngine
from .sampling import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class RequestMetrics:
    """What `AsyncEngine.generate` reports per request (times in seconds). This default records
    nothing; the server installs one that feeds Prometheus (flagdeploy/server/metrics.py)."""

    def first_output(self, ttft: float, queue_time: float | None) -> None:
        pass

    def next_output(self, interval: float, num_tokens: int) -> None:
        pass

    def finished(self, out: RequestOutput, e2e: float) -> None:
        pass

    def unfinished(self, reason: str) -> None:
        """The request ended without a final output: "abort" (client gone) or "error"."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self._inbox: queue.Queue = queue.Queue()
        self._inbox_adds = 0  # requests handed to the engine thread and not yet taken by it
        self._count_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.metrics = RequestMetrics()
        self._thread = threading.Thread(target=self._loop, name="flagdeploy-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop --------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        self.engine.check_prompt(prompt_token_ids)  # raise before anything is queued
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        with self._count_lock:
            self._inbox_adds += 1
        metrics, submitted, last = self.metrics, time.perf_counter(), None
        self._inbox.put(("add", request_id, prompt_token_ids, params))
        finished, failed = False, False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    failed = True
                    raise item
                now = time.perf_counter()  # measured before the consumer sees the output
                if last is None:
                    queued = None if item.scheduled_at is None else max(item.scheduled_at - submitted, 0.0)
                    metrics.first_output(now - submitted, queued)
                else:
                    metrics.next_output(now - last, len(item.token_ids))
                last = now
                if item.finished:
                    finished = True
                    metrics.finished(item, now - submitted)
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the client went away (or the consumer stopped early)
                self.abort(request_id)
                metrics.unfinished("error" if failed else "abort")

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise what `generate` would (empty, too long, ids outside the vocabulary) without queueing."""
        self.engine.check_prompt(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def would_wait(self, n: int) -> int:
        """How many requests would wait (queued, not running) if `n` more arrived now: those in the
        inbox and the scheduler's waiting list, plus the newcomers, less the free sequence slots.
        Read from the event loop without a step's lock: the lengths are at most one step stale,
        which is precise enough to bound a queue."""
        scheduler = self.engine.scheduler
        free = max(0, scheduler.max_num_seqs - len(scheduler.running))
        return max(0, self._inbox_adds + len(scheduler.waiting) + n - free)

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self.engine.close()

    # ---- the engine thread -----------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if msg[0] == "add":
                _, rid, prompt, params = msg
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as exc:  # bad input for this request only
                    self._deliver(rid, exc)
                finally:  # after add_request: in the waiting list now, so never counted as gone
                    with self._count_lock:
                        self._inbox_adds -= 1
            elif msg[0] == "abort":
                self.engine.abort(msg[1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"generation failed: {exc}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
