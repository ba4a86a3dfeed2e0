"""Prometheus metrics of one app: their definitions and how they are updated.

Every app has its own `CollectorRegistry` (never the process-wide default: tests build many apps in
one process). Three sources feed it:

- per-request timings and lengths, from `AsyncEngine.generate` through `RequestMetrics` (the engine's
  no-op default is replaced by `ServerMetrics.attach` once the model is loaded);
- engine-wide counters and gauges (tokens, prefix cache, preemptions, queue sizes, KV blocks), read
  from `engine.stats()` at scrape time by `_EngineCollector`, so they cost nothing per step;
- HTTP requests by route template and status code, from `HTTPMetricsMiddleware`.

Names follow vLLM's `vllm:` style with a `flagdeploy:` prefix; docs/metrics.md lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flagdeploy.engine.async_engine import RequestMetrics

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine
    from flagdeploy.engine.request import RequestOutput

PREFIX = "flagdeploy:"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 640.0, 2560.0)
# 1, 2, 5, 10, 20, 50, ... 1M tokens: fixed, so they do not depend on the model loaded later.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)

UNMATCHED_ROUTE = "unmatched"  # any path no route answers: one label value, not one per path

# engine.stats() key -> (counter name without _total, help)
_ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of the requests added to the engine."),
    "generation_tokens": ("generation_tokens", "Tokens generated (sampled) by the engine."),
    "prefix_cache_queried_tokens": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "preemptions": ("num_preemptions", "Sequences preempted (KV blocks freed, recomputed later)."),
    "steps": ("engine_steps", "Engine steps (batched forward passes) run."),
    "step_seconds": ("engine_step_seconds", "Seconds spent inside engine steps (forward, sampling, detokenizing)."),
    # speculative decoding (vLLM's spec_decode_* names; acceptance length = 1 + accepted / drafts)
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Speculative verify steps of a sequence (drafts proposed)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    # media: items run through the vision encoder, and items found in its cache instead
    "mm_items_encoded": ("mm_items_encoded", "Images and videos run through the model's vision encoder."),
    "mm_encoder_cache_hits": ("mm_encoder_cache_hits", "Images and videos whose features came from the encoder cache."),
    # prefill-decode disaggregation (engine/kv_transfer.py): a prefill instance sends, a decode instance receives
    "kv_transfer_sent_requests": ("kv_transfer_sent_requests", "Prefills whose caches were staged for a decode instance."),
    "kv_transfer_sent_blocks": ("kv_transfer_sent_blocks", "KV blocks staged for decode instances."),
    "kv_transfer_sent_bytes": ("kv_transfer_sent_bytes", "Bytes staged for decode instances."),
    "kv_transfer_sent_seconds": ("kv_transfer_sent_seconds", "Seconds spent staging caches for decode instances."),
    "kv_transfer_received_requests": ("kv_transfer_received_requests", "Requests whose prompt caches came from a prefill instance."),
    "kv_transfer_received_blocks": ("kv_transfer_received_blocks", "KV blocks received from prefill instances."),
    "kv_transfer_received_bytes": ("kv_transfer_received_bytes", "Bytes received from prefill instances."),
    "kv_transfer_received_seconds": ("kv_transfer_received_seconds", "Seconds spent receiving caches."),
    "kv_transfer_received_prompt_tokens": ("kv_transfer_received_prompt_tokens",
                                           "Prompt tokens received from a prefill instance rather than computed here."),
    "kv_transfer_failed": ("kv_transfer_failed", "Transfers that failed (the request failed, or computed its prompt)."),
    "kv_transfer_expired": ("kv_transfer_expired", "Staged caches no decode instance collected (freed at the timeout)."),
}
_ENGINE_GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_blocks_free": ("kv_cache_blocks_free", "Free KV-cache blocks."),
    "kv_blocks_total": ("kv_cache_blocks_total", "KV-cache blocks in all."),
    "decode_step_compiled": ("decode_step_compiled", "1 while decode steps run through the compiled step, else 0."),
    "decode_step_compiling": ("decode_step_compiling", "1 while the decode step compiles in the background, else 0."),
    "kv_transfer_held": ("kv_transfer_held", "Staged caches waiting for their decode instance."),
    "kv_transfer_buffer_bytes_in_use": ("kv_transfer_buffer_bytes_in_use", "Bytes of the KV transfer buffer in use."),
}


class _EngineCollector(Collector):
    """Engine state, read at scrape time: nothing to update on the hot path."""

    def __init__(self, get_engine: Callable[[], "AsyncEngine | None"]):
        self._get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
        engine = self._get_engine()
        yield GaugeMetricFamily(PREFIX + "model_ready", "1 once the model is loaded and serving, else 0.",
                                value=int(engine is not None))
        if engine is None:
            return
        stats_fn = getattr(engine, "stats", None)
        stats: dict[str, Any] = stats_fn() if stats_fn is not None else {}
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=stats[key])
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            fam = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.", labels=["position"])
            for pos, n in enumerate(per_pos):
                fam.add_metric([str(pos)], n)
            yield fam
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=stats[key])
        total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
        if total:
            yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (1 = full).", value=(total - free) / total)
        if "prefix_cache_queried_tokens" in stats:
            queried = stats["prefix_cache_queried_tokens"]
            rate = stats.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
            yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate",
                                    "Prefix-cache hit tokens / queried tokens since start.", value=rate)


class ServerMetrics(RequestMetrics):
    """The metrics of one app. `AsyncEngine.generate` calls the `RequestMetrics` methods."""

    def __init__(self, get_engine: Callable[[], "AsyncEngine | None"]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by method, route template and status code.",
            ["method", "route", "status"], registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Engine requests ended, by finish reason (stop, length, abort, error).",
            ["finished_reason"], registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Submission to the first output token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time between output tokens after the first.",
            buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Submission to the final output of a finished request.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Submission to the first step that schedules the request.",
            buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_len = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt length of finished requests, in tokens.",
            buckets=TOKEN_BUCKETS, registry=r)
        self.generation_len = Histogram(
            PREFIX + "request_generation_tokens", "Output length of finished requests, in tokens.",
            buckets=TOKEN_BUCKETS, registry=r)
        r.register(_EngineCollector(get_engine))

    # ---- RequestMetrics: called from the event loop, once per output --------------------------------

    def first_output(self, ttft: float, queue_time: float | None) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue_time.observe(queue_time)

    def next_output(self, interval: float, num_tokens: int) -> None:
        if num_tokens == 1:  # the engine's case: one token per step
            self.tpot.observe(interval)
        elif num_tokens > 1:
            per_token = interval / num_tokens
            for _ in range(num_tokens):
                self.tpot.observe(per_token)

    def finished(self, out: "RequestOutput", e2e: float) -> None:
        self.e2e.observe(e2e)
        self.prompt_len.observe(out.num_prompt_tokens)
        self.generation_len.observe(out.num_output_tokens)
        self.request_success.labels(out.finish_reason or "stop").inc()

    def unfinished(self, reason: str) -> None:
        self.request_success.labels(reason).inc()

    # ---- wiring -------------------------------------------------------------------------------------

    def attach(self, engine: "AsyncEngine") -> "AsyncEngine":
        """Make `engine` report its requests here (engines without a `metrics` slot are left alone)."""
        if hasattr(engine, "metrics"):
            engine.metrics = self
        return engine

    def exposition(self) -> tuple[bytes, str]:
        """The scrape body and its content type: always the classic text format 0.0.4, which every
        Prometheus reads. (prometheus_client's OpenMetrics encoder, negotiated by Accept, escapes
        the `:` of sample names but not of their HELP/TYPE lines.)"""
        return generate_latest(self.registry), TEXT_CONTENT_TYPE


class HTTPMetricsMiddleware:
    """Pure ASGI: counts each HTTP request by method, matched route template and status code.

    The route is read after the app ran (the router puts the matched route in the scope), so raw
    paths never become label values."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.counter = metrics.http_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started becomes a 500 outside this middleware

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED_ROUTE
            self.counter.labels(scope["method"], template, str(status)).inc()
