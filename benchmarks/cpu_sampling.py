"""Sampled decoding on the CPU: the cpu backend's sampling kernels against the torch reference, and sampled
against greedy decoding in the engine, in one run.

    python benchmarks/cpu_sampling.py [--rounds 5] [--streams 16] [--threads N] [--skip-engine]

1. The ops `sample_probs` + `draw` over a 49k vocabulary (SmolLM2's), 1 and 16 rows, for the settings chat
   clients send: the backend's kernel (csrc/sample.cpp: rows in parallel on the kernels' threads) against the
   reference in flagdeploy/ops/reference.py (torch; what accelerators and CPUs without the kernels run),
   ms per call and the ratio. Best of --rounds, the two alternating.
2. The default model in-process (serve's engine defaults): tok/s of 1 and --streams concurrent requests
   (128 tokens, a different chat prompt each), greedy against temperature 0.7 + top_p 0.9, rounds alternating;
   the ratio sampled / greedy is what sampling costs a client (1.0: nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_serving import PROMPTS, chat_ids  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy import ops
from flagdeploy.backends.cpu import native
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.sampler import row_settings
from flagdeploy.ops import reference

VOCAB = 49152
SETTINGS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "+ top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 40": SamplingParams(temperature=0.7, top_k=40),
    "top_p 0.95, top_k 50, min_p 0.05": SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.05),
}


def best_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def ops_table(rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB, generator=g) * 2.5
    logits[:, :50] += 8  # a few likely tokens over a long tail, as a chat model's rows look
    print(f"{'settings':34} {'rows':>4} {'kernel ms':>10} {'reference ms':>13} {'ratio':>7}")
    for name, params in SETTINGS.items():
        for rows in (1, 16):
            x, s = logits[:rows], row_settings([params] * rows, torch.device("cpu"))
            u = torch.rand(rows, generator=g, dtype=torch.float64)
            kernel = lambda: ops.draw(ops.sample_probs(x, *s), u)  # noqa: E731 (the cpu backend's)
            ref = lambda: reference.draw(reference.sample_probs(x, *s), u)  # noqa: E731
            k = r = float("inf")
            for _ in range(2):  # alternate, so that a drifting host favours neither
                k, r = min(k, best_ms(kernel, rounds)), min(r, best_ms(ref, rounds))
            print(f"{name:34} {rows:4d} {k:10.3f} {r:13.3f} {r / k:6.1f}x")


def engine_table(rounds: int, streams: int) -> None:
    from flagdeploy.checkpoints.source import resolve
    from flagdeploy.engine.replica import build_llm_engine

    src = resolve(None)
    engine = build_llm_engine(src.path, src.format, EngineConfig(), chip="cpu", progress=False)
    prompts = [chat_ids(engine.tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(streams)]
    modes = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
    rates: dict[tuple[str, int], list[float]] = {}
    for rnd in range(rounds + 1):
        for mode in (modes if rnd % 2 else reversed(modes)):
            for n in (1, streams):
                params = SamplingParams(max_tokens=128, ignore_eos=True, seed=rnd, **modes[mode])
                t = time.perf_counter()
                made = engine.generate(prompts[:n], params)
                if rnd:  # the first round warms up
                    rates.setdefault((mode, n), []).append(sum(map(len, made)) / (time.perf_counter() - t))
    engine.close()
    print(f"\n{'streams':>7} {'greedy tok/s':>13} {'sampled tok/s':>14} {'sampled / greedy':>17}")
    for n in (1, streams):
        greedy, sampled = (statistics.median(rates[(m, n)]) for m in modes)
        print(f"{n:7d} {greedy:13.1f} {sampled:14.1f} {sampled / greedy:16.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-engine", action="store_true", help="only the ops")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the cpu backend's kernels are not built on this machine: nothing to compare")
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; vocabulary {VOCAB}")
    ops_table(args.rounds)
    if not args.skip_engine:
        engine_table(args.rounds, args.streams)


if __name__ == "__main__":
    main()
