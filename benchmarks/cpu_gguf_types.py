"""A GGUF of any common quantization type (Q4_K_M, Q5_0, Q8_0, ...) on the cpu backend: how its linears load,
what that costs in accuracy, and the decode step's time, against the same file's weights dequantised to float32.

What users download is mostly Q4_K_M: Q4_K linears with Q6_K among them, and Q5_0 / Q8_0 where a row is not a
multiple of 256 values (llama.cpp's fallbacks). weight_format "auto" keeps Q4_0 / Q4_1 / Q4_K linears 4-bit as
they are and takes the other quantized types as int8 with a scale per group (held in 5 or 6 bits where the values
fit and the kernels' build has vpdpbusd), so that the C++ decode step serves the model; this prints, for the file:
  - its linears' GGUF types and what they became (4-bit, int8, dense), and the bytes a decoded token reads of
    them against the file's own;
  - against the dense float32 model of the same file on a few chat prompts: mean and largest next-token KL, top-1
    agreement, largest relative logit difference (what tests/test_quantized_weights.py bounds for the Q4_1 file);
  - the decode step in-process at 1 and 5 rows (one sequence, 256 tokens of context) and which path serves it
    ("C++ step" or "eager"). Run from an older checkout (PYTHONPATH) for what that version did with the file.

    python benchmarks/cpu_gguf_types.py MODEL.gguf [--threads 2] [--rounds 7] [--ab-bits]

--ab-bits adds the step at 1, 2, 5 and 16 rows with the 5- / 6-bit forms (and a Q6_K head as the file holds it)
against every int8 linear in 8 bits and the head per channel (FLAGDEPLOY_INT8_LOW_BITS=0), both loaded in one
process, rounds interleaved: the ratio of the two.

The bundled SmolLM2-135M's rows are 576 values wide, not a multiple of K-quants' 256: llama.cpp's Q4_K_M of it is
mostly Q5_0. For the mix a larger model's Q4_K_M has (Q4_K, Q6_K among it), write a random one whose rows are
whole super-blocks and have llama.cpp requantize it (random weights: its answers are noise, its speed is not):

    python benchmarks/cpu_gguf_types.py --write-random /tmp/llama-1024.gguf [--hidden 1024 --layers 16 --ffn 2816]
    python benchmarks/cpu_vs_llama_server.py --model /tmp/llama-1024.gguf --quantize Q4_K_M

On a host without the default model (a GPU host's CPU, cut off from the network), a file of its shape and types
(Q4_1 linears, a Q8_0 embedding) with random weights runs its kernels, bytes and steps; `--tokenizer` takes any GGUF
that carries the tokenizer:

    python benchmarks/cpu_gguf_types.py --write-random /tmp/smol.gguf --type Q4_1 --hidden 576 --layers 30 \
        --ffn 1536 --heads 9 --kv-heads 3 [--tokenizer T.gguf]
    python benchmarks/cpu_vs_llama_server.py --model /tmp/smol.gguf; python benchmarks/cpu_few_rows.py --model /tmp/smol.gguf
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from cpu_few_rows import verify_step  # this script runs from benchmarks/
from gguf import GGMLQuantizationType

from flagdeploy.backends.cpu import native
from flagdeploy.checkpoints import gguf_reader
from flagdeploy.checkpoints.source import resolve
from flagdeploy.checkpoints.tiny_gguf import write_llama_gguf
from flagdeploy.engine import EngineConfig
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.models.linear import Linear

PROMPTS = ("Write two sentences about the ocean.", "What is the capital of France?",
           "def fib(n):\n    # return the n-th Fibonacci number\n",
           "Translate to French: The weather is nice today and we are going to the beach.")


def random_weight(rng: np.random.Generator, kind: str, name: str, rows: int, cols: int):
    """A random weight for write_llama_gguf: float16 values, or raw blocks of the bundled file's types (Q4_1 linears:
    fp16 d, fp16 m and 16 bytes of nibbles per 32; a Q8_0 embedding: fp16 d and 32 int8), values within about +-0.05."""
    if kind == "F16":
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16)
    embedding = name == "token_embd.weight"
    blocks = rng.integers(0, 256, (rows, cols // 32, 34 if embedding else 20), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 32, 1), 0.02 / 127 if embedding else 0.05 / 15, np.float16).view(np.uint8)
    if not embedding:
        blocks[..., 2:4] = np.full((rows, cols // 32, 1), -0.025, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1), GGMLQuantizationType.Q8_0 if embedding else GGMLQuantizationType.Q4_1


def engine(path: str, weight_format: str, threads: int):
    torch.set_num_threads(threads)
    return build_llm_engine(Path(path), "gguf", EngineConfig(weight_format=weight_format, max_model_len=1024, max_num_seqs=8),
                            chip="cpu", progress=False)


def step_ms(eng, rows: int, rounds: int) -> tuple[float, str]:
    """Best time of a decode step of `rows` rows of one sequence at 256 tokens of context (a verify step's shape,
    cpu_few_rows.py's), through the runner as the engine runs it, and which step served it."""
    runner = eng.runner
    step = verify_step(rows, 256, runner.block_size, eng.model.cfg.vocab_size)
    path = "C++ step" if runner.native is not None and rows <= runner.native.max_rows else "eager"
    for _ in range(3):
        runner.execute(step)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(5):
            runner.execute(step)
        best = min(best, (time.perf_counter() - t) / 5)
    return best * 1e3, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write-random", type=Path, metavar="OUT", help="write a random llama GGUF with the bundled "
                    "model's tokenizer (or --tokenizer's) to OUT and exit")
    ap.add_argument("--type", choices=("F16", "Q4_1"), default="F16", help="--write-random's linears: F16 (to requantize "
                    "with llama-quantize), or Q4_1 with a Q8_0 embedding, the bundled file's types, written directly")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a GGUF whose tokenizer --write-random copies (default: "
                    "the bundled model's)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ab-bits", action="store_true", help="also time the step with every int8 linear in 8 bits against "
                    "the 5- / 6-bit forms, in one process")
    args = ap.parse_args()
    if args.write_random:
        rng = np.random.default_rng(0)
        write_llama_gguf(args.write_random, args.tokenizer or resolve(None).path, functools.partial(random_weight, rng, args.type),
                         hidden=args.hidden, layers=args.layers, ffn=args.ffn, heads=args.heads, kv_heads=args.kv_heads)
        print(args.write_random)
        return
    if not args.model:
        ap.error("give a GGUF file (or --write-random OUT)")

    reader = gguf_reader.open_gguf(Path(args.model))
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    types = collections.Counter(t.tensor_type.name for t in linears)
    file_bytes = sum(t.data.nbytes for t in [*linears, gguf_reader.head_tensor(reader)])  # a tied head counts once
    auto = engine(args.model, "auto", args.threads)
    kinds, held = collections.Counter(), 0
    for m in auto.model.modules():
        if isinstance(m, Linear):
            if m.qweight is None:
                kinds["dense"] += m.out_features * m.in_features
            for q in m.bundles():
                kinds[type(q).__name__] += q.out_features * q.in_features
            held += linear_bytes(m)
    total = sum(kinds.values())
    print(f"{args.model}: linears' GGUF types {dict(types)}")
    print("loaded as (share of weights): " + ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.items()))
    print(f"a decoded token reads {held / 1e6:.1f} MB of linears and head (the file's: {file_bytes / 1e6:.1f} MB, "
          f"{held / file_bytes:.2f}x)")

    dense = engine(args.model, "dense", args.threads)
    tok = auto.tokenizer
    kl, agree, rel, n = [], 0, 0.0, 0
    for text in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        with torch.inference_mode():  # every position's logits through a scratch cache
            a, b = (e.model.score(torch.tensor(ids)) for e in (dense, auto))
        kl.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += len(ids)
        rel = max(rel, ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item())
    kls = torch.cat(kl)
    print(f"against dense float32, {n} positions: mean KL {kls.mean():.5f}, max KL {kls.max():.4f}, "
          f"top-1 agreement {agree / n:.3f}, largest relative logit difference {rel:.4f}")

    del dense
    for rows in (1, 5):
        ms, path = step_ms(auto, rows, args.rounds)
        print(f"decode step, {rows} row{'s' if rows > 1 else ''}: {ms:.2f} ms ({path}; best of {args.rounds}, {args.threads} threads)")
    if args.ab_bits:
        ab_bits(args.model, auto, args.threads, args.rounds)


def ab_bits(path: str, low, threads: int, rounds: int) -> None:
    """The decode step with the int8 linears that fit 5 or 6 bits held in those (`low`, as loaded) against the same
    file with every int8 linear in 8 bits (FLAGDEPLOY_INT8_LOW_BITS=0, the head then per channel), in one process,
    rounds interleaved (the order flipping each round)."""
    if not native.holds_low_bits():
        print("--ab-bits: this build holds every int8 weight in 8 bits already (no vpdpbusd, or FLAGDEPLOY_INT8_LOW_BITS=0)")
        return
    os.environ["FLAGDEPLOY_INT8_LOW_BITS"] = "0"
    try:
        eight = engine(path, "auto", threads)
    finally:
        del os.environ["FLAGDEPLOY_INT8_LOW_BITS"]
    for rows in (1, 2, 5, 16):
        steps = {}
        for name, eng in (("8 bits", eight), ("fewest bits", low)):
            st = verify_step(rows, 256, eng.runner.block_size, eng.model.cfg.vocab_size)
            steps[name] = (eng.runner, st)
            for _ in range(3):
                eng.runner.execute(st)
        times = {name: [] for name in steps}
        for r in range(2 * rounds):
            for name in list(steps)[:: 1 if r % 2 else -1]:
                runner, st = steps[name]
                t = time.perf_counter()
                for _ in range(5):
                    runner.execute(st)
                times[name].append((time.perf_counter() - t) / 5 * 1e3)
        a, b = (statistics.median(times[name]) for name in steps)
        print(f"{rows:>2} rows: 8 bits {a:.2f} ms, fewest bits {b:.2f} ms: {b / a:.3f}x")


if __name__ == "__main__":
    main()
