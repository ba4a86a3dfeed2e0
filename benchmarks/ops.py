"""Each override of a backend against the plain-torch reference on the same device, and against the
op's roofline (bytes over memory bandwidth, FLOPs over matrix throughput, whichever is longer).

    python benchmarks/ops.py --chip cuda [--bandwidth-gbs 4800 --tflops 990]   # H200 datasheet figures

Shapes: a Llama-3-8B-sized layer (hidden 4096, 32/8 heads of 128, intermediate 14336) in bf16 at
1 / 16 / 256 rows, through `flagdeploy.ops.check.model_cases`. Times are the best of 20 runs after a
warm-up, synchronised. Prints time of each, the ratio reference/override, and override/roofline.
"""

from __future__ import annotations

import argparse
import time

import torch

from flagdeploy import ops
from flagdeploy.ops.check import _fresh, _to, model_cases
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (Int4Weight, Int8Weight, Fp8BlockWeight)):
        return sum(_bytes(getattr(x, k, None)) for k in ("q", "scales", "zeros", "scale_inv"))
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


def _flops(op: str, args) -> float:
    if op.startswith("linear"):
        w = args[1]
        n, k = (w.out_features, w.in_features) if not isinstance(w, torch.Tensor) else w.shape
        return 2.0 * args[0].shape[0] * n * k
    if op == "attention_prefill":
        t, h, d = args[0].shape
        return 2.0 * h * d * t * t  # causal: half of 4 h d t^2
    if op == "paged_attention_decode":
        b, h, d = args[0].shape
        return 4.0 * h * d * float(args[4].sum())
    return 0.0


def _time(fn, args, kwargs, device: str, repeats: int = 20) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn(*_fresh(args), **kwargs)
    sync()
    best = float("inf")
    for _ in range(repeats):
        a = _fresh(args)
        sync()
        t = time.perf_counter()
        fn(*a, **kwargs)
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="cuda")
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    ap.add_argument("--tflops", type=float, default=990.0)
    args = ap.parse_args()
    be = ops.get_backend(args.chip)
    ops.use_backend(be)
    dev = be.device_type
    print(f"backend {be.name} on {torch.cuda.get_device_name() if dev == 'cuda' else dev}; roofline "
          f"{args.bandwidth_gbs:g} GB/s, {args.tflops:g} TFLOP/s")
    print(f"{'op':<24}{'shape':<34}{'reference us':>13}{'override us':>12}{'x faster':>9}{'roofline us':>12}{'% of roof':>10}")
    gen = torch.Generator().manual_seed(0)
    for name, label, a, kw in model_cases(LLAMA_8B, torch.bfloat16, gen):
        if name not in be.overrides:
            continue
        dev_args = [_to(x, dev) for x in a]
        spec = ops.OPS[name]
        t_ref = _time(spec.reference, dev_args, kw, dev)
        prep = be.prepare.get(name)
        native = [prep(x) if prep and isinstance(x, (Int4Weight, Int8Weight)) else x for x in dev_args]
        t_new = _time(be.overrides[name], native, kw, dev)
        moved = _bytes(dev_args) + _bytes(a[0])  # inputs read + an output the size of the first input
        roof = max(moved / (args.bandwidth_gbs * 1e9), _flops(name, a) / (args.tflops * 1e12))
        print(f"{name:<24}{label[:33]:<34}{t_ref * 1e6:13.1f}{t_new * 1e6:12.1f}{t_ref / t_new:9.2f}{roof * 1e6:12.1f}"
              f"{100 * roof / t_new:9.0f}%")


if __name__ == "__main__":
    main()
