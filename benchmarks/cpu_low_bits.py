"""The int8 kernel's low-bit forms against 8 bits, by row count, for each ISA class this CPU can build: whether a
class should hold a GGUF's Q5_0 / Q6_K values in 5 / 6 bits (`Isa.low_bit_weights` in backends/cpu/native.py).

A Q4_K_M file's Q6_K (ffn_down of some layers, the output) and Q5_0 / Q8_0 (rows not a multiple of 256) load as
int8 with a scale per group. Held in as many bits as their values take, a token reads fewer bytes (Q6_K 6.6 bits a
weight with its own scales against 10, a Q6_K head 6.6 against per-channel 8) but each block is unpacked before its
products. On AVX-512 that wins at one row and loses a few percent at 16 (docs/performance.md, the thirteenth pass);
on AVX2, without vpdpbusd, it lost 27% from 5 rows on. AVX-VNNI (vpdpbusd on ymm) had not been measured. This times
`q8_linear` on random weights of Llama-3-8B-like shapes, both forms of the same values, every build this CPU runs
(its own, and beside it AVX-VNNI and AVX2 where it has more), calls interleaved, best of the rounds:

  - two Q6_K ffn_down (4096 x 14336, scales d * sc per 16): 6 bits with Q6_K's scales / 8 bits, float32 per 16;
  - a Q6_K LM head (32000 x 4096): 6 bits / per channel 8 bits (what the head is held in either way);
  - two Q5_0 linears (4096 x 4096, a scale per 32): 5 bits / 8 bits.

    python benchmarks/cpu_low_bits.py [--threads N] [--rounds 7]

Prints ms and the ratio low-bit / 8-bit per row count: below 1 the low-bit form is faster.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from cpu_kernel_rows import builds as kernel_rows_builds  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy.backends.cpu import native
from flagdeploy.ops.weights import Int8Weight

ROWS = (1, 2, 5, 16)


def q6k_like(n: int, k: int, g: torch.Generator) -> Int8Weight:
    """Values -32..31, scales per 16 as Q6_K's: d per 256 inputs times an int8 sub-scale, the largest -128."""
    sub = torch.randint(-127, 128, (n, k // 256, 16), generator=g).float()
    sub[..., 0] = -128
    d = torch.rand(n, k // 256, 1, generator=g) * 1e-4 + 1e-5
    return Int8Weight(torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8), (d * sub).view(n, -1), n, k,
                      group_size=16)


def q5_like(n: int, k: int, g: torch.Generator) -> Int8Weight:
    return Int8Weight(torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8),
                      torch.rand(n, k // 32, generator=g) * 1e-3 + 1e-4, n, k, group_size=32)


def builds(tmp: Path) -> dict[str, object]:
    """cpu_kernel_rows.py's builds (this CPU's own, AVX2 beside it), and an AVX-VNNI one beside an AVX-512 build on a
    CPU that has AVX-VNNI too."""
    out = kernel_rows_builds(tmp)
    if native.isa() in ("avx512", "amx") and "avx_vnni" in native.cpu_flags():
        out["AVX2+VNNI (built beside it)"] = native.build_beside("avxvnni", tmp / "avxvnni")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    per_channel = lambda w: Int8Weight(w.q, w.dequantize().abs().amax(-1) / 127, w.out_features, w.in_features)  # noqa: E731
    weights = {  # name: ([low-bit weights], [8-bit weights]), packed once: every build reads the same layout
        "Q6_K down x2": [q6k_like(4096, 14336, g) for _ in range(2)],
        "Q6_K head": [q6k_like(32000, 4096, g)],
        "Q5_0 4096^2 x2": [q5_like(4096, 4096, g) for _ in range(2)],
    }
    packed = {}
    for name, ws in weights.items():
        low = [native.pack_q8(w, native.q8_bits(w)) for w in ws]
        eight = [native.pack_q8(per_channel(w) if "head" in name else w, 8) for w in ws]
        packed[name] = (low, eight)
    xs = {(r, k): torch.randn(r, k, generator=g).bfloat16() for r in ROWS for k in (4096, 14336)}
    with tempfile.TemporaryDirectory() as tmp:
        classes = builds(Path(tmp))
        best = {}
        for rnd in range(args.rounds + 1):  # the first round warms up
            for c, ops in classes.items():
                for name, (low, eight) in packed.items():
                    for r in ROWS:
                        for form, ws in (("low", low), ("8", eight))[:: 1 if rnd % 2 else -1]:
                            t = time.perf_counter()
                            for w8, d in ws:
                                ops.q8_linear(xs[(r, weights[name][0].in_features)], w8, d)
                            ms = (time.perf_counter() - t) * 1e3
                            if rnd:
                                key = (c, name, r, form)
                                best[key] = min(best.get(key, float("inf")), ms)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}; best of {args.rounds} "
          f"rounds, ms: low-bit form / 8 bits (ratio)")
    for c in classes:
        print(f"\n{c}")
        print(f"{'rows':>5} " + " ".join(f"{name:>30}" for name in packed))
        for r in ROWS:
            cells = [(best[(c, n, r, 'low')], best[(c, n, r, '8')]) for n in packed]
            print(f"{r:5d} " + " ".join(f"{a:9.2f} / {b:7.2f} ({a / b:5.3f}x)" for a, b in cells))


if __name__ == "__main__":
    main()
