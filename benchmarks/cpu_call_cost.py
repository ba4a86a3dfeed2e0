"""What a kernel call costs besides its weight's bytes, by thread count: where a many-core CPU's decode step goes.

On a 16-core Xeon the default model's 120 4-bit linears stopped getting faster at ~20 us a call (issue 54's
sixteenth pass), far above what their bytes take from its L3. This splits a call's time into
  - the fixed cost of a call on one thread (the dispatcher from Python, the activations' quantisation, the output's
    allocation): a 32 x 32 weight, one tile pair, never split over threads;
  - a parallel loop's own cost at T threads: a weight of 2T tiles of one block each, one chunk a thread, minus the
    fixed cost above;
  - the 120 linears of a 1-row decode step, each layer's own weights (streamed as in a step), and the same 120 calls
    over one layer's four weights (held in the caches): the difference is the bytes' share.
and then, per shape of a layer's linears and per row count (--rows: a lone stream, a verify step, 16 streams), us a
call at each thread count and its speedup over one thread: how far a call of R rows splits over the cores. (On an
H100 host's 16-core Xeon at 16 rows: the small linears' calls 2.9-4.2x faster on 16 threads than on one, gate_up's
8.2x; docs/performance.md, issue 54's twenty-seventh pass.)
Random weights in the kernels' layout: no model file, so it runs on a host cut off from the network.

    python benchmarks/cpu_call_cost.py [--threads 1,2,4,8,12,16] [--reps 2000] [--rows 1,5,16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from cpu_vs_llama_server import cpu_name  # this script runs from benchmarks/

from flagdeploy.backends.cpu import native

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (out, in)
LAYERS = 30


def weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    nib = torch.randint(0, 256, (n // 16, k // 32, 4, 16, 4), generator=g, dtype=torch.uint8)
    dm = torch.stack([torch.rand(n // 16, k // 32, 16, generator=g) * 0.02 + 1e-3,
                      torch.randn(n // 16, k // 32, 16, generator=g) * 0.02], 2).half()
    return nib, dm


def per_call_us(fn, reps: int, calls: int = 1) -> float:
    """Median over 5 batches of `reps` repetitions, us per call."""
    for _ in range(max(1, reps // 10)):
        fn()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t) / (reps * calls) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, 2, 4, ... the cores)")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rows", default="1,5,16", help="comma-separated activation row counts of the per-shape table")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"the cpu backend's kernels are not built here: {native.unsupported() or 'no C++ compiler'}")
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted(
        {t for t in (1, 2, 4, 8, 12, 16, 24, 32) if t <= cores} | {cores})
    ops = torch.ops.flagdeploy_cpu
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(1, k, generator=g).bfloat16() for k in (32, 576, 1536)}
    tiny = weight(32, 32, g)
    layers = [[(k, *weight(n, k, g)) for n, k in SHAPES] for _ in range(LAYERS)]
    step_bytes = sum(nib.numel() + 2 * dm.numel() for layer in layers for _, nib, dm in layer)
    print(f"CPU: {cpu_name()} ({native.isa_class()}), {cores} cores, torch {torch.__version__}; us a call "
          f"(median of 5 x {args.reps}); the 120 linears' weights {step_bytes / 1e6:.1f} MB")
    print(f"{'threads':>7} {'fixed':>7} {'loop':>7} {'120 streamed':>13} {'120 cached':>11} {'GB/s':>6}")
    for t in threads:
        torch.set_num_threads(t)
        fixed = per_call_us(lambda: ops.q4_linear(x[32], *tiny), args.reps)
        spread = weight(32 * t, 32, g)
        loop = per_call_us(lambda: ops.q4_linear(x[32], *spread), args.reps) - fixed
        streamed = per_call_us(lambda: [ops.q4_linear(x[k], nib, dm) for layer in layers for k, nib, dm in layer],
                               max(1, args.reps // 100), 120)
        cached = per_call_us(lambda: [ops.q4_linear(x[k], nib, dm) for _ in range(LAYERS) for k, nib, dm in layers[0]],
                             max(1, args.reps // 100), 120)
        gbs = step_bytes / (streamed * 120 * 1e-6) / 1e9
        print(f"{t:7d} {fixed:7.2f} {loop:7.2f} {streamed:13.2f} {cached:11.2f} {gbs:6.1f}")
    rows = [int(r) for r in args.rows.split(",")]
    xs = {(r, k): torch.randn(r, k, generator=g).bfloat16() for r in rows for k in (576, 1536)}
    us = {}
    for t in threads:
        torch.set_num_threads(t)
        for r in rows:
            for (n, k), (_, nib, dm) in zip(SHAPES, layers[0]):
                us[(n, k, r, t)] = per_call_us(lambda: ops.q4_linear(xs[(r, k)], nib, dm), max(1, args.reps // 10))
    print(f"\nper shape (in -> out) and rows: us a call at each thread count; its speedup over one thread at {threads[-1]}")
    print(f"{'shape':>11} {'rows':>4} " + " ".join(f"{str(t) + ' thr':>7}" for t in threads) + f" {'speedup':>8}")
    for n, k in SHAPES:
        for r in rows:
            cells = " ".join(f"{us[(n, k, r, t)]:7.1f}" for t in threads)
            print(f"{f'{k}->{n}':>11} {r:4d} {cells} {us[(n, k, r, threads[0])] / us[(n, k, r, threads[-1])]:7.2f}x")


if __name__ == "__main__":
    main()
