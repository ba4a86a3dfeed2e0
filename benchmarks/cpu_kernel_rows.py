"""The cpu backend's few-row kernels alone, by row count, against one row, for each ISA class this CPU can
build: the default model's 120 4-bit linears (SmolLM2-135M's shapes, 30 layers' own weights, so that they
stream from memory as in a decode step), its int8 LM head (49152 x 576), and a speculative verify step's
attention (one sequence, 256 keys, 9 query heads over 3). Random weights and caches in the kernels' own
layouts: no model file, so it runs where the default model is not at hand (a GPU host's CPU, cut off from
the network). The step of the whole model is `cpu_few_rows.py`; this is what its kernels do on another CPU.

    python benchmarks/cpu_kernel_rows.py [--threads 1] [--rounds 7]

Beside the CPU's own class, a CPU with AVX-512 also builds and measures the AVX2 kernels (what
FLAGDEPLOY_CPU_ISA=avx2 builds), under another op namespace in the same process. Times are the best of the
rounds, the classes alternating, so that a host whose speed drifts favours none.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from cpu_vs_llama_server import cpu_name  # this script runs from benchmarks/

from flagdeploy.backends.cpu import native

ROWS = (1, 2, 3, 4, 5, 8, 12, 16)
LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (out, in)


def builds(tmp: Path) -> dict[str, object]:
    """Op namespaces by ISA class: the CPU's own build, an AVX2 one beside an AVX-512 build, and beside an AMX
    build the AVX-512 one (the same kernels without the tile multiplies)."""
    if not native.available():
        raise SystemExit(f"the cpu backend's kernels are not built here: {native.unsupported() or 'no C++ compiler'}")
    out = {native.isa_class(): torch.ops.flagdeploy_cpu}
    if native.isa() == "amx":  # its tiles at every row count (tune.yaml's amx_min_rows picks where they win)
        torch.ops.flagdeploy_cpu.q4_amx_min_rows(1)
        out = {"AMX (its tiles at every row count)": torch.ops.flagdeploy_cpu,
               "AVX-512 (built beside it: no AMX)": native.build_beside("avx512", tmp / "avx512")}
    if native.isa() != "avx2":
        out["AVX2 (built beside it)"] = native.build_beside("avx2", tmp / "avx2")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    linears = []
    for n, k in SHAPES * LAYERS:
        nib = torch.randint(0, 256, (n // 16, k // 32, 4, 16, 4), generator=g, dtype=torch.uint8)
        dm = torch.stack([torch.rand(n // 16, k // 32, 16, generator=g) * 0.02 + 1e-3,
                          torch.randn(n // 16, k // 32, 16, generator=g) * 0.02], 2).half()
        linears.append((k, nib, dm))
    w8 = torch.randint(-127, 128, (49152 // 8, 576 // 32, 16, 8, 2), generator=g, dtype=torch.int8)
    d8 = torch.rand(49152, generator=g) * 0.01
    kc, vc = (torch.randn(400, 16, 3, 64, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(400, generator=g)[:17]

    def inputs(rows: int):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
        q = torch.randn(rows, 9, 64, generator=g).bfloat16()
        lens = torch.arange(256 - rows + 1, 257)
        return xs, q, table.expand(rows, -1).contiguous(), lens

    data = {r: inputs(r) for r in ROWS}
    kernels = {
        "120 4-bit linears": lambda ops, r: [ops.q4_linear(data[r][0][k], nib, dm) for k, nib, dm in linears],
        "int8 LM head": lambda ops, r: ops.q8_linear(data[r][0][576], w8, d8),
        "attention x 30": lambda ops, r: [ops.paged_decode_attention(data[r][1], kc, vc, data[r][2], data[r][3], 0.125)
                                          for _ in range(LAYERS)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        classes = builds(Path(tmp))
        best = {(c, name, r): float("inf") for c in classes for name in kernels for r in ROWS}
        for name, fn in kernels.items():
            for ops in classes.values():  # warm-up
                for r in ROWS:
                    fn(ops, r)
            for _ in range(args.rounds):
                for c, ops in classes.items():
                    for r in ROWS:
                        t = time.perf_counter()
                        fn(ops, r)
                        best[(c, name, r)] = min(best[(c, name, r)], (time.perf_counter() - t) * 1e3)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"best of {args.rounds} rounds, ms (x one row)")
    for c in classes:
        print(f"\n{c}")
        print(f"{'rows':>5} " + " ".join(f"{name:>24}" for name in kernels) + f" {'sum':>16}")
        for r in ROWS:
            cells = [(best[(c, n, r)], best[(c, n, r)] / best[(c, n, 1)]) for n in kernels]
            total = sum(ms for ms, _ in cells)
            one = sum(best[(c, n, 1)] for n in kernels)
            print(f"{r:5d} " + " ".join(f"{ms:15.2f} ({x:5.2f}x)" for ms, x in cells) + f" {total:8.2f} ({total / one:4.2f}x)")


if __name__ == "__main__":
    main()
