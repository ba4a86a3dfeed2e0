"""How close decode-sized matmuls come to the GPU's memory bandwidth, per row count.

    python benchmarks/cuda_skinny_gemm.py [--rows 1,2,4,8,16]

A decode step of a dense model is a chain of skinny matmuls (rows = sequences in the batch) whose time
is reading the weight once. For each Llama-3-8B projection shape (bf16) this prints the achieved
bandwidth of `F.linear` (cuBLAS) at each row count, as a ratio against a device-to-device copy measured
in the same run (the baseline). CUDA graphs replay the matmuls, as the engine's decode graphs do, so
launch overhead is out of the figure.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def timed_graph(fn, repeats: int = 50) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph of `repeats` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    return best


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), best of 5: the same baseline as
    benchmarks/h200_llama8b.py."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'shape':10s}" + "".join(f"{f'rows={r} GB/s':>15s}{'/copy':>7s}" for r in rows))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        line = f"{name:10s}"
        for r in rows:
            x = torch.randn(r, k, dtype=torch.bfloat16, device="cuda")
            t = timed_graph(lambda: F.linear(x, w))
            bw = (w.numel() * 2 + x.numel() * 2 + r * n * 2) / t
            line += f"{bw / 1e9:15.0f}{bw / copy_bw:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
