"""A prompt's first token on the CPU, its tokens as decode rows in the C++ step (tune.yaml `prompt_max_keys`) against
the eager prefill they took before, in one process: the default model (SmolLM2-135M GGUF, int4 packed kernels),
prompts of several lengths, each cold (a first token never seen, so nothing is cached) and then again (the prefix
cache holds all but its last partial block: a chat's next turn, an agent's next call). The two modes alternate per
prompt, so a host whose speed drifts favours neither; the figure is the median over the rounds, and the ratio is
rows / prefill (below 1: rows faster).

    python benchmarks/cpu_prompt_rows.py [--sizes 8 45 256 1024] [--rounds 3] [--threads N] [--model SRC]

Both modes run whatever this CPU's table says (the script sets the step's limit itself), so on a table whose linears
keep a dense copy (the AVX-512 tables' bf16) the prefill is the copies' matmuls and the rows the packed kernels: the
crossover it prints is the `prompt_max_keys` that table should hold. FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2
kernels on an AVX-512 CPU (the header says so). `--model`: any source `serve --model` takes (a random GGUF of the
default model's shape on a host without it: `cpu_gguf_types.py --write-random`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from cpu_speculative import PARAGRAPH  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy.backends.cpu import native
from flagdeploy.checkpoints.source import resolve
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 45, 100, 256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct GGUF)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve(args.model)
    cfg = EngineConfig(max_model_len=max(2048, max(args.sizes) + 64), max_num_seqs=4, max_num_batched_tokens=512,
                       kv_cache_memory=256 << 20)
    e = build_llm_engine(src.path, src.format, cfg, chip="cpu", progress=False)
    step = e.runner.native
    if step is None:
        raise SystemExit("no C++ decode step for this model here: prompts never run as rows")
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
          f"{torch.__version__}; {args.model or 'the default model'}; median of {args.rounds} rounds; this table's prompt_max_keys "
          f"{table_value}")
    print(f"{'tokens':>6} {'cold rows ms':>13} {'prefill ms':>11} {'ratio':>6} {'cached rows ms':>15} {'prefill ms':>11} "
          f"{'ratio':>6}")
    for n in args.sizes:
        med = [statistics.median(t[i] for t in times[(n, mode)]) for i in (0, 1) for mode in ("rows", "prefill")]
        print(f"{n:6d} {med[0]:13.1f} {med[1]:11.1f} {med[0] / med[1]:5.2f}x {med[2]:15.1f} {med[3]:11.1f} "
              f"{med[2] / med[3]:5.2f}x")


if __name__ == "__main__":
    main()
