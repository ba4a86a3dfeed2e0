"""An operator's load test and a hostile burst against a real `flagdeploy serve` (issue 34).

    python benchmarks/server_load.py [--streams 150] [--hang-up 0.3] [--bursts 10]

Starts `flagdeploy serve` on the default model twice, as separate processes on loopback:

- streams: `--streams` concurrent streamed chats (32 tokens each) against a server with room for all of
  them to wait (--max-num-seqs 16 --max-waiting 256); a fraction `--hang-up` of the clients hangs up after
  the first few events. Meanwhile /health is polled every 50 ms and /metrics every 100 ms.
- burst: `--bursts` times, 30 streamed requests sent at once at a server with --max-num-seqs 2
  --max-waiting 2; admitted streams are held open until all 30 have their answer.

Prints completed, aborted, status counts, the largest waiting gauge seen, how long the gauges take to return
to idle after the load, and /health latency under load against the same server idle (the baseline of this
run) as a ratio. The goal on the 2-core machine: /health p99 at most 0.5 s with 150 streams, and never more
admitted in a burst than the slots plus the waiting places.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flagdeploy.net import free_port

CHAT = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


class Server:
    """`flagdeploy serve` in a subprocess, ready when /ready says so."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flagdeploy", "serve", "--port", str(self.port),
                                      "--max-model-len", "1024", "--kv-cache-memory", "256MiB", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("flagdeploy serve exited while loading")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("flagdeploy serve did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def gauges(client: httpx.AsyncClient) -> tuple[int, int]:
    r = await client.get("/metrics")
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(r.text) if f.samples}
    return int(values["flagdeploy:num_requests_running"]), int(values["flagdeploy:num_requests_waiting"])


async def health_latencies(client: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await client.get("/health")
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)


async def watch_waiting(client: httpx.AsyncClient, stop: asyncio.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append((await gauges(client))[1])
        await asyncio.sleep(0.1)


async def until_idle(client: httpx.AsyncClient, timeout: float = 120) -> float:
    t = time.perf_counter()
    while await gauges(client) != (0, 0):
        if time.perf_counter() - t > timeout:
            return float("inf")
        await asyncio.sleep(0.05)
    return time.perf_counter() - t


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def idle_health(url: str, n: int = 40) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await c.get("/health")
            out.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
        return out


async def streams(url: str, n: int, hang_up: float) -> None:
    rng = random.Random(0)
    quitters = set(rng.sample(range(n), int(n * hang_up)))
    statuses: Counter[str] = Counter()
    completed = aborted = 0
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    baseline = await idle_health(url)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c, \
            httpx.AsyncClient(base_url=url, timeout=30) as probe:
        stop = asyncio.Event()
        health: list[float] = []
        waiting: list[int] = []
        watchers = [asyncio.create_task(health_latencies(probe, stop, health)),
                    asyncio.create_task(watch_waiting(probe, stop, waiting))]

        async def one(i: int) -> None:
            nonlocal completed, aborted
            body = {"messages": CHAT, "max_tokens": 32, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                statuses[str(r.status_code)] += 1
                if r.status_code != 200:
                    return
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data:")
                    if i in quitters and events >= 3:
                        aborted += 1
                        return  # leaving the block closes the connection mid-stream
                completed += 1

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=False)
        load_s = time.perf_counter() - t
        idle_after = await until_idle(probe)
        stop.set()
        await asyncio.gather(*watchers)
    p99, base99 = pct(health, 0.99), pct(baseline, 0.99)
    print(f"streams: {n} concurrent, {len(quitters)} hang up: completed {completed}, aborted {aborted}, "
          f"status {dict(statuses)}, in {load_s:.1f} s")
    print(f"  max waiting gauge seen: {max(waiting, default=0)}; gauges idle {idle_after:.2f} s after the last client")
    print(f"  /health under load: p50 {statistics.median(health) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
          f"max {max(health) * 1e3:.1f} ms over {len(health)} probes; idle p99 {base99 * 1e3:.1f} ms; "
          f"ratio x{p99 / base99:.1f} (goal: p99 <= 500 ms: {'met' if p99 <= 0.5 else 'NOT met'})")


async def bursts(url: str, rounds: int, size: int, limit: int) -> None:
    admitted_per_round = []
    statuses: Counter[str] = Counter()
    max_waiting = 0
    limits = httpx.Limits(max_connections=size + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c, \
            httpx.AsyncClient(base_url=url, timeout=30) as probe:
        for _ in range(rounds):
            await until_idle(probe)
            answered: list[int] = []
            everyone = asyncio.Event()

            async def one() -> None:
                body = {"messages": CHAT, "max_tokens": 64, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    answered.append(r.status_code)
                    if len(answered) == size:
                        everyone.set()
                    if r.status_code == 200:
                        await everyone.wait()

            await asyncio.gather(*(one() for _ in range(size)))
            max_waiting = max(max_waiting, (await gauges(probe))[1])
            admitted_per_round.append(answered.count(200))
            statuses.update(str(s) for s in answered)
        await until_idle(probe)
    worst = max(admitted_per_round)
    print(f"burst: {rounds} x {size} at once, limit {limit} (2 slots + 2 waiting): admitted per round "
          f"{admitted_per_round}, status {dict(statuses)}; max admitted {worst} "
          f"({'held' if worst <= limit else 'EXCEEDED'}), max waiting gauge {max_waiting}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=150)
    ap.add_argument("--hang-up", type=float, default=0.3)
    ap.add_argument("--bursts", type=int, default=10)
    args = ap.parse_args()
    with Server("--max-num-seqs", "16", "--max-waiting", "256") as srv:
        asyncio.run(streams(srv.url, args.streams, args.hang_up))
    with Server("--max-num-seqs", "2", "--max-waiting", "2") as srv:
        asyncio.run(bursts(srv.url, args.bursts, 30, 4))


if __name__ == "__main__":
    main()
