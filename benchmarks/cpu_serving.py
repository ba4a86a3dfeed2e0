"""Decode speed of the builtin engine against transformers' generate, same GGUF weights, same run.

    python benchmarks/cpu_serving.py [--tokens 64] [--concurrency 16]

Prints tokens/s for one stream and for N concurrent requests, for transformers (float32, as it loads a
GGUF) and for flagdeploy in its serving configuration (weight_format auto: the GGUF's 4-bit weights
stay packed, 16-bit activations), the same with its decode step compiled (`--compile`), and in dense
float32, with the ratios. Output length is forced (EOS ignored) so every run decodes the same number of
tokens. Each figure is the best of 3 runs (2 for the concurrent ones), transformers' alike.

It also prints the memory-bandwidth ceiling of a decode step: every weight is read once per step, so one
stream cannot decode faster than (streaming read bandwidth) / (bytes of weights), both measured here.
"""

from __future__ import annotations

import argparse
import time

import torch

SINGLE_REPEATS, BATCH_REPEATS = 3, 2  # each figure is the best of this many runs, for every engine alike

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Name three prime numbers.", "Tell me a fact about cats.", "Translate 'good morning' to Spanish.",
    "What is 12 times 7?", "Describe a rainbow.", "Why is the sky blue?", "Give me a synonym for happy.",
    "What is the boiling point of water?", "Who wrote Hamlet?", "Say hello in French.", "What is a noun?",
    "Name a planet.", "How many legs does a spider have?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def timed(fn, repeats: int = 1) -> float:
    """Seconds of the fastest of `repeats` calls (every engine, transformers' too, gets the same repeats)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


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
    one = tokens / timed(lambda: gen([prompts[0]]), SINGLE_REPEATS)
    many = len(prompts) * tokens / timed(lambda: gen(prompts), BATCH_REPEATS)
    embed = model.get_input_embeddings().weight  # one row of it per token, unless it is the (tied) head too
    skip = None if model.get_output_embeddings().weight is embed else embed
    return {"single": one, "batched": many, "weight_bytes": sum(p.nbytes for p in model.parameters() if p is not skip)}


def bench_flagdeploy(path, fmt, prompts, tokens: int, weight_format: str, compile: bool = False) -> dict[str, float]:
    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    engine = build_llm_engine(path, fmt, EngineConfig(max_model_len=1024, max_num_seqs=len(prompts),
                                                      weight_format=weight_format, compile=compile),
                              chip="cpu", progress=False)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([prompts[0]], params)  # warm-up
    one = tokens / timed(lambda: engine.generate([prompts[0]], params), SINGLE_REPEATS)
    many = len(prompts) * tokens / timed(lambda: engine.generate(prompts, params), BATCH_REPEATS)
    return {"single": one, "batched": many, "weight_bytes": weight_bytes(engine.model)}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every linear's weight in the form its 1-row kernel reads
    (the packed 4-bit / int8 tensors and their scales), every other parameter except the embedding table
    (one row of it per token)."""
    from flagdeploy.models.linear import Linear

    total = sum(linear_bytes(m) for m in model.modules() if isinstance(m, Linear))
    embed = getattr(model, "embed_tokens", None)
    total += sum(p.nbytes for p in model.parameters() if p is not embed)
    return total


def linear_bytes(m) -> int:
    """Bytes one decode row reads of Linear `m`: a dense weight, or its bundles' tensors as the few-row kernels
    hold them (without the bf16 copy kept for many rows)."""
    total = m.weight.nbytes if m.qweight is None else 0
    for b in m.bundles():
        p = b.prepared if isinstance(b.prepared, dict) else {"q": b.q, "scales": b.scales}
        total += sum(v.nbytes for k, v in p.items() if isinstance(v, torch.Tensor) and k != "dense")
    return total


def read_bandwidth(mb: int = 512) -> float:
    """Streaming read bytes/s of a buffer far larger than the caches (what a decode step's weights see)."""
    x = torch.ones(mb << 18)
    x.sum()
    return x.nbytes / timed(x.sum, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    from flagdeploy.checkpoints.source import resolve
    from flagdeploy.tokenizer import Tokenizer

    src = resolve(args.model)
    tok = Tokenizer.from_source(src.path, src.format)
    prompts = [chat_ids(tok, PROMPTS[i % len(PROMPTS)]) for i in range(args.concurrency)]
    print(f"model {src.name}, {args.tokens} tokens per request, {args.concurrency} concurrent, "
          f"{torch.get_num_threads()} threads")
    hf = bench_transformers(src.path, prompts, args.tokens)
    rows = [("transformers generate (fp32)", hf)]
    for name, wf, compiled in (("auto", "auto", False), ("auto --compile", "auto", True), ("dense", "dense", False)):
        rows.append((f"flagdeploy weight_format={name}",
                     bench_flagdeploy(src.path, src.format, prompts, args.tokens, wf, compiled)))
    seq = hf["single"]  # transformers serving N requests one after another
    print(f"{'':34} {'1 stream tok/s':>15} {f'{args.concurrency} concurrent tok/s':>22}")
    for name, r in rows:
        print(f"{name:34} {r['single']:15.1f} {r['batched']:22.1f}")
    for name, r in rows[1:]:
        print(f"{name}: single-stream x{r['single'] / hf['single']:.2f} vs transformers; "
              f"{args.concurrency} concurrent x{r['batched'] / hf['batched']:.2f} vs transformers batched generate, "
              f"x{r['batched'] / seq:.2f} vs transformers one request at a time")
    bw = read_bandwidth()
    print(f"streaming read bandwidth {bw / 1e9:.1f} GB/s; transformers reads {hf['weight_bytes'] / 1e6:.0f} MB of "
          f"weights per token ({hf['single'] * hf['weight_bytes'] / 1e9:.1f} GB/s at its single-stream rate)")
    for name, r in rows[1:]:
        ceiling = bw / r["weight_bytes"]
        print(f"{name}: {r['weight_bytes'] / 1e6:.0f} MB of weights per step -> one stream at most {ceiling:.0f} tok/s "
              f"= x{ceiling / hf['single']:.2f} transformers (measured: {r['single'] / ceiling:.0%} of that ceiling)")


if __name__ == "__main__":
    main()
