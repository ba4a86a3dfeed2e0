"""Decode and prefill speed of glm5_next (GLM-5.3-Flash's architecture) on the CPU, against transformers.

    python benchmarks/glm5_cpu.py [--batch 8] [--tokens 32] [--prompt 64] [--repeat 5]

A small-but-not-trivial random configuration (every layer kind: KDA, MLA + DSA indexer, dense and MoE
FFNs, hyper-connections) is built by transformers, saved in BF16 as the published checkpoint is, and
loaded by flagdeploy from the same files. transformers runs it in float32 and in bfloat16 (the same
weights: every value is a bf16 number); the faster of the two is the baseline. Each decodes `--batch`
sequences of `--prompt` random tokens for `--tokens` forced steps; the script prints tokens/s for each
and the ratios. flagdeploy runs in float32 with its serving default (`--weight-format auto`: the BF16
expert banks stay bf16), eagerly and with its decode step compiled (`flagdeploy serve --compile`; the
compile happens while the engine is built, outside the timings), and compiled with every weight float32
(`--weight-format dense`).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

TEXT = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_group=2, topk_group=1,
    num_experts_per_tok=4, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=64, v_head_dim=64, index_topk=64,
    index_head_dim=32, index_n_heads=8, index_kpool=4, linear_head_dim=32, linear_num_heads=8, hc_mult=4,
    hc_sinkhorn_iters=20, pad_token_id=0, eos_token_id=None,
)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=256,
              projection_intermediate_size=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5, help="timings per figure, taken in turns; the best is kept")
    args = ap.parse_args()

    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    torch.manual_seed(0)
    hf16 = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).eval()
    hf16 = hf16.to(torch.bfloat16)
    hf = copy.deepcopy(hf16).float()
    prompts = torch.randint(3, TEXT["vocab_size"], (args.batch, args.prompt))
    with tempfile.TemporaryDirectory() as tmp:
        hf16.save_pretrained(tmp)
        _tokenizer(Path(tmp))
        engines = {name: build_llm_engine(Path(tmp), "safetensors", EngineConfig(
            max_model_len=args.prompt + args.tokens + 8, max_num_seqs=args.batch,
            max_num_batched_tokens=args.batch * args.prompt, compile=compiled, weight_format=fmt),
            chip="cpu", progress=False)
            for name, compiled, fmt in (("flagdeploy engine", False, "auto"), ("flagdeploy --compile", True, "auto"),
                                        ("flagdeploy --compile dense", True, "dense"))}

    def ours(engine):
        def run(n_tokens: int) -> float:
            p = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            engine.generate(prompts.tolist(), p)
            return time.perf_counter() - t
        return run

    def theirs(model):
        def run(n_tokens: int) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n_tokens,
                               min_new_tokens=n_tokens, do_sample=False)
            return time.perf_counter() - t
        return run

    runners = {"transformers fp32": theirs(hf), "transformers bf16": theirs(hf16),
               **{n: ours(e) for n, e in engines.items()}}
    for fn in runners.values():
        fn(2)  # warm-up
    # best of --repeat, the runners taking turns: this shared 2-core machine's speed drifts within a run,
    # and turns spread the drift over all of them instead of favouring whichever runs in a fast spell
    prefill, total = {n: float("inf") for n in runners}, {n: float("inf") for n in runners}
    for _ in range(args.repeat):
        for name, fn in runners.items():
            prefill[name] = min(prefill[name], fn(1))  # one token: (almost) only the prefill
            total[name] = min(total[name], fn(args.tokens))
    rows = {n: (args.batch * args.prompt / prefill[n], args.batch * (args.tokens - 1) / max(total[n] - prefill[n], 1e-9))
            for n in runners}
    print(f"glm5_next tiny ({TEXT['num_hidden_layers']} layers, hidden {TEXT['hidden_size']}, "
          f"{TEXT['n_routed_experts']} experts), batch {args.batch}, prompt {args.prompt}, {args.tokens} tokens")
    print(f"{'':27} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, (pf, dc) in rows.items():
        print(f"{name:27} {pf:14.1f} {dc:13.1f}")
    hp = max(rows["transformers fp32"][0], rows["transformers bf16"][0])
    hd = max(rows["transformers fp32"][1], rows["transformers bf16"][1])
    for name in engines:
        op, od = rows[name]
        print(f"{name} vs the faster transformers: prefill x{op / hp:.2f}, decode x{od / hd:.2f}")


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer so the directory loads as a complete model (the benchmark feeds ids)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TEXT["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


if __name__ == "__main__":
    main()
