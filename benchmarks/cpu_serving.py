"""Decode speed of the builtin engine against transformers' generate, same GGUF weights, same run.

    python benchmarks/cpu_serving.py [--tokens 64] [--concurrency 16]

Prints tokens/s for one stream and for N concurrent requests, for transformers (float32, as it loads a
GGUF) and for flagdeploy in its serving configuration (weight_format auto: the GGUF's 4-bit weights
stay packed, float32 activations) and in dense float32, with the ratios. Output length is forced
(EOS ignored) so every run decodes the same number of tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Name three prime numbers.", "Tell me a fact about cats.", "Translate 'good morning' to Spanish.",
    "What is 12 times 7?", "Describe a rainbow.", "Why is the sky blue?", "Give me a synonym for happy.",
    "What is the boiling point of water?", "Who wrote Hamlet?", "Say hello in French.", "What is a noun?",
    "Name a planet.", "How many legs does a spider have?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_transformers(path, prompts, tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def gen(batch: list[list[int]]):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding, as generate expects
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    gen([prompts[0]])  # warm-up
    one = tokens / timed(lambda: gen([prompts[0]]))
    many = len(prompts) * tokens / timed(lambda: gen(prompts))
    return {"single": one, "batched": many}


def bench_flagdeploy(path, fmt, prompts, tokens: int, weight_format: str) -> dict[str, float]:
    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.loader import build_llm_engine

    engine = build_llm_engine(path, fmt, EngineConfig(max_model_len=1024, max_num_seqs=len(prompts),
                                                      weight_format=weight_format), chip="cpu", progress=False)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([prompts[0]], params)  # warm-up
    one = tokens / timed(lambda: engine.generate([prompts[0]], params))
    many = len(prompts) * tokens / timed(lambda: engine.generate(prompts, params))
    return {"single": one, "batched": many}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    from flagdeploy.loaders.source import resolve
    from flagdeploy.tokenizer import Tokenizer

    src = resolve(args.model)
    tok = Tokenizer.from_source(src.path, src.format)
    prompts = [chat_ids(tok, PROMPTS[i % len(PROMPTS)]) for i in range(args.concurrency)]
    print(f"model {src.name}, {args.tokens} tokens per request, {args.concurrency} concurrent, "
          f"{torch.get_num_threads()} threads")
    hf = bench_transformers(src.path, prompts, args.tokens)
    rows = [("transformers generate (fp32)", hf)]
    for wf in ("auto", "dense"):
        rows.append((f"flagdeploy weight_format={wf}", bench_flagdeploy(src.path, src.format, prompts, args.tokens, wf)))
    seq = hf["single"]  # transformers serving N requests one after another
    print(f"{'':34} {'1 stream tok/s':>15} {f'{args.concurrency} concurrent tok/s':>22}")
    for name, r in rows:
        print(f"{name:34} {r['single']:15.1f} {r['batched']:22.1f}")
    for name, r in rows[1:]:
        print(f"{name}: single-stream x{r['single'] / hf['single']:.2f} vs transformers; "
              f"{args.concurrency} concurrent x{r['batched'] / hf['batched']:.2f} vs transformers batched generate, "
              f"x{r['batched'] / seq:.2f} vs transformers one request at a time")


if __name__ == "__main__":
    main()
