"""Metric maths of the serving benchmark, on timestamps a request recorded. Pure functions, so they can
be tested on recorded timestamps without a server.

Definitions (the ones vLLM's and SGLang's benchmark scripts use, so numbers compare):

- TTFT: request sent -> first chunk that carries output (a role-only or empty chunk is not output).
- E2E: request sent -> last output chunk (the final usage chunk and `[DONE]` are not output).
- TPOT: (E2E - TTFT) / (output tokens - 1): the mean time per token after the first; undefined (None)
  for a one-token answer. Output tokens come from the server's usage when it reports one, because a
  chunk can carry several tokens (detokenisation holding back a partial character, speculative decoding).
- ITL: the gaps between consecutive output chunks; one request gives (chunks - 1) values.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are `time.perf_counter()` seconds."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried output
    output_tokens: int = 0  # usage.completion_tokens, else the number of output chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens when reported
    usage_reported: bool = False
    error: str | None = None
    concurrency: int = 0
    round: int = 0
    index: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        return tpot(self.ttft, self.e2e, self.output_tokens) if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return inter_token_latencies(self.chunk_times)


def tpot(ttft: float, e2e: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None when there is no second token."""
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def inter_token_latencies(chunk_times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(chunk_times)]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default,
    `method="linear"`), None for no values. Written out so the maths is visible and dependency-free."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float | None]:
    """mean and P50/P90/P95/P99 of `values` (all None for an empty list)."""
    out: dict[str, float | None] = {"mean": statistics.fmean(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


@dataclass
class RoundStats:
    """What one round at one concurrency measured."""

    concurrency: int
    round: int
    warmup: bool
    duration_s: float
    completed: int
    errors: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    interrupted: bool = False

    def flat(self) -> dict[str, object]:
        """One CSV row: the nested percentile dicts become ttft_p50, tpot_p99, ..."""
        row: dict[str, object] = {k: getattr(self, k) for k in (
            "concurrency", "round", "warmup", "interrupted", "duration_s", "completed", "errors", "input_tokens",
            "output_tokens", "request_throughput", "output_throughput")}
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for key, value in getattr(self, metric).items():
                row[f"{metric}_{key}"] = value
        return row


def round_stats(records: list[RequestRecord], *, concurrency: int, round_no: int, warmup: bool,
                duration_s: float, interrupted: bool = False) -> RoundStats:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return RoundStats(
        concurrency=concurrency, round=round_no, warmup=warmup, duration_s=duration_s, completed=len(ok),
        errors=len(records) - len(ok), input_tokens=sum(r.prompt_tokens or 0 for r in ok), output_tokens=out_tokens,
        request_throughput=per_s(len(ok)), output_throughput=per_s(out_tokens),
        ttft=describe([r.ttft for r in ok]), tpot=describe([t for r in ok if (t := r.tpot) is not None]),
        itl=describe([g for r in ok for g in r.itl]), e2e=describe([r.e2e for r in ok]), interrupted=interrupted)


def median_of_rounds(rounds: list[RoundStats]) -> dict[str, object]:
    """The summary of one concurrency: the median, over the measured (non-warm-up) rounds, of every
    number a round reports. The median rather than the best round, so one lucky round does not flatter
    the server and one unlucky round does not condemn it. Falls back to the warm-up round (flagged) when
    it is the only one."""
    measured = [r for r in rounds if not r.warmup and not r.interrupted] or [r for r in rounds if not r.warmup]
    from_warmup = not measured
    if from_warmup:
        measured = rounds
    rows = [r.flat() for r in measured]
    summary: dict[str, object] = {"concurrency": rounds[0].concurrency, "rounds_used": [r.round for r in measured],
                                  "from_warmup": from_warmup}
    for key in rows[0]:
        if key in ("concurrency", "round", "warmup", "interrupted"):
            continue
        values = [row[key] for row in rows if row[key] is not None]
        summary[key] = statistics.median(values) if values else None
    summary["errors"] = sum(r.errors for r in measured)  # errors add up; a median would hide them
    tput = [r.output_throughput for r in measured]
    # max / min output throughput of the rounds used: far above 1, the host or the server is not steady
    # and the median deserves more rounds before anyone trusts it
    summary["throughput_spread"] = max(tput) / min(tput) if tput and min(tput) > 0 else None
    return summary
