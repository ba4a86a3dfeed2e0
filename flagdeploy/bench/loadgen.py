"""The serving load generator: asyncio + httpx streaming, rounds at each concurrency.

Closed loop by default: `concurrency` workers each send their next request as soon as the last one
ended, which is how vLLM's and SGLang's `--max-concurrency` behave. With a request rate, requests
arrive as a Poisson process (seeded) and the concurrency is a cap on those in flight.

Every (concurrency, round) gets the same prompts, so rounds differ only in the server's state: the
first round pays one-time costs (graph capture, compilation of a new shape, cache allocation) and is
reported apart as warm-up, never folded into the summary.

Around the measured rounds of each concurrency the server's /metrics is read (where it has one), so the
summary can carry what the server counted over exactly those rounds: speculative decoding's acceptance
length and rates (`specdecode`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flagdeploy.bench.client import BenchError, Endpoint, stream_request
from flagdeploy.bench.specdecode import SpecStats, read_spec, spec_stats
from flagdeploy.bench.stats import (
    RequestRecord,
    RoundStats,
    median_of_rounds,
    round_stats,
)

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One request to send: token ids or text for /v1/completions, or messages for chat. Greedy unless
    `sampling` names the OpenAI (and vLLM / llama-server) fields to sample with, e.g. {"temperature": 0.7,
    "top_p": 0.9}."""

    prompt: list[int] | str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 64
    sampling: dict | None = None

    def request(self, model: str, ignore_eos: bool) -> tuple[str, dict]:
        body: dict = {"model": model, "max_tokens": self.max_tokens, "stream": True, "temperature": 0.0,
                      "stream_options": {"include_usage": True}, **(self.sampling or {})}
        if ignore_eos:
            body["ignore_eos"] = True  # fixed output length (vLLM, SGLang, ours accept it)
        if self.messages is not None:
            return "/chat/completions", {**body, "messages": self.messages}
        return "/completions", {**body, "prompt": self.prompt}


def random_prompts(n: int, input_len: int, output_len: int, seed: int, vocab_size: int) -> list[Prompt]:
    """Fixed-length prompts of random token ids, sent as ids so the server's prompt length is exactly
    `input_len` whatever its tokenizer. Ids come from [100, vocab_size): low ids are often special
    tokens (BOS/EOS/pad) that would end or confuse the prompt."""
    if vocab_size <= 100:
        raise BenchError(f"--vocab-size {vocab_size} is too small; random prompts use ids 100..vocab_size-1")
    rng = random.Random(seed)
    return [Prompt(prompt=[rng.randrange(100, vocab_size) for _ in range(input_len)], max_tokens=output_len)
            for _ in range(n)]


def dataset_prompts(path: str | Path, n: int, output_len: int, seed: int) -> list[Prompt]:
    """Prompts from a JSONL file: each line {"prompt": "..."} (completions) or {"messages": [...]}
    (chat), optionally with "max_tokens" or "output_len". Lines are sampled with the seed, repeated
    when the file has fewer than `n`."""
    path = Path(path)
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        raise BenchError(f"cannot read --dataset {path}: {exc.strerror or exc}") from None
    items: list[Prompt] = []
    for no, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise BenchError(f"{path}:{no} is not JSON ({exc}); each line must be one object") from None
        limit = int(rec.get("max_tokens") or rec.get("output_len") or output_len) if isinstance(rec, dict) else 0
        if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            items.append(Prompt(messages=rec["messages"], max_tokens=limit))
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), (str, list)):
            items.append(Prompt(prompt=rec["prompt"], max_tokens=limit))
        else:
            raise BenchError(f"{path}:{no} has neither a \"prompt\" string nor a \"messages\" list")
    if not items:
        raise BenchError(f"--dataset {path} has no prompts")
    rng = random.Random(seed)
    order = list(range(len(items)))
    rng.shuffle(order)
    return [items[order[i % len(order)]] for i in range(n)]


@dataclass
class LoadConfig:
    concurrencies: list[int]
    rounds: int = 3
    num_prompts: int = 0  # per round; 0: 4 x concurrency
    request_rate: float | None = None
    seed: int = 0
    ignore_eos: bool = True
    server_metrics: bool = True  # read /metrics around the measured rounds of each concurrency

    def prompts_for(self, concurrency: int) -> int:
        return self.num_prompts or max(4 * concurrency, 1)


@dataclass
class ServeResults:
    """Everything measured so far; filled in place so an interrupted run still has its finished rounds
    and the requests of the round it was in."""

    rounds: list[RoundStats] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    interrupted: bool = False
    spec: dict[int, SpecStats] = field(default_factory=dict)  # by concurrency, where the server exposes it

    def summaries(self, concurrencies: list[int]) -> list[dict]:
        """One summary per concurrency that has rounds: the median of its measured rounds
        (`stats.median_of_rounds`), plus `speculative` (a `SpecStats` dict) where the server counted it."""
        out = []
        for c in concurrencies:
            rs = [r for r in self.rounds if r.concurrency == c]
            if rs:
                summary = median_of_rounds(rs)
                if c in self.spec:
                    summary["speculative"] = self.spec[c].to_dict()
                out.append(summary)
        return out


async def _one(client: httpx.AsyncClient, ep: Endpoint, p: Prompt, rec: RequestRecord, ignore_eos: bool) -> None:
    path, body = p.request(ep.model, ignore_eos)
    rec.start = time.perf_counter()
    try:
        res = await stream_request(client, ep.api + path, body)
    except (BenchError, httpx.HTTPError) as exc:
        rec.error = str(exc) or exc.__class__.__name__
        return
    rec.chunk_times = res.chunk_times
    rec.prompt_tokens = res.prompt_tokens
    rec.usage_reported = res.completion_tokens is not None
    rec.output_tokens = res.completion_tokens if res.completion_tokens is not None else len(res.chunk_times)
    if not res.chunk_times:
        rec.error = "the stream ended without any output"


async def run_round(ep: Endpoint, prompts: list[Prompt], concurrency: int, round_no: int, cfg: LoadConfig,
                    results: ServeResults, on_done: Callable[[], None] = lambda: None) -> RoundStats:
    """Send `prompts` at `concurrency`; records go into `results` as they are created."""
    records = [RequestRecord(start=0.0, concurrency=concurrency, round=round_no, index=i) for i in range(len(prompts))]
    results.records.extend(records)
    rng = random.Random(cfg.seed * 1000003 + concurrency * 101 + round_no)
    sem = asyncio.Semaphore(concurrency)
    started = time.perf_counter()
    interrupted = False
    async with ep.async_client(concurrency) as client:
        async def worker(i: int) -> None:
            async with sem:
                await _one(client, ep, prompts[i], records[i], cfg.ignore_eos)
            on_done()

        tasks = []
        try:
            for i in range(len(prompts)):
                if cfg.request_rate and i:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
                tasks.append(asyncio.create_task(worker(i)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            interrupted = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            duration = time.perf_counter() - started
            done = [r for r in records if r.ok or r.error]
            if interrupted:
                # only requests that finished count; the round is flagged and stays out of the summary
                results.records[:] = [r for r in results.records if r.ok or r.error]
            stats = round_stats(done, concurrency=concurrency, round_no=round_no,
                                warmup=round_no == 0, duration_s=duration, interrupted=interrupted)
            results.rounds.append(stats)
    return stats


def _tqdm_disable(progress: bool | None) -> bool | None:
    """tqdm's `disable`: None (auto) shows a bar only on a terminal."""
    return None if progress is None else not progress


async def run_serve(ep: Endpoint, make_prompts: Callable[[int], list[Prompt]], cfg: LoadConfig,
                    results: ServeResults, progress: bool | None = None) -> ServeResults:
    """All rounds at all concurrencies, in order. A KeyboardInterrupt (Ctrl-C) cancels the task running
    this; the caller keeps `results`."""
    from tqdm import tqdm

    total = sum(cfg.prompts_for(c) * cfg.rounds for c in cfg.concurrencies)
    metrics = cfg.server_metrics  # off for good once the server shows it has no readable /metrics
    with tqdm(total=total, unit="req", desc="bench serve", disable=_tqdm_disable(progress), leave=False) as bar:
        for c in cfg.concurrencies:
            prompts = make_prompts(cfg.prompts_for(c))
            before = None
            for rnd in range(cfg.rounds):
                # the server's counters cover the rounds the summary uses: after warm-up (unless it is the only one)
                if metrics and rnd == min(1, cfg.rounds - 1):
                    before = await asyncio.to_thread(read_spec, ep)
                    metrics = before is not None
                bar.set_postfix_str(f"concurrency {c} round {rnd}{' (warm-up)' if rnd == 0 else ''}")
                stats = await run_round(ep, prompts, c, rnd, cfg, results, on_done=lambda: bar.update(1))
                log.info("concurrency %d round %d: %d ok, %d errors, %.1f tok/s", c, rnd, stats.completed,
                         stats.errors, stats.output_throughput)
            if before is not None:
                spec = spec_stats(before, await asyncio.to_thread(read_spec, ep))
                if spec is not None:
                    results.spec[c] = spec
    return results
