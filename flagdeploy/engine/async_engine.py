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
from .request import RequestOutput, SamplingParams

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
        # what the served model takes (the server refuses other media with a 400 rather than dropping them)
        self.input_modalities: frozenset[str] = getattr(engine, "input_modalities", frozenset({"text"}))
        self.media_processor = getattr(engine, "media_processor", None)  # server/media.py prepares media with it
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Written on the event loop (submit) and, through call_soon_threadsafe, when the engine thread
        # is done with a request: the admission count (`would_wait`).
        self._in_flight: dict[str, asyncio.AbstractEventLoop] = {}
        # Written by the engine thread after each step: the sequences the engine runs at once now (fewer
        # than --max-num-seqs while the KV cache is full), the other side of `would_wait`'s count.
        self._slots = self.max_num_seqs
        self._stop = threading.Event()
        self.metrics = RequestMetrics()
        self._thread = threading.Thread(target=self._loop, name="flagdeploy-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop --------------------------------------------------------------

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 media: list | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request now and return its outputs as an async iterator.

        Submission is synchronous on purpose: the request counts as in flight (`would_wait`) from the
        moment this returns, so an admission check followed by `generate` on the event loop, with no
        await between them, holds its limit for any arrival pattern. Raises what `check_prompt` does."""
        self.engine.check_prompt(prompt_token_ids)  # raise before anything is queued
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._in_flight[request_id] = loop
        self._inbox.put(("add", request_id, prompt_token_ids, params, media))
        return self._outputs(request_id, q, time.perf_counter())

    async def _outputs(self, request_id: str, q: asyncio.Queue, submitted: float) -> AsyncIterator[RequestOutput]:
        metrics, last = self.metrics, None
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

    def check_params(self, params: "SamplingParams") -> None:
        """Raise what `generate` would for token ids outside the vocabulary in the sampling parameters."""
        self.engine.check_params(params)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream gets nothing more. It stays in flight until the engine thread
        has dropped it, so a burst of aborts cannot make room that is not there yet."""
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    def in_flight(self) -> int:
        """Requests submitted and not yet finished, failed or dropped by the engine thread."""
        return len(self._in_flight)

    def would_wait(self, n: int) -> int:
        """How many requests would wait (in flight beyond the sequence slots) if `n` more arrived now.

        Counted on the event loop from submissions and the engine thread's confirmations, never from
        the scheduler's lists: those change under a running step, and a burst checked against them
        saw an empty queue thirty times over. A request leaves the count only when the engine thread
        says it is gone. The places are the scheduler's `slots()` as of the last step: --max-num-seqs, or
        fewer where the KV cache is the limit, which holds requests waiting as surely as the slots do (a
        server with more slots than its cache could fill used to queue without bound and never answer 429).
        A burst that arrives before any step has filled the cache is counted against --max-num-seqs."""
        return max(0, len(self._in_flight) + n - self._slots)

    def stats(self) -> dict[str, int | float | list[int]]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self.engine.close()

    # ---- the engine thread -----------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand one step's outputs (or failures) to their streams: one wake-up of each event loop per step,
        not one per request (each wake-up is a write to the loop's self-pipe and a GIL hand-over)."""
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], ([], []))[0].append((target[1], item))
            if isinstance(item, BaseException) or item.finished:  # no longer holds a place in the engine
                loop = self._in_flight.get(request_id)
                if loop is not None:
                    by_loop.setdefault(loop, ([], []))[1].append(request_id)
        for loop, (puts, released) in by_loop.items():
            loop.call_soon_threadsafe(self._arrive, puts, released)

    def _arrive(self, puts: list[tuple[asyncio.Queue, object]], released: list[str]) -> None:
        """On the event loop: the outputs into their queues, finished requests out of the in-flight count."""
        for q, item in puts:
            q.put_nowait(item)
        for request_id in released:
            self._in_flight.pop(request_id, None)

    def _release(self, request_id: str) -> None:
        """The request no longer holds a place in the engine (finished, failed or aborted)."""
        loop = self._in_flight.get(request_id)
        if loop is not None:
            loop.call_soon_threadsafe(self._in_flight.pop, request_id, None)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if msg[0] == "add":
                _, rid, prompt, params, media = msg
                try:
                    self.engine.add_request(rid, prompt, params, media=media)
                except Exception as exc:  # bad input for this request only
                    self._deliver([(rid, exc)])
            elif msg[0] == "abort":
                self.engine.abort(msg[1])
                self._release(msg[1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                self._slots = self.max_num_seqs  # an idle engine's cache holds no one back
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                failed = list(self.engine.requests)
                for rid in failed:
                    self.engine.abort(rid)
                self._deliver([(rid, RuntimeError(f"generation failed: {exc}")) for rid in failed])
                continue
            self._slots = self.engine.scheduler.slots()
            self._deliver([(out.request_id, out) for out in outputs])
