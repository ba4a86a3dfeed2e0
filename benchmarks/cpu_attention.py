"""Decode attention on the CPU: the cpu backend's forms against torch's fused SDPA, eager and compiled.

    python benchmarks/cpu_attention.py [--threads N]

Each form attends through 30 layers' paged caches in a row (SmolLM2-135M's 30 layers, 9 query heads over
3 key heads of 64, blocks of 16, bf16 caches); the compiled ones as one torch.compile'd function, so that
dynamo's per-call cost is spread as it is in the engine's compiled step. "sdpa" is
`ops.fused.paged_attention_decode` (gather, mask, `F.scaled_dot_product_attention`); "matmuls" and
"reductions" are the cpu backend's eager and compiled forms. Prints microseconds per layer (best of 3 runs
of 50 calls), the ratios, and which eager form the tune table's `sdpa_max_keys` picks.

Then the backend's own kernel (csrc/decode_attention.cpp, where it is built) on a speculative verify step's
rows of one sequence (context lengths L+1..L+k+1, one block table): one call, which reads the sequence's
keys and values once for all the rows, against one call per row (each row reading them again), in the
same run. The header names the CPU's ISA class (FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 build).
"""

from __future__ import annotations

import argparse
import time

import torch

from flagdeploy.backends.cpu import native
from flagdeploy.backends.cpu import ops as cpu_ops
from flagdeploy.ops import fused

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CASES = [(1, 40), (1, 100), (1, 300), (1, 2000), (2, 40), (2, 100), (4, 100), (16, 100), (16, 300)]  # (sequences, keys each)


def through_layers(attend, caches):
    def step(q, tables, lens):
        for k_cache, v_cache in caches:
            q = attend(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)
        return q

    return step


def per_layer_us(fn, *args, calls: int = 50) -> float:
    for _ in range(5):
        fn(*args)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    if (threads := ap.parse_args().threads) is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    blocks = max(b * -(-n // BLOCK) for b, n in CASES)
    caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
              for _ in range(LAYERS)]
    torch._dynamo.config.recompile_limit = 64  # one graph per case and form
    compiled = {name: torch.compile(through_layers(fn, caches), dynamic=False, fullgraph=True)
                for name, fn in (("sdpa", fused.paged_attention_decode), ("reductions", cpu_ops.paged_attention_decode))}
    limit = cpu_ops.TUNE["paged_attention_decode"]["sdpa_max_keys"]
    print(f"{'sequences':>9} {'keys':>5} | compiled us/layer: {'sdpa':>7} {'reductions':>10} {'ratio':>6} | "
          f"eager us/layer: {'sdpa':>7} {'matmuls':>8} {'ratio':>6}  picked")
    with torch.inference_mode():
        for b, n in CASES:
            width = -(-n // BLOCK)
            tables = torch.randperm(blocks)[: b * width].view(b, width).to(torch.int32)
            lens = torch.randint(n // 2, n + 1, (b,), dtype=torch.int32)
            lens[0] = n
            q = torch.randn(b, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            c = {name: per_layer_us(f, q, tables, lens) for name, f in compiled.items()}
            e = {"sdpa": per_layer_us(through_layers(fused.paged_attention_decode, caches), q, tables, lens)}
            e["matmuls"] = per_layer_us(through_layers(cpu_ops.decode_attention_matmuls, caches), q, tables, lens)
            picked = "sdpa" if tables.numel() * BLOCK <= limit else "matmuls"
            print(f"{b:9} {n:5} | {'':18} {c['sdpa']:7.1f} {c['reductions']:10.1f} {c['sdpa'] / c['reductions']:5.1f}x | "
                  f"{'':15} {e['sdpa']:7.1f} {e['matmuls']:8.1f} {e['sdpa'] / e['matmuls']:5.1f}x  {picked}")
    verify_rows(caches)


def verify_rows(caches) -> None:
    """The native kernel on verify-shaped rows: one call against one call per row."""
    if not native.available():
        print("(the cpu backend's own kernels are not built here: no verify-row table)")
        return
    print(f"\nnative kernel, ISA class {native.isa_class()}: a verify step's rows of one sequence, us/layer")
    print(f"{'rows':>4} {'keys':>5} | {'one call':>8} {'a call a row':>12} {'ratio':>6}")
    blocks = caches[0][0].shape[0]
    with torch.inference_mode():
        for rows, n in ((2, 256), (5, 256), (16, 256), (5, 1000)):
            width = -(-n // BLOCK)
            if width > blocks:
                continue
            tables = torch.randperm(blocks)[:width].expand(rows, width).contiguous()
            lens = torch.arange(n - rows + 1, n + 1)
            q = torch.randn(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            one = through_layers(native.paged_decode_attention, caches)

            def each(q, tables, lens):
                return [one(q[r:r + 1], tables[r:r + 1], lens[r:r + 1]) for r in range(rows)]

            together, apart = per_layer_us(one, q, tables, lens, calls=20), per_layer_us(each, q, tables, lens, calls=20)
            print(f"{rows:4} {n:5} | {together:8.1f} {apart:12.1f} {apart / together:5.2f}x")


if __name__ == "__main__":
    main()
