"""The dense copy of a weight-only linear against the cpu backend's own packed kernels, by row count: whether
tune.yaml's `dense_copy` holds on this CPU (the copy in the table's dtype: bf16 where the CPU multiplies bf16,
else float32), from a decode step's few rows to a long prompt's.

    python benchmarks/cpu_dense_copy.py [--threads N] [--rounds 5] [--rows 1 16 128 512 2048]

Random weights of SmolLM2-135M's shapes, so it runs where no model file is at hand (a GPU host's CPU, cut off from the
network): one layer's four 4-bit linears (qkv, o, gate_up, down) and the int8 LM head (49152 x 576). Times are the
best of the rounds, the two forms alternating. FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 kernels, and the table an
AVX2 CPU gets, on an AVX-512 one (the header says which).
"""

from __future__ import annotations

import argparse

from flagdeploy.cpu_threads import sleep_idle_openmp

# Before torch loads, as serve does on 8 cores or more: OpenMP's threads left spinning after the copy's matmul slowed
# the packed kernel measured next up to 14x on a 16-core Xeon (the int8 head at one row 1.87 against 0.13 ms).
sleep_idle_openmp()
import torch  # noqa: E402
from cpu_vs_llama_server import cpu_name  # noqa: E402 (this script runs from benchmarks/)

from flagdeploy.backends.cpu import native, ops, tune  # noqa: E402
from flagdeploy.ops.check import fastest  # noqa: E402
from flagdeploy.ops.weights import Int8Weight  # noqa: E402

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (out, in)
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 512, 1024, 2048])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the cpu backend's kernels are not built here (see the log): nothing to compare")
    dtype = ops.TUNE["weight_only_dense"]["dtype"]
    g = torch.Generator().manual_seed(0)
    with tune._dense_copies(dtype):
        layer = [ops.prepare_w4a16(tune._int4(torch.randn(n, k, generator=g) * 0.02)) for n, k in LAYER]
        head = ops.prepare_w8a16(Int8Weight.quantize(torch.randn(*HEAD, generator=g) * 0.02))
    table = {op: ops.TUNE[op]["dense_copy"] for op in ("linear_w4a16", "linear_w8a16")}
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), torch "
          f"{torch.__version__}; the dense copy in {dtype}; this CPU's table keeps it: {table}")
    print(f"{'rows':>6} {'4-bit layer packed ms':>22} {'dense ms':>9} {'dense/packed':>13} "
          f"{'int8 head packed ms':>20} {'dense ms':>9} {'dense/packed':>13}")
    for m in args.rows:
        xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in LAYER]
        xh = torch.randn(m, HEAD[1], generator=g).to(torch.bfloat16)
        forms = {"layer packed": lambda: [ops.packed_w4a16(x, w) for x, w in zip(xs, layer)],
                 "layer dense": lambda: [ops._dense_mm(x, w.prepared["dense"]) for x, w in zip(xs, layer)],
                 "head packed": lambda: ops.packed_w8a16(xh, head),
                 "head dense": lambda: ops._dense_mm(xh, head.prepared["dense"])}
        took = {name: float("inf") for name in forms}
        for r in range(args.rounds):  # the forms alternate, each round in another order
            for name in (list(forms) if r % 2 == 0 else list(reversed(forms))):
                took[name] = min(took[name], fastest(forms[name], repeats=1) * 1000)
        print(f"{m:6d} {took['layer packed']:22.2f} {took['layer dense']:9.2f} "
              f"{took['layer dense'] / took['layer packed']:12.2f}x {took['head packed']:20.2f} "
              f"{took['head dense']:9.2f} {took['head dense'] / took['head packed']:12.2f}x")
    print("(dense/packed below 1: the copy is faster at that row count)")


if __name__ == "__main__":
    main()
