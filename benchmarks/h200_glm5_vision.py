"""GLM-5.3-Flash's vision tower at true dims on one GPU: ours against transformers' and the matmul limit.

    python benchmarks/h200_glm5_vision.py              # H200: a 1024x1024 image and a 16-frame 448x448 video
    python benchmarks/h200_glm5_vision.py --tiny       # the same logic on the CPU at toy size

transformers' `Glm5NextVisionModel` (config defaults: 24 blocks of width 1024, 16 heads, MLP 4096; the
projector's output at the text width, 4096) with random bf16 weights, and ours
(`flagdeploy.models.glm5_next.Glm5VisionTower`) filled from its state dict through `weight_slots`, so both
run identical weights. The image goes through the model's image processor (PIL flavour); the video's frames
are laid out as its video processor lays them out (tests/test_glm5_vision.py checks that layout).

Per input: the relative RMS difference of the two outputs; each tower's time (best of a few runs, after a
warm-up; ours replays the CUDA graph of its blocks that the warm-up captured, as it does for a layout
that comes twice in a row, and a line under the row gives its eager time too); the limit = the forward's
matmul and attention FLOPs over the bf16 matmul rate measured in the same run (an 8192^3 matmul);
ours / limit and transformers / ours.
"""

from __future__ import annotations

import argparse

import torch

from flagdeploy import ops
from flagdeploy.models.glm5_next import Glm5VisionConfig, Glm5VisionTower, _canonical
from flagdeploy.models.slots import copy_param
from flagdeploy.ops.check import fastest, synchronizer


def matmul_rate(device: str, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / fastest(lambda: a @ a, 5, device)


def flops(c: Glm5VisionConfig, grid: torch.Tensor) -> float:
    """Matmul and attention FLOPs of one forward: per patch the patch embedding and every block's linears,
    per frame the attention among its patches, per merged token the merger."""
    h, i, d, p, m = c.hidden_size, c.intermediate_size, c.out_hidden_size, c.projection_intermediate_size, c.spatial_merge_size
    patch_in = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    total = 0.0
    for t, gh, gw in grid.tolist():
        n = gh * gw  # patches per frame
        total += 2 * t * n * (patch_in * h + c.depth * (4 * h * h + 3 * h * i))
        total += c.depth * t * 4 * n * n * h  # q k^T and p v, all heads
        total += 2 * t * n // (m * m) * (m * m * h * d + d * d + 3 * d * p)
    return total


def sdpa_backends(cfg: Glm5VisionConfig, grid: torch.Tensor, runs: int) -> str:
    """ms of one block's attention (each item's frames as the batch, q/k/v as the tower lays them out: strided
    [frames, heads, patches, head_dim] views) under each SDPA backend that takes it (--profile, on the GPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    out = []
    for t, gh, gw in grid.tolist():
        n = gh * gw
        qkv = torch.randn(t * n, heads, 3, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (z.view(t, n, heads, d).transpose(1, 2) for z in qkv.unbind(2))
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(be):
                    ms = fastest(lambda q=q, k=k, v=v: sdpa(q, k, v), runs, "cuda") * 1e3
                out.append(f"{t}x{n} {be.name}: {ms:.3f} ms")
            except RuntimeError as exc:
                out.append(f"{t}x{n} {be.name}: unavailable ({str(exc).splitlines()[0][:80]})")
        ms = fastest(lambda q=q, k=k, v=v: sdpa(q, k, v), runs, "cuda") * 1e3
        out.append(f"{t}x{n} default: {ms:.3f} ms")
        qc, kc, vc = (z.contiguous() for z in (q, k, v))
        ms = fastest(lambda q=qc, k=kc, v=vc: sdpa(q, k, v), runs, "cuda") * 1e3
        out.append(f"{t}x{n} default, contiguous [frames, heads, patches, head_dim]: {ms:.3f} ms")
    return "; ".join(out)


def enqueue(fn, runs: int = 3) -> float:
    """ms of host time until `fn` returns, the GPU idle when it starts (best of `runs`): near the forward's
    time, the forward is bound by the host launching its kernels rather than by the GPU running them."""
    import time

    best = float("inf")
    with torch.inference_mode():
        for _ in range(runs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    torch.cuda.synchronize()
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top kernels of our forward, per input")
    ap.add_argument("--tiny", action="store_true", help="toy size on the CPU (checks the script)")
    args = ap.parse_args()
    from PIL import Image
    from transformers import Glm5NextImageProcessorPil, Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    if args.tiny:
        device, dims, side, frames, fside, n = "cpu", dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96,
                                                            out_hidden_size=64, projection_intermediate_size=80), 112, 4, 56, 512
        args.runs = 1
    else:
        device, dims, side, frames, fside, n = "cuda", dict(out_hidden_size=4096), 1024, 16, 448, 8192
    ops.use_backend("cuda" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    hf_cfg = Glm5NextVisionConfig(**dims)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        theirs = Glm5NextVisionModel(hf_cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for pname, t in theirs.named_parameters():  # weights N(0, 0.02), norm scales ~1, biases ~0
            t.normal_(0.0 if t.dim() > 1 or pname.endswith("bias") else 1.0, 0.02)
    cfg = Glm5VisionConfig.from_hf(hf_cfg.to_dict())
    with torch.device(device):
        ours = Glm5VisionTower(cfg, torch.bfloat16)
    slots = ours.weight_slots()
    for name, t in theirs.state_dict().items():
        slot = slots[_canonical("model.visual." + name)]
        if len(slot) == 2:
            copy_param(name, slot[0], t, slot[1])
        else:
            slot[0].load_part(slot[1], slot[2], t)
    ours.finalize()

    img = Image.fromarray(torch.randint(0, 256, (side, side, 3), dtype=torch.uint8).numpy())
    image = Glm5NextImageProcessorPil()(images=[img], return_tensors="pt")
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    x = torch.randn(frames, 3, fside, fside)
    t, gh, gw = frames // tp, fside // p, fside // p
    x = x.view(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    cases = [(f"image {side}x{side}", image["pixel_values"], image["image_grid_thw"]),
             (f"video {frames} frames {fside}x{fside}", x.reshape(t * gh * gw, 3 * tp * p * p), torch.tensor([[t, gh, gw]]))]
    rate = matmul_rate(device, n)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    import transformers
    print(f"# {name}  torch {torch.__version__}  transformers {transformers.__version__}  bf16 matmul "
          f"{rate / 1e12:.0f} TFLOP/s  (vision tower: depth {cfg.depth}, width {cfg.hidden_size}, out {cfg.out_hidden_size})")
    print("| input | patches | tokens | rel. diff ours vs transformers | transformers ms | ours ms | limit ms | "
          "ours / limit | transformers / ours |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, pv, grid in cases:
        pv, grid = pv.to(device), grid.to(device)
        with torch.inference_mode():
            want = theirs(pv.to(torch.bfloat16), grid_thw=grid).pooler_output
            want = torch.cat(want) if isinstance(want, (list, tuple)) else want
            got = ours(pv, grid)
            diff = ((got.float() - want.float()).norm() / want.float().norm()).item()
            t_theirs = fastest(lambda: theirs(pv.to(torch.bfloat16), grid_thw=grid), args.runs, device)
            ours.cuda_graphs = False
            t_eager = fastest(lambda: ours(pv, grid), args.runs, device)
            ours.cuda_graphs = True  # the layout came before: the next call captures, the timed ones replay
            t_ours = fastest(lambda: ours(pv, grid), args.runs, device)
            replayed = ours(pv, grid)
            replay_diff = ((replayed.float() - got.float()).norm() / got.float().norm()).item()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with torch.inference_mode(), profile(activities=activities) as prof:
                ours(pv, grid)
                synchronizer(device)()
            key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90))
            if device == "cuda":
                print("# SDPA per block:", sdpa_backends(cfg, grid.cpu(), args.runs))
                host_ours = enqueue(lambda: ours(pv, grid))
                host_theirs = enqueue(lambda: theirs(pv.to(torch.bfloat16), grid_thw=grid))
                print(f"# host time to enqueue one forward (no final sync): ours {host_ours:.1f} ms, "
                      f"transformers {host_theirs:.1f} ms")
        limit = flops(cfg, grid.cpu()) / rate
        print(f"| {label} | {pv.shape[0]} | {got.shape[0]} | {diff:.1e} | {t_theirs * 1e3:.1f} | {t_ours * 1e3:.1f} | "
              f"{limit * 1e3:.1f} | {t_ours / limit:.2f} | {t_theirs / t_ours:.2f} |", flush=True)
        graphed = ours._graph is not None
        print(f"# {label}: ours {'through its CUDA graph' if graphed else 'eager (no graph was captured)'}; "
              f"eager {t_eager * 1e3:.1f} ms (transformers / eager {t_theirs / t_eager:.2f}); "
              f"replayed vs eager output rel. diff {replay_diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
