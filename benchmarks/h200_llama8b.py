"""Llama-3-8B-shaped serving on one GPU: our engine against transformers and the hardware, same call.

    python benchmarks/h200_llama8b.py [--batches 1,16,64] [--steps 128] [--prefill 8192]

Random bf16 weights of the real shapes (no checkpoint travels to the GPU machine), output length
forced (EOS ignored). Measured in this one run:
- copy bandwidth (a 4 GiB device-to-device copy) and bf16 matmul throughput: the hardware limits;
- decode tokens/s at each batch size: ours (CUDA graphs) and transformers' `generate`; decode time is
  the time for --steps tokens less the time for 1 (which is the prefill), so prefill is not counted;
- prefill of one --prefill-token prompt: TFLOP/s (weights' 2·N·T plus causal attention) for both.
The decode limit at batch B is bandwidth over the bytes one step must read: all weights once plus the
KV cache of B sequences at their mean length. Correctness first: our greedy tokens are compared with
transformers' on the same weights before anything is timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 16384, "rope_theta": 500000.0,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
PROMPT = 128


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def hardware() -> tuple[float, float]:
    """(copy GB/s, bf16 matmul TFLOP/s), best of a few repeats."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    bw = max(2 * src.numel() / sync_time(lambda: dst.copy_(src)) for _ in range(5)) / 1e9
    src = dst = None
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    x @ x
    tflops = max(2 * 8192**3 * 10 / sync_time(lambda: [x @ x for _ in range(10)]) for _ in range(3)) / 1e12
    return bw, tflops


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CONFIG["vocab_size"], (length,), generator=g).tolist() for _ in range(batch)]


def ours(root: Path, batches: list[int], steps: int, prefill: int):
    cfg = EngineConfig(max_model_len=max(prefill + 8, PROMPT + steps + 8), max_num_seqs=max(batches),
                       max_num_batched_tokens=max(prefill, 2048), kv_cache_memory=8 << 30, dtype=torch.bfloat16,
                       load_format="dummy", device="cuda", cuda_graphs=True)
    engine = build_llm_engine(root, "safetensors", cfg, chip="cuda", progress=False)
    decode, gpu_share = {}, {}
    run = engine.runner.run
    spent = [0.0]

    def timed_run(batch):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = run(batch)
        torch.cuda.synchronize()
        spent[0] += time.perf_counter() - t
        return out

    for b in batches:
        ps = prompts(b, PROMPT)
        full = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.generate(ps, full)  # warm-up: graph capture, cuBLAS plans
        t_full = min(sync_time(lambda: engine.generate(ps, full)) for _ in range(2))
        t_one = min(sync_time(lambda: engine.generate(ps, one)) for _ in range(2))
        decode[b] = b * (steps - 1) / (t_full - t_one)
        engine.runner.run, spent[0] = timed_run, 0.0  # where a decode step's time goes: forward vs the rest
        total = sync_time(lambda: engine.generate(ps, full))
        engine.runner.run = run
        gpu_share[b] = spent[0] / total
    # a fresh prompt each time: a repeated one would be served by the prefix cache
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(prompts(1, prefill, seed=10), one)
    t_prefill = min(sync_time(lambda: engine.generate(prompts(1, prefill, seed=11 + i), one)) for i in range(2))
    return engine, decode, gpu_share, t_prefill


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our model's weights under transformers' names: fused projections split back into their parts."""
    c = CONFIG
    rows = {"q_proj": c["num_attention_heads"] * c["head_dim"], "k_proj": c["num_key_value_heads"] * c["head_dim"],
            "v_proj": c["num_key_value_heads"] * c["head_dim"], "gate_proj": c["intermediate_size"],
            "up_proj": c["intermediate_size"]}
    sd = {}
    for name, slot in model.weight_slots().items():
        if len(slot) == 2:  # (parameter, its tensor-parallel shard)
            sd[name] = slot[0]
            continue
        lin, part, _ = slot
        if len(lin.parts) == 1:
            sd[name] = lin.weight
            continue
        start = sum(rows[p] for p in lin.parts[: lin.parts.index(part)])
        sd[name] = lin.weight[start: start + rows[part]]
    return sd


def transformers_model(engine):
    """transformers' Llama with exactly our engine's weights (copied from its state)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures", "torch_dtype")})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    missing, _ = model.load_state_dict(hf_state_dict(engine.model), strict=False)
    if [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"weights not carried over to transformers: {missing[:5]}")
    # buffers are not parameters: rebuild them on the device
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to("cuda")
    model.eval()
    return model, True


def theirs(model, batches: list[int], steps: int, prefill: int):
    decode = {}
    for b in batches:
        ids = torch.tensor(prompts(b, PROMPT), device="cuda")
        attn = torch.ones_like(ids)

        def gen(n: int):
            with torch.inference_mode():
                model.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)

        gen(4)
        t_full = sync_time(lambda: gen(steps))
        t_one = sync_time(lambda: gen(1))
        decode[b] = b * (steps - 1) / (t_full - t_one)
    long = torch.tensor(prompts(1, prefill), device="cuda")

    def run():
        with torch.inference_mode():
            model(long, logits_to_keep=1)

    run()
    return decode, min(sync_time(run) for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--theirs-steps", type=int, default=32, help="transformers is slow: fewer steps for it")
    ap.add_argument("--prefill", type=int, default=8192)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(CONFIG))
    write_word_tokenizer(root, CONFIG["vocab_size"])

    bw, peak = hardware()
    engine, our_decode, gpu_share, our_prefill = ours(root, batches, args.steps, args.prefill)
    hf = hf_state_dict(engine.model)
    weight_bytes = sum(t.numel() * t.element_size() for name, t in hf.items() if "embed_tokens" not in name)
    n_params = sum(t.numel() for name, t in hf.items() if "embed_tokens" not in name and "lm_head" not in name)
    del hf
    model, _ = transformers_model(engine)
    # bf16 over 32 random layers is noisy: judge our error against a float32 run of transformers, next
    # to transformers' own bf16 error (the noise floor of the format).
    ps = torch.tensor(prompts(1, 64, seed=1), device="cuda")
    with torch.inference_mode():
        mine = engine.model.score(ps[0]).float()
        ref16 = model(ps).logits[0].float()
        ref32 = model.float()(ps).logits[0].float()
        model.to(torch.bfloat16)

    def rel(x):
        return ((x - ref32).abs().max() / ref32.abs().max()).item()

    err, floor = rel(mine), rel(ref16)
    same = (mine.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    check = (f"prefill logits vs transformers float32 on the same weights: ours {err:.3f}, transformers bf16 "
             f"{floor:.3f} (max rel err); argmax agreement {same:.0%}")
    if err > max(2 * floor, 0.02):
        raise SystemExit(f"our logits are further from the float32 reference than bf16 explains ({check})")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    their_decode, their_prefill = theirs(model, batches, args.theirs_steps, args.prefill)

    L, H, hd, kvh = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"], CONFIG["head_dim"], CONFIG["num_key_value_heads"]
    T = args.prefill
    prefill_flops = 2 * n_params * T + 2 * L * H * hd * T * T  # causal: half of QK^T and PV each
    kv_per_token = 2 * L * kvh * hd * 2
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {bw:.0f} GB/s  bf16 matmul {peak:.0f} TFLOP/s")
    print(f"weights {weight_bytes / 1e9:.2f} GB  {check}")
    print(f"{'workload':<28}{'transformers':>14}{'limit':>12}{'ours':>12}{'ours/limit':>12}{'ours/tf':>10}"
          f"{'in forward':>12}")
    for b in batches:
        mean_ctx = PROMPT + args.steps / 2
        limit = bw * 1e9 / (weight_bytes + b * mean_ctx * kv_per_token) * b
        print(f"{f'decode, {b} stream(s) tok/s':<28}{their_decode[b]:14.1f}{limit:12.1f}{our_decode[b]:12.1f}"
              f"{our_decode[b] / limit:12.2f}{our_decode[b] / their_decode[b]:10.1f}{gpu_share[b]:12.0%}")
    ours_tf, theirs_tf = prefill_flops / our_prefill / 1e12, prefill_flops / their_prefill / 1e12
    print(f"{f'prefill {T} TFLOP/s':<28}{theirs_tf:14.1f}{peak:12.1f}{ours_tf:12.1f}{ours_tf / peak:12.2f}"
          f"{ours_tf / theirs_tf:10.2f}")


if __name__ == "__main__":
    main()
