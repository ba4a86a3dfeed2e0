"""Decode throughput of the engine on a GPU with and without CUDA graphs, same run, same weights.

    python benchmarks/cuda_decode.py [--batch 1,16] [--steps 64]

A random Llama-3.2-1B-sized model (hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, vocab
32000) in bf16 from `--load-format dummy`; prompts of 32 tokens; greedy decoding of --steps tokens per
sequence. Prints decode tokens/s per batch size for eager and graphed steps, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer

CONFIG = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000,
          "max_position_embeddings": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def tokens_per_s(engine, batch: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (32,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up: lazy CUDA/cuBLAS initialisation, graph capture
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(CONFIG))
    write_word_tokenizer(root, CONFIG["vocab_size"])
    batches = [int(b) for b in args.batch.split(",")]
    results = {}
    for graphs in (False, True):
        cfg = EngineConfig(max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=2048,
                           kv_cache_memory=4 << 30, dtype=torch.bfloat16, load_format="dummy", cuda_graphs=graphs)
        engine = build_llm_engine(root, "safetensors", cfg, chip="cuda", progress=False)
        results[graphs] = {b: tokens_per_s(engine, b, args.steps) for b in batches}
        del engine
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}: Llama-1B-sized random model, bf16, {args.steps} decode steps")
    print(f"{'batch':>6}{'eager tok/s':>14}{'graphs tok/s':>14}{'ratio':>8}")
    for b in batches:
        print(f"{b:>6}{results[False][b]:14.1f}{results[True][b]:14.1f}{results[True][b] / results[False][b]:8.2f}")


if __name__ == "__main__":
    main()
