"""Prefix-cache evidence: does a repeated long prompt actually skip its prefill?

A flag saying "prefix caching on" proves nothing: the cache may be too small, the block size may not
divide the prompt, or a chat template may put a timestamp in front. So this asks two independent
witnesses and trusts neither alone:

1. the client: TTFT of a cold request (a prompt that starts with a random nonce, so no earlier run can
   have cached it) against the TTFT of identical repeats;
2. the server: its own prefix-cache counters on /metrics before and after (ours and vLLM v1: hit and
   queried token counters; older vLLM: `vllm:gpu_prefix_cache_hit_rate`; SGLang: `sglang:cache_hit_rate`).

"evidence complete" only when the warm requests are faster and the server counted hits.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flagdeploy.bench.client import BenchError, Endpoint, stream_request

log = logging.getLogger(__name__)

# (engine, hits counter, queries counter) for engines that count tokens; (engine, gauge) for hit-rate gauges
COUNTERS = (("flagdeploy", "flagdeploy:prefix_cache_hits", "flagdeploy:prefix_cache_queries"),
            ("vllm", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"))
GAUGES = (("vllm (v0)", "vllm:gpu_prefix_cache_hit_rate"), ("sglang", "sglang:cache_hit_rate"))

WORDS = ("river", "mountain", "lantern", "copper", "violet", "harbor", "meadow", "glacier", "ember", "orchard",
         "falcon", "canyon", "willow", "saffron", "quartz", "tundra", "beacon", "cobalt", "prairie", "summit",
         "thistle", "marble", "cedar", "lagoon", "aurora", "basalt")


def scrape(ep: Endpoint) -> dict[str, float] | None:
    """Sum of every sample of every family on /metrics, by sample name (labels such as model or engine
    index summed away); None when there is no /metrics."""
    text = ep.metrics_text()
    if text is None:
        return None
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
    except ValueError as exc:
        log.warning("cannot parse %s/metrics: %s", ep.base_url, exc)
        return None
    return values


@dataclass
class ServerCounters:
    """What the server's own metrics say about the repeats."""

    engine: str | None = None  # whose metric names were found
    hit_tokens: float | None = None  # counted during the run (counter engines)
    queried_tokens: float | None = None
    hit_rate_before: float | None = None  # gauge engines
    hit_rate_after: float | None = None
    hit: bool = False
    note: str = ""


def server_counters(before: dict[str, float] | None, after: dict[str, float] | None) -> ServerCounters:
    if before is None or after is None:
        return ServerCounters(note="the server has no readable /metrics")
    for engine, hits, queries in COUNTERS:
        h = next((n for n in (f"{hits}_total", hits) if n in after), None)
        q = next((n for n in (f"{queries}_total", queries) if n in after), None)
        if h:
            dh = after[h] - before.get(h, 0.0)
            dq = after[q] - before.get(q, 0.0) if q else None
            return ServerCounters(engine=engine, hit_tokens=dh, queried_tokens=dq, hit=dh > 0,
                                  note=f"{h} rose by {dh:g}" + (f" of {dq:g} queried tokens" if dq is not None else ""))
    for engine, gauge in GAUGES:
        if gauge in after:
            b, a = before.get(gauge, 0.0), after[gauge]
            return ServerCounters(engine=engine, hit_rate_before=b, hit_rate_after=a, hit=a > b or (a > 0 and b == a == 1),
                                  note=f"{gauge} went {b:.3f} -> {a:.3f}")
    return ServerCounters(note="no known prefix-cache metric on /metrics (looked for "
                               + ", ".join([c[1] for c in COUNTERS] + [g[1] for g in GAUGES]) + ")")


@dataclass
class PrefixResult:
    prompt_tokens: int | None
    cold_ttft_s: float
    warm_ttft_s: list[float]
    cached_tokens: list[int | None]  # usage.prompt_tokens_details.cached_tokens of each repeat, where reported
    server: ServerCounters = field(default_factory=ServerCounters)
    speedup: float | None = None
    client_hit: bool = False
    evidence_complete: bool = False
    verdict: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def long_prompt(words: int, seed: int | None = None) -> str:
    """A fixed-looking long prompt that begins with a random nonce, so its first block is new to the
    server even when the same command ran before."""
    rng = random.Random(seed)
    nonce = f"{rng.getrandbits(64):016x}"
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Session {nonce}. Read the following notes carefully.\n{body}\nSummarise the notes in one sentence."


async def _ttft(client: httpx.AsyncClient, ep: Endpoint, prompt: str,
                max_tokens: int) -> tuple[float, int | None, int | None]:
    """TTFT, prompt tokens and cached tokens of one streamed completion."""
    body = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = await stream_request(client, ep.api + "/completions", body)
    if res.first_token_time is None:
        raise BenchError("the server streamed no output and no finish reason for the prefix-cache prompt")
    return res.first_token_time - start, res.prompt_tokens, res.cached_tokens


async def run_prefix(ep: Endpoint, *, prompt_words: int = 300, repeats: int = 3, max_tokens: int = 4,
                     seed: int | None = None, min_speedup: float = 1.1) -> PrefixResult:
    """One cold request then `repeats` identical ones, in sequence (concurrency would blur TTFT)."""
    prompt = long_prompt(prompt_words, seed)
    before = scrape(ep)
    warm: list[float] = []
    cached: list[int | None] = []
    async with ep.async_client(1) as client:
        cold, prompt_tokens, _ = await _ttft(client, ep, prompt, max_tokens)
        for _ in range(repeats):
            t, _, c = await _ttft(client, ep, prompt, max_tokens)
            warm.append(t)
            cached.append(c)
    after = scrape(ep)
    res = PrefixResult(prompt_tokens=prompt_tokens, cold_ttft_s=cold, warm_ttft_s=warm, cached_tokens=cached,
                       server=server_counters(before, after))
    med = statistics.median(warm) if warm else None
    res.speedup = cold / med if med else None
    res.client_hit = bool(res.speedup and res.speedup >= min_speedup)
    res.evidence_complete = res.client_hit and res.server.hit
    if res.evidence_complete:
        res.verdict = "evidence complete: repeats are faster and the server counted prefix-cache hits"
    elif res.client_hit:
        res.verdict = f"evidence incomplete: repeats are faster, but the server's counters show no hit ({res.server.note})"
    elif res.server.hit:
        res.verdict = (f"evidence incomplete: the server counted hits ({res.server.note}) but warm TTFT is not "
                       f"{min_speedup:g}x faster than cold; the prompt may be too short to tell")
    else:
        res.verdict = f"no prefix caching seen: warm TTFT is not faster and {res.server.note or 'no hits counted'}"
    return res


def format_prefix(res: PrefixResult) -> str:
    warm = ", ".join(f"{t * 1000:.1f}" for t in res.warm_ttft_s)
    lines = [f"prompt tokens:   {res.prompt_tokens if res.prompt_tokens is not None else 'not reported'}",
             f"cold TTFT:       {res.cold_ttft_s * 1000:.1f} ms",
             f"warm TTFT:       {warm} ms (median speed-up {res.speedup:.2f}x)" if res.speedup else f"warm TTFT: {warm}",
             f"cached tokens:   {', '.join('-' if c is None else str(c) for c in res.cached_tokens)} (usage, per repeat)",
             f"server counters: {res.server.engine or '-'}: {res.server.note}",
             res.verdict]
    return "\n".join(lines)
