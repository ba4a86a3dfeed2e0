"""The C++ decode step with its packed weights in one huge-page arena (backends/cpu/weight_arena.py) against the
same step with each weight its own allocation (FLAGDEPLOY_WEIGHT_ARENA=0, what came before), in one process.

    python benchmarks/cpu_weight_arena.py [--rows 1,5,16] [--rounds 20] [--context 256]

Two engines of the default model (SmolLM2-135M GGUF, serve's defaults) are built, one each way; their steps
(shaped as cpu_few_rows.py's: one sequence's last token and drafts) alternate round by round, so a host whose
speed drifts favours neither. Prints ms per step, the ratio separate / arena (above 1: the arena is faster), and
how many rounds the arena won. FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 kernels (the header says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from cpu_few_rows import verify_step  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy.backends.cpu import native
from flagdeploy.checkpoints.source import resolve
from flagdeploy.engine import EngineConfig
from flagdeploy.engine.replica import build_llm_engine

WAYS = {"0": "separate", "1": "arena"}


def huge_pages_kb() -> str:
    """The process's anonymous memory on transparent huge pages (0 where the kernel granted none)."""
    smaps = Path("/proc/self/smaps_rollup")
    if not smaps.exists():
        return "n/a"
    line = next((x for x in smaps.read_text().splitlines() if x.startswith("AnonHugePages:")), "")
    return line.split(":", 1)[1].strip() if line else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,5,16", help="comma-separated rows per step")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the sequence's cache")
    args = ap.parse_args()
    src = resolve(None)
    engines = {}
    for way in WAYS:
        os.environ["FLAGDEPLOY_WEIGHT_ARENA"] = way
        engines[way] = build_llm_engine(src.path, src.format, EngineConfig(), chip="cpu", progress=False)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), torch "
          f"{torch.__version__}; transparent_hugepage {thp.read_text().strip() if thp.exists() else 'n/a'}, "
          f"this process's huge pages {huge_pages_kb()}; context {args.context}, median of {args.rounds} rounds")
    print(f"{'rows':>5} {'separate ms':>12} {'arena ms':>9} {'separate / arena':>17} {'arena won':>10}")
    for rows in (int(r) for r in args.rows.split(",")):
        calls = {}
        for way, engine in engines.items():
            runner = engine.runner
            if runner.native is None:
                raise SystemExit("no C++ decode step here (the cpu backend's kernels are not built): nothing to compare")
            s = verify_step(rows, args.context, runner.block_size, runner.model.cfg.vocab_size)
            width = max(len(t) for t in s.tables)
            step_rows = torch.tensor([s.ids, s.positions, s.slots, s.ctx_lens], dtype=torch.int64)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in s.tables], dtype=torch.int64)
            calls[way] = (runner.native._step, step_rows, tables)
        times = {way: [] for way in WAYS}
        reps = max(4, 240 // rows)
        for r in range(args.rounds):
            for way in (WAYS if r % 2 == 0 else reversed(WAYS)):
                step, step_rows, tables = calls[way]
                for _ in range(reps // 4):  # its caches warm, the other's weights out of them
                    step.step(step_rows, tables, True)
                t = time.perf_counter()
                for _ in range(reps):
                    step.step(step_rows, tables, True)
                times[way].append((time.perf_counter() - t) / reps * 1e3)
        a, b = (statistics.median(times[way]) for way in WAYS)
        won = sum(x > y for x, y in zip(*times.values()))
        print(f"{rows:5d} {a:12.3f} {b:9.3f} {a / b:16.3f}x {won:>6d}/{args.rounds}")


if __name__ == "__main__":
    main()
