"""The generic backend against the native cuda backend and the bandwidth limit: Llama-3-8B-shaped decode.

    python benchmarks/generic_decode.py [--batches 1,16,64] [--steps 64] [--table PATH] [--tune-out PATH]
                                        [--force-mm]

One run, one GPU, random bf16 weights of Llama-3-8B's shapes (the same seed for every engine), CUDA graphs
on, output length forced. Measured in this run:
- copy bandwidth (the hardware limit of decode) and, per batch, the bandwidth limit in tokens/s: batch over
  the time to read every weight once plus the batch's KV cache at its mean length;
- decode tokens/s at each batch through three engines: the native cuda backend (its Triton kernels and
  cuBLAS), the generic backend (backends/generic) running what its choice table chose, and the generic
  backend with FlagGems forced for every op it has a kernel for (what the measured choice buys);
- the choice table itself, tuned here at Llama-3-8B's shapes in bf16 (or loaded with --table), and each
  generic engine's prefill logits against the native engine's on the same weights (max relative error and
  argmax agreement) before anything is timed.

FlagGems' mm autotunes ~30 s per (M bucket, N, K) on first use: forcing it for every projection and graph
bucket costs many minutes, so the forced run keeps the table's choice for `linear` unless --force-mm.
Needs flag_gems (GEMS_VENDOR=nvidia on an NVIDIA GPU).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_llama8b import CONFIG, PROMPT, hardware, prompts, sync_time  # noqa: E402 - the same model and limits

from flagdeploy.engine import EngineConfig, SamplingParams  # noqa: E402
from flagdeploy.engine.replica import build_llm_engine  # noqa: E402
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer  # noqa: E402


def engine_on(root: Path, chip, batches: list[int], steps: int):
    cfg = EngineConfig(max_model_len=PROMPT + steps + 8, max_num_seqs=max(batches), max_num_batched_tokens=2048,
                       kv_cache_memory=8 << 30, dtype=torch.bfloat16, load_format="dummy", device="cuda",
                       cuda_graphs=True)
    return build_llm_engine(root, "safetensors", cfg, chip=chip, progress=False)


def decode_rates(engine, batches: list[int], steps: int) -> dict[int, float]:
    """Decode tokens/s per batch: the time for `steps` tokens less the time for 1 (the prefill)."""
    rates = {}
    for b in batches:
        ps = prompts(b, PROMPT)
        full = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.generate(ps, full)  # warm-up: graph capture, Triton compiles, cuBLAS plans
        t_full = min(sync_time(lambda: engine.generate(ps, full)) for _ in range(2))
        t_one = min(sync_time(lambda: engine.generate(ps, one)) for _ in range(2))
        rates[b] = b * (steps - 1) / (t_full - t_one)
    return rates


def forced(table: dict, force_mm: bool) -> dict:
    """The table with FlagGems chosen wherever its candidate passed its check (linear only with force_mm)."""
    out = copy.deepcopy(table)
    for op, entries in out["ops"].items():
        if op == "linear" and not force_mm:
            continue
        for entry in entries.values():
            if entry["candidates"].get("flaggems", {}).get("passed"):
                entry["choice"] = "flaggems"
    return out


def chosen(table: dict) -> str:
    """op: candidate per bucket, for the report."""
    return "; ".join(f"{op} " + ",".join(f"{k.split('/')[1]}={e['choice']}" for k, e in entries.items())
                     for op, entries in table["ops"].items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--table", help="a choice table to load instead of tuning here")
    ap.add_argument("--retune", default="", help="ops (comma-separated) to measure again into the loaded --table")
    ap.add_argument("--tune-out", help="where to write the table tuned here (default: a temporary file)")
    ap.add_argument("--force-mm", action="store_true", help="force FlagGems' mm too in the forced run (slow start)")
    args = ap.parse_args()
    os.environ.setdefault("GEMS_VENDOR", "nvidia")
    from flagdeploy.backends.generic import choices, make_backend, tune

    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(CONFIG))
    write_word_tokenizer(root, CONFIG["vocab_size"])
    bw, _ = hardware()

    be = make_backend("nvidia", "h200")
    if args.table:
        table = choices.read(args.table)
        if args.retune:
            again = tune.measure(be, "h200", "nvidia", shapes=tune.SHAPES_LLAMA_8B, dtypes=(torch.bfloat16,),
                                 buckets=table["buckets"], ops=args.retune.split(","))
            table["ops"].update(again["ops"])
            print(tune.summary(again))
    else:
        t = time.perf_counter()
        table = tune.measure(be, "h200", "nvidia", shapes=tune.SHAPES_LLAMA_8B, dtypes=(torch.bfloat16,))
        print(f"tuned in {time.perf_counter() - t:.0f} s")
        print(tune.summary(table))
    tuned_path = choices.write(table, args.tune_out or Path(tempfile.mkdtemp()) / "h200.yaml")
    forced_path = choices.write(forced(table, args.force_mm), Path(tempfile.mkdtemp()) / "forced.yaml")

    probe = torch.tensor(prompts(1, 64, seed=1)[0], device="cuda")
    rates, checks = {}, {}
    native_logits = None
    for name, path in [("native cuda", None), ("generic (measured choice)", tuned_path),
                       ("generic (FlagGems forced)", forced_path)]:
        chip = "cuda"
        if path is not None:  # a fresh generic backend with this table loaded
            chip = make_backend("nvidia", "h200")
            chip.state.load(path)
        engine = engine_on(root, chip, batches, args.steps)
        with torch.inference_mode():
            logits = engine.model.score(probe).float()
        if native_logits is None:
            native_logits = logits
        else:
            rel = ((logits - native_logits).abs().max() / native_logits.abs().max()).item()
            agree = (logits.argmax(-1) == native_logits.argmax(-1)).float().mean().item()
            checks[name] = f"prefill logits vs native: max rel err {rel:.3f}, argmax agreement {agree:.0%}"
            if rel > 0.1:
                raise SystemExit(f"{name}: logits far from the native backend's on the same weights ({checks[name]})")
        rates[name] = decode_rates(engine, batches, args.steps)
        print(f"{name}: " + ", ".join(f"batch {b} {r:.0f} tok/s" for b, r in rates[name].items()), flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()

    c = CONFIG
    weights = 2 * (c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * (
        c["hidden_size"] * c["head_dim"] * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
        + 3 * c["hidden_size"] * c["intermediate_size"]))
    kv_per_token = 2 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"]
    print(f"\nLlama-3-8B shapes, bf16, CUDA graphs, {args.steps} steps from {PROMPT}-token prompts; "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    for name, text in checks.items():
        print(f"  {name}: {text}")
    print("choice table: " + chosen(table))
    native = rates["native cuda"]
    header = f"{'batch':>6} {'limit tok/s':>12}" + "".join(f" {n:>27}" for n in rates)
    print(header)
    for b in batches:
        limit = b / ((weights + b * (PROMPT + args.steps / 2) * kv_per_token) / (bw * 1e9))
        row = f"{b:>6} {limit:>12.0f}"
        for name, r in rates.items():
            row += f" {r[b]:>8.0f} ({r[b] / native[b]:.2f}x, {r[b] / limit:.0%} lim)"
        print(row)


if __name__ == "__main__":
    main()
