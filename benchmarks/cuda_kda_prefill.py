"""KDA over a prefill on the GPU: the cuda backend's Triton recurrence against the chunked reference, same run.

    python benchmarks/cuda_kda_prefill.py [--tokens 256,2048,8192] [--heads 64]

GLM-5.3-Flash's KDA layer shapes (head dim 128, float32 state), random inputs: bf16 q/k/v, the lower-bounded
log-decay, beta. First both are checked against each other (outputs and final states), then timed (CUDA
events, best of 3 after a warm-up): `kda_chunk`'s reference (the chunked closed form in torch ops, 64 tokens
a chunk) and the backend's `kda_recurrent` kernel (a program per (head, 32 value channels) walks the tokens
with its state slice in registers). The last table says which is faster per prompt length.
"""

from __future__ import annotations

import argparse

import torch

from flagdeploy import ops
from flagdeploy.backends.cuda import ops as cuda_ops
from flagdeploy.ops.registry import OPS

D = 128


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,2048,8192")
    ap.add_argument("--heads", type=int, default=64)
    args = ap.parse_args()
    ops.use_backend("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = args.heads
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        def rnd(*shape, dt=torch.bfloat16):
            return torch.randn(*shape, generator=g, device="cuda").to(dt)

        q, k, v = rnd(t, h, D), rnd(t, h, D), rnd(t, h, D)
        gate = -5.0 * torch.sigmoid(rnd(t, h, D, dt=torch.float32))
        beta = torch.sigmoid(rnd(t, h))
        state = 0.1 * rnd(h, D, D, dt=torch.float32)
        ref = OPS["kda_chunk"].reference(q, k, v, gate, beta, state)
        got = cuda_ops.kda_recurrent(q, k, v, gate, beta, state)
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
        if err > 2e-2:
            raise SystemExit(f"MISMATCH at {t} tokens: relative error {err:.1e}")
        chunked = timed(lambda: OPS["kda_chunk"].reference(q, k, v, gate, beta, state))
        recurrent = timed(lambda: cuda_ops.kda_recurrent(q, k, v, gate, beta, state))
        rows.append((t, err, chunked, recurrent))
        print(f"{t} tokens: chunked reference {chunked * 1e3:.2f} ms, Triton recurrence {recurrent * 1e3:.2f} ms "
              f"(rel err {err:.1e})", flush=True)
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  KDA, {h} heads x {D}, bf16 in, float32 state")
    print(f"{'tokens':>8}{'rel err':>10}{'chunked ref ms':>16}{'recurrent ms':>14}{'speed-up':>10}")
    for t, err, chunked, recurrent in rows:
        print(f"{t:8d}{err:10.1e}{chunked * 1e3:16.2f}{recurrent * 1e3:14.2f}{chunked / recurrent:10.2f}")


if __name__ == "__main__":
    main()
