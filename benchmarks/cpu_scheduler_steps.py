"""Several decode steps in one call of the CPU's C++ step (`--num-scheduler-steps`) against one step a call, in
process: the same engine configuration (serve's defaults but the steps), one engine per step count in one process,
rounds alternating over them (a host whose speed drifts favours none); greedy chat requests of `--max-tokens`
tokens, one stream and `--concurrency` streams. Prints output tok/s per step count and the ratio to the first of
`--steps` (one step a call by default), and whether every count gave the same tokens (it must: each call's tokens are those of one step at a time).

    python benchmarks/cpu_scheduler_steps.py [--steps 1 4 8] [--rounds 5] [--max-tokens 128] [--concurrency 16]
        [--threads N] [--model SRC]

Served figures (the event loop's and the client's wake-ups are paid once a call too) come from starting `flagdeploy
serve --num-scheduler-steps N` side by side; see docs/performance.md, issue 54's twenty-first pass. `--model` takes
any source `serve --model` takes (a GGUF of the default model's shape with random weights on a host without it:
`cpu_gguf_types.py --write-random`). FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 kernels on an AVX-512 CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_vs_llama_server import cpu_name  # this script runs from benchmarks/

from flagdeploy.backends.cpu import native
from flagdeploy.checkpoints.source import resolve
from flagdeploy.cpu_threads import sleep_idle_openmp, threads_for_server
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine

QUESTIONS = ["Write a haiku about the sea.", "What is the capital of France?", "Explain photosynthesis briefly.",
             "List three prime numbers."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: serve's)")
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct GGUF)")
    args = ap.parse_args()
    sleep_idle_openmp()  # as serve does
    threads = args.threads or threads_for_server("cpu")
    if threads:
        torch.set_num_threads(threads)
    src = resolve(args.model)
    base = args.steps[0]
    engines = {k: build_llm_engine(src.path, src.format, EngineConfig(num_scheduler_steps=k), chip="cpu", progress=False)
               for k in args.steps}
    if engines[base].runner.native is None or not hasattr(engines[base].runner.native, "run_steps"):
        raise SystemExit("no C++ decode step for this model here (see the engine's log): nothing to compare")
    tok = engines[base].tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    loads = {"1 stream": [ids[0]], f"{args.concurrency} streams": [ids[i % len(ids)] for i in range(args.concurrency)]}
    rates: dict[tuple[str, int], list[float]] = {(load, k): [] for load in loads for k in args.steps}
    same = True
    for load, batch in loads.items():
        for rnd in range(args.rounds + 1):  # round 0 warms up
            outs = {}
            for k in args.steps if rnd % 2 else reversed(args.steps):
                t = time.perf_counter()
                outs[k] = engines[k].generate(batch, params)
                rate = sum(map(len, outs[k])) / (time.perf_counter() - t)
                if rnd:
                    rates[(load, k)].append(rate)
            # within a round: every engine has served the same requests before (a prefix-cache hit may change a
            # prompt's rounding on a table whose prompts take the dense prefill, and so a random model's answer)
            same &= all(out == outs[base] for out in outs.values())
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; {args.model or 'the default model'}; {args.max_tokens} greedy tokens a request, "
          f"median of {args.rounds} rounds")
    print(f"{'load':>12} " + " ".join(f"{f'{k} step(s) tok/s':>18} {f'x {base}':>6}" for k in args.steps))
    for load in loads:
        one = statistics.median(rates[(load, base)])
        cells = [f"{statistics.median(rates[(load, k)]):18.1f} {statistics.median(rates[(load, k)]) / one:5.2f}x"
                 for k in args.steps]
        print(f"{load:>12} " + " ".join(cells))
    print(f"same tokens at every step count: {same}")


if __name__ == "__main__":
    main()
