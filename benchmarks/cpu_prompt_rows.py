"""A prompt's first token on the CPU, its tokens as decode rows in the C++ step (tune.yaml `prompt_max_keys`) against
the eager prefill they took before, in one process: the default model (SmolLM2-135M GGUF, int4 packed kernels),
prompts of several lengths, each cold (a first token never seen, so nothing is cached) and then again (the prefix
cache holds all but its last partial block: a chat's next turn, an agent's next call). The two modes alternate per
prompt, so a host whose speed drifts favours neither; the figure is the median over the rounds, and the ratio is
rows / prefill (below 1: rows faster).

    python benchmarks/cpu_prompt_rows.py [--sizes 8 45 256 1024] [--rounds 3]

Rows run only where no linear keeps a dense copy beside its packed kernel (the AVX2 table): elsewhere the script
says so and stops. FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 kernels on an AVX-512 CPU (the header says so).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from cpu_speculative import PARAGRAPH, engine  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy.backends.cpu import native
from flagdeploy.engine import SamplingParams
from flagdeploy.engine.speculative import SpeculativeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 45, 100, 256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    e = engine(SpeculativeConfig())
    step = e.runner.native
    if step is None or step.prompt_max_keys == 0:
        raise SystemExit("prompts never run as rows here: no C++ step, or a linear keeps a dense copy (tune.yaml)")
    table_value = step.prompt_max_keys
    text = e.tokenizer.encode(" ".join([PARAGRAPH] * (max(args.sizes) // 60 + 2)))
    first = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    times: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for n in args.sizes:
            for mode, keys in (("rows", 1 << 30), ("prefill", 0)):
                step.prompt_max_keys = keys
                ids = [rng.randrange(1000, 40000)] + text[: n - 1]  # a fresh first token: nothing of it cached
                t = time.perf_counter()
                e.generate([ids], first)
                cold = time.perf_counter() - t
                t = time.perf_counter()
                e.generate([ids], first)
                times.setdefault((n, mode), []).append((cold * 1e3, (time.perf_counter() - t) * 1e3))
    step.prompt_max_keys = table_value
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), torch "
          f"{torch.__version__}; the default model; median of {args.rounds} rounds; this table's prompt_max_keys "
          f"{table_value}")
    print(f"{'tokens':>6} {'cold rows ms':>13} {'prefill ms':>11} {'ratio':>6} {'cached rows ms':>15} {'prefill ms':>11} "
          f"{'ratio':>6}")
    for n in args.sizes:
        med = [statistics.median(t[i] for t in times[(n, mode)]) for i in (0, 1) for mode in ("rows", "prefill")]
        print(f"{n:6d} {med[0]:13.1f} {med[1]:11.1f} {med[0] / med[1]:5.2f}x {med[2]:15.1f} {med[3]:11.1f} "
              f"{med[2] / med[3]:5.2f}x")


if __name__ == "__main__":
    main()
