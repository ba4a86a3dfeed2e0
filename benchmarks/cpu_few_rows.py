"""Decode steps of a few rows against one row on the CPU, in-process: the default model (SmolLM2-135M GGUF, int4
packed kernels, serve's engine defaults), each step shaped as a speculative verify step of one sequence
(its last token and k drafts at positions L..L+k, context lengths L+1..L+1+k, one block table, its caches holding
random keys and values), timed through
the runner's own `execute` as the engine calls it, and beside it the same step's 4-bit linears alone (the
model's own packed weights through the few-row kernel). Prints ms per step and the ratio to a one-row step
(issue 54: a 5-row step <= 1.5x one row). Rounds alternate over the row counts, so a host whose speed
drifts favours none; the figure is the median of the rounds.

    python benchmarks/cpu_few_rows.py [--context 256] [--rounds 15] [--threads N] [--eager] [--model SRC] [--q8-activations]

`--eager` also times the eager (Python) step on the same inputs: the path verify steps took before the C++
step served them. `--model` times another model (any source `serve --model` takes: a GGUF of the same shape with
random weights, on a host without the default model: `cpu_gguf_types.py --write-random`). FLAGDEPLOY_CPU_ISA=avx2
measures the AVX2 kernels on an AVX-512 CPU (the header says so).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_vs_llama_server import cpu_name  # this script runs from benchmarks/

from flagdeploy.backends.cpu import native
from flagdeploy.checkpoints.source import resolve
from flagdeploy.engine import EngineConfig
from flagdeploy.engine.model_runner import PagedStep
from flagdeploy.engine.replica import build_llm_engine

ROWS = (1, 2, 3, 5, 8, 16)


def verify_step(rows: int, context: int, block_size: int, vocab: int) -> PagedStep:
    """One sequence's last token and rows - 1 drafts, as the engine plans a verify step."""
    blocks = -(-(context + rows) // block_size)
    table = list(range(1, blocks + 1))  # block 0 is the padding block
    positions = list(range(context, context + rows))
    slots = [table[p // block_size] * block_size + p % block_size for p in positions]
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, vocab, (rows,), generator=g).tolist()
    return PagedStep(ids=ids, positions=positions, slots=slots, num_prefill=0, cu_q=[], cu_k=[], kv_slots=None,
                     tables=[table] * rows, ctx_lens=[p + 1 for p in positions], logits_rows=list(range(rows)),
                     verify=rows > 1)


def default_model(threads: int | None, model: str | None = None, q8_activations: bool = False):
    """(runner, model) of the engine serve builds on the CPU for `model` (a model source; None: the embedded default
    model), on `threads` torch threads (`q8_activations`: as serve --q8-activations builds it)."""
    if threads:
        torch.set_num_threads(threads)
    src = resolve(model)
    engine = build_llm_engine(src.path, src.format, EngineConfig(q8_activations=q8_activations), chip="cpu",
                              progress=False)
    return engine.runner, engine.runner.model


def packed_linears(model) -> list[dict]:
    """The prepared weights of the model's 4-bit linears (the LM head is int8)."""
    return [m.qweight.prepared for m in model.modules()
            if getattr(m, "qweight", None) is not None and m is not model.lm_head and "nib" in m.qweight.prepared]


def written(runner, blocks: list[int], seed: int = 0) -> None:
    """Random keys and values in `blocks` of every layer's caches, as a sequence's tokens leave them: a fresh pool is
    zeroed pages never written, which read from the one zero page at cache speed where a served step reads memory."""
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor(sorted(set(blocks)), dtype=torch.int64)
    for layer in runner.kv_caches:
        for cache in layer:
            cache[index] = torch.randn((len(index), *cache.shape[1:]), generator=g).to(cache.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256, help="tokens already in the sequence's cache")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--eager", action="store_true", help="also time the eager step (no C++ step)")
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--q8-activations", action="store_true", help="as serve --q8-activations (one int8 activation part)")
    args = ap.parse_args()
    runner, model = default_model(args.threads, args.model, args.q8_activations)
    packed = packed_linears(model)
    steps = {r: verify_step(r, args.context, runner.block_size, model.cfg.vocab_size) for r in ROWS}
    written(runner, steps[max(ROWS)].tables[0])
    xs = {r: {p["nib"].shape[1] * 32: torch.randn(r, p["nib"].shape[1] * 32).bfloat16() for p in packed} for r in ROWS}
    native_step = runner.native

    def step_ms(r: int, use_native: bool = True) -> float:
        runner.native = native_step if use_native else None
        try:
            t = time.perf_counter()
            runner.execute(steps[r])
            return (time.perf_counter() - t) * 1e3
        finally:
            runner.native = native_step

    def linears_ms(r: int) -> float:
        t = time.perf_counter()
        for p in packed:
            native.q4_linear(xs[r][p["nib"].shape[1] * 32], p["nib"], p["dm"], p.get("parts", 2))
        return (time.perf_counter() - t) * 1e3

    kinds = {"step": step_ms, "linears": linears_ms}
    if args.eager:
        kinds["eager step"] = lambda r: step_ms(r, use_native=False)
    for fn in kinds.values():  # warm-up: kernels built and loaded, caches touched
        for r in ROWS:
            fn(r)
    times = {(k, r): [] for k in kinds for r in ROWS}
    for _ in range(args.rounds):
        for r in ROWS:
            for k, fn in kinds.items():
                times[(k, r)].append(fn(r))
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}; {args.model or 'the default model'}, {len(packed)} 4-bit linears"
          f"{' (--q8-activations)' if args.q8_activations else ''}, C++ step: "
          f"{'yes' if native_step is not None else 'no'}; context {args.context}, median of {args.rounds} rounds")
    print(f"{'rows':>5} " + " ".join(f"{k + ' ms':>14} {'x 1 row':>8}" for k in kinds))
    for r in ROWS:
        cells = []
        for k in kinds:
            ms, one = statistics.median(times[(k, r)]), statistics.median(times[(k, 1)])
            cells.append(f"{ms:14.2f} {ms / one:7.2f}x")
        print(f"{r:5d} " + " ".join(cells))


if __name__ == "__main__":
    main()
