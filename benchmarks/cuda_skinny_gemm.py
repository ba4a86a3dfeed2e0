"""How close decode-sized matmuls come to the GPU's memory bandwidth, per row count.

    python benchmarks/cuda_skinny_gemm.py [--rows 1,2,4,8,16] [--triton [--sweep]]

A decode step of a dense model is a chain of skinny matmuls (rows = sequences in the batch) whose time
is reading the weight once. For each Llama-3-8B and GLM-5.3-Flash projection shape (bf16) this prints the
achieved bandwidth of `F.linear` (cuBLAS) at each row count, as a ratio against a device-to-device copy
measured in the same run (the baseline). CUDA graphs replay the matmuls, as the engine's decode graphs
do, so launch overhead is out of the figure. --triton adds the cuda backend's `skinny_linear`
(backends/cuda/triton_gemv.py) and its speed-up over cuBLAS; --sweep tries its launch configurations
per shape and prints the best.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096),
          # GLM-5.3-Flash: KDA input / output, MLA q_a, kv_a, q_b, o, shared expert, f_b
          "glm_kda_in": (24896, 4096), "glm_kda_o": (4096, 8192), "glm_q_a": (1536, 4096), "glm_kv_a": (512, 4096),
          "glm_q_b": (16384, 1536), "glm_mla_o": (4096, 16384), "glm_shared_gu": (4096, 4096),
          "glm_shared_down": (4096, 2048), "glm_f_b": (8192, 128)}
SWEEP = [{"block_n": bn, "block_k": bk, "num_stages": st, "num_warps": wp}
         for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4, 6) for wp in (4,)]


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
    ap.add_argument("--triton", action="store_true", help="also time the cuda backend's Triton skinny_linear")
    ap.add_argument("--sweep", action="store_true", help="with --triton: the best launch configuration per shape")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.triton:
        import triton

        from flagdeploy.backends.cuda.triton_gemv import TUNED, _cfg, skinny_linear
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    cols = "".join(f"{f'rows={r} GB/s':>15s}{'/copy':>7s}" + (f"{'triton x':>9s}" if args.triton else "") for r in rows)
    print(f"{'shape':16s}{cols}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        line = f"{name:16s}"
        for r in rows:
            x = torch.randn(r, k, dtype=torch.bfloat16, device="cuda")
            t = timed_graph(lambda: F.linear(x, w))
            bw = (w.numel() * 2 + x.numel() * 2 + r * n * 2) / t
            line += f"{bw / 1e9:15.0f}{bw / copy_bw:7.2f}"
            if args.triton:
                err = (skinny_linear(x, w, None, SWEEP[0]).float() - F.linear(x, w).float()).abs().max().item()
                if err > 1e-2 * F.linear(x, w).float().abs().max().item():
                    raise SystemExit(f"MISMATCH {name} rows {r}: {err}")
                configs = SWEEP if args.sweep else [TUNED.get((n, k), _cfg(32, 256, 4))]
                times = []
                for c in configs:
                    try:
                        times.append((timed_graph(lambda c=c: skinny_linear(x, w, None, c)), c))
                    except triton.runtime.errors.OutOfResources:  # too many stages of too large tiles
                        torch.cuda.synchronize()
                tt, best = min(times, key=lambda p: p[0])
                line += f"{t / tt:9.2f}"
                if args.sweep:
                    print(f"  {name} rows {r}: best {best} {tt * 1e6:.1f} us (cuBLAS {t * 1e6:.1f} us)")
        print(line)


if __name__ == "__main__":
    main()
