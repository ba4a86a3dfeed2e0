"""What prefill-decode disaggregation buys on a mixed load: short chats streaming while long prompts arrive.

    python benchmarks/pd_mixed_load.py [--chats 4] [--long-every 3] [--long-tokens 1200] [--seconds 60]

One run, the default model (SmolLM2-135M GGUF), the machine's cores split in two halves A and B:
- aggregated: one `flagdeploy serve` on all the cores (A+B), chunked prefill (--max-num-batched-tokens);
- PD 1P+1D: a prefill instance pinned to A and a decode instance pinned to B (`--kv-transfer-config`),
  vllm-router --vllm-pd-disaggregation in front (on the same cores: it is a thin Rust proxy).
The load is the same against both: `--chats` clients each streaming short chats back to back (~30-token
prompts, 48 tokens out), and every `--long-every` seconds a long prompt (`--long-tokens` tokens, 8 out)
arriving. Printed per setup: the short chats' TTFT p50/p99 and inter-token latency p50/p99 (the gaps
between streamed chunks), their tokens/s, the long prompts' TTFT, and PD's ratios against aggregated.

PD takes the long prompts' prefill off the decode instance, so the short streams' inter-token latency
should no longer spike when a long prompt arrives; it also halves the cores each phase gets and adds a
transfer, so TTFT can get worse. Whatever comes out is printed as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx

from flagdeploy.net import free_port

SHORT = ["Tell me a fact about {}.", "Write one sentence about {}.", "What colour is {}?", "Describe {} briefly."]
TOPICS = ["the sea", "a lighthouse", "Paris", "bread", "a cat", "the moon", "rain", "a violin"]
FLAGS = ["--chip", "cpu", "--max-model-len", "4096", "--kv-cache-memory", "1GiB", "--max-num-batched-tokens", "256",
         "--max-num-seqs", "16", "--served-model-name", "m"]


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class Proc:
    def __init__(self, argv: list[str], cpus: list[int], url: str, ready: str = "/ready"):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(len(cpus))}
        self.url, self.ready = url, ready
        self.proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, cpus)), *argv], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self, timeout: float = 600) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited while starting")
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.url} did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve(cpus: list[int], *extra: str) -> Proc:
    port = free_port()
    return Proc([sys.executable, "-m", "flagdeploy", "serve", "--port", str(port), *FLAGS, *extra], cpus,
                f"http://127.0.0.1:{port}")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def chat_stream(client: httpx.AsyncClient, url: str, messages, max_tokens: int, out: dict) -> None:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, first = None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["tokens"] += chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if not (choice.get("delta") or {}).get("content") and not choice.get("finish_reason"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                out["ttft"].append(now - start)
            else:
                out["itl"].append(now - last)
            last = now


async def load(url: str, chats: int, long_every: float, long_tokens: int, seconds: float) -> dict:
    rng = random.Random(0)
    short = {"ttft": [], "itl": [], "tokens": 0}
    long = {"ttft": [], "itl": [], "tokens": 0}
    stop = time.perf_counter() + seconds
    words = " ".join(rng.choice(TOPICS).split()[-1] for _ in range(long_tokens))  # ~1 token per word

    async with httpx.AsyncClient(timeout=600) as client:
        async def chatter(i: int) -> None:
            n = 0
            while time.perf_counter() < stop:
                q = SHORT[(i + n) % len(SHORT)].format(TOPICS[(3 * i + n) % len(TOPICS)])
                await chat_stream(client, url, [{"role": "user", "content": q}], 48, short)
                n += 1

        async def longs() -> None:
            k, tasks = 0, []
            while time.perf_counter() < stop:
                msg = [{"role": "user", "content": f"Summarise this ({k}): {words}"}]
                tasks.append(asyncio.create_task(chat_stream(client, url, msg, 8, long)))
                k += 1
                await asyncio.sleep(long_every)
            await asyncio.gather(*tasks)

        started = time.perf_counter()
        await asyncio.gather(*(chatter(i) for i in range(chats)), longs())
        elapsed = time.perf_counter() - started
    return {"short": short, "long": long, "seconds": elapsed}


def row(name: str, r: dict) -> dict:
    s, lg = r["short"], r["long"]
    out = {"ttft_p50": pct(s["ttft"], 0.5), "ttft_p99": pct(s["ttft"], 0.99), "itl_p50": pct(s["itl"], 0.5),
           "itl_p99": pct(s["itl"], 0.99), "tok_s": s["tokens"] / r["seconds"], "long_ttft_p50": pct(lg["ttft"], 0.5),
           "chats": len(s["ttft"]), "longs": len(lg["ttft"])}
    print(f"{name:<12} short chats: {out['chats']:>4} done, TTFT p50 {out['ttft_p50'] * 1e3:7.0f} ms p99 "
          f"{out['ttft_p99'] * 1e3:7.0f} ms, ITL p50 {out['itl_p50'] * 1e3:6.1f} ms p99 {out['itl_p99'] * 1e3:7.1f} ms, "
          f"{out['tok_s']:6.1f} tok/s; long prompts: {out['longs']} done, TTFT p50 {out['long_ttft_p50']:.2f} s",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--long-every", type=float, default=3.0)
    ap.add_argument("--long-tokens", type=int, default=1200)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    cpus = cores()
    if len(cpus) < 2:
        raise SystemExit("needs at least two cores (one for each PD instance)")
    a, b = cpus[: len(cpus) // 2], cpus[len(cpus) // 2:]
    from flagdeploy.checkpoints.source import resolve

    resolve(None)  # the default model in the cache before anything is timed
    print(f"{len(cpus)} cores; aggregated on {cpus}, PD prefill on {a}, decode on {b}; {args.chats} chat streams, a "
          f"{args.long_tokens}-word prompt every {args.long_every} s, {args.seconds:.0f} s each", flush=True)
    rows = {}
    agg = serve(cpus).wait()
    try:
        rows["aggregated"] = row("aggregated", asyncio.run(load(agg.url, args.chats, args.long_every,
                                                                args.long_tokens, args.seconds)))
    finally:
        agg.stop()
    prefill = serve(a, "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}))
    decode = serve(b, "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}))
    router = None
    try:
        prefill.wait(), decode.wait()
        port = free_port()
        router = Proc([sys.executable, "-c", "import sys; from vllm_router.launch_router import main; sys.exit(main())",
                       "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--prefill", prefill.url,
                       "--decode", decode.url, "--prometheus-port", str(free_port())], cpus,
                      f"http://127.0.0.1:{port}", ready="/health").wait(60)
        rows["PD 1P+1D"] = row("PD 1P+1D", asyncio.run(load(router.url, args.chats, args.long_every,
                                                            args.long_tokens, args.seconds)))
    finally:
        for p in (router, prefill, decode):
            if p is not None:
                p.stop()
    agg_row, pd = rows["aggregated"], rows["PD 1P+1D"]
    print("PD / aggregated: " + ", ".join(f"{k} {pd[k] / agg_row[k]:.2f}x" for k in
                                          ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tok_s", "long_ttft_p50")
                                          if agg_row[k] and agg_row[k] == agg_row[k]))
    print("(latency ratios below 1 favour PD; tok/s above 1 favours PD)")


if __name__ == "__main__":
    main()
