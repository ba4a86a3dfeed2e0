"""Which linear kernel wins at which row count on this CPU: the data behind backends/cpu/tune.yaml.

    python benchmarks/cpu_linear.py [--rows 1,2,4,8,16,64]

Times one decode step's worth of SmolLM2-135M weight shapes (30 layers of qkv, o, gate_up, down, plus
the LM head) for: float32 (the baseline), bf16 dense, the dense copy past `packed_max_m` rows (tune.yaml's
dtype for this CPU: bf16 laid out once for oneDNN, or float32), int4 packed (W4A16: the backend's own
int4 x int8 kernel where it builds, with torch's int4 kernel beside it as "int4 torch") and int8 packed
(W8A16: likewise, "int8 torch" beside it); prints milliseconds per step and the ratio to float32.
"""

from __future__ import annotations

import argparse
import time

import torch

from flagdeploy.backends.cpu import ops as cpu
from flagdeploy.ops.weights import Int4Weight, Int8Weight

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def step_time(fns, shapes, rows: int, dtype, repeat: int = 5) -> float:
    xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
    for f, (_, k) in zip(fns, shapes):
        f(xs[k])
    t = time.perf_counter()
    for _ in range(repeat):
        for f, (_, k) in zip(fns, shapes):
            f(xs[k])
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    args = ap.parse_args()
    shapes = LAYER * 30 + [HEAD]
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]
    kernels = {
        "float32": (torch.float32, [lambda x, w=w: torch.nn.functional.linear(x, w) for w in dense]),
        "bf16": (torch.bfloat16, [lambda x, w=w.bfloat16(): torch.nn.functional.linear(x, w) for w in dense]),
        "dense copy": (torch.bfloat16, [lambda x, w=cpu._dense_copy(Int8Weight.quantize(w)): cpu._dense_mm(x, w)
                                         for w in dense]),
    }
    w4 = [cpu.prepare_w4a16(Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.01,
                                       torch.zeros(n, k // 32), 32, n, k)) for n, k in shapes]
    w8 = [cpu.prepare_w8a16(Int8Weight.quantize(w)) for w in dense]
    kernels["int4 packed"] = (torch.bfloat16, [lambda x, w=w: cpu.packed_w4a16(x, w) for w in w4])
    if "nib" in w4[0].prepared:  # the backend's own kernel is in use: torch's own int4 kernel beside it
        torch4 = [(torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
                   torch.rand(k // 32, n, 2).to(torch.bfloat16)) for n, k in shapes]
        kernels["int4 torch"] = (torch.bfloat16, [lambda x, p=p: torch._weight_int4pack_mm_for_cpu(x, p[0], 32, p[1])
                                                  for p in torch4])
    kernels["int8 packed"] = (torch.bfloat16, [lambda x, w=w: cpu.packed_w8a16(x, w) for w in w8])
    if "w8" in w8[0].prepared:  # the backend's own kernel is in use: torch's own int8 kernel beside it
        torch8 = [(Int8Weight.quantize(w).q, torch.rand(w.shape[0]).to(torch.bfloat16)) for w in dense]
        kernels["int8 torch"] = (torch.bfloat16, [lambda x, p=p: torch._weight_int8pack_mm(x, *p) for p in torch8])
    print(f"{'rows':>5} " + " ".join(f"{name:>18}" for name in kernels))
    for rows in map(int, args.rows.split(",")):
        times = {name: step_time(fns, shapes, rows, dt) for name, (dt, fns) in kernels.items()}
        base = times["float32"]
        print(f"{rows:5d} " + " ".join(f"{t:8.2f} ms x{base / t:5.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
