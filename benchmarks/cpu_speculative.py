"""Speculative decoding with prompt-lookup (ngram) drafts on the CPU: the default model (SmolLM2-135M GGUF,
int4 packed kernels), one stream, an editing workload whose answer mostly repeats the prompt. Speculation off
and on run in the same process, alternating rounds (the machine's load hits both alike); prints output
tokens/s of each, the ratio, the acceptance length (1 + accepted / drafts, vLLM's definition) and whether the
texts are identical (they must be: greedy verification is exact).

    python benchmarks/cpu_speculative.py [--k 4] [--max-tokens 160] [--rounds 3] [--threads 1] [--q8-activations]

FLAGDEPLOY_CPU_ISA=avx2 measures the AVX2 kernels on an AVX-512 CPU (the header says so).
(`--threads 1` on a machine shared with other jobs: two OpenMP threads on two busy cores wait on each other
and make every step 5-30x slower, for both modes but not alike.)
"""

from __future__ import annotations

import argparse
import time

import torch

from flagdeploy.backends.cpu import native
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.engine.speculative import SpeculativeConfig
from flagdeploy.checkpoints.source import resolve

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five "
    "books at a time for two weeks. Children under twelve must be accompanied by an adult. The reading room on "
    "the second floor is quiet, and phones must be switched off there. Wifi is free for all members, and the "
    "password is printed on the back of every library card. Late returns cost ten cents per day per book."
)
TYPO = PARAGRAPH.replace("accompanied", "acompanied")
PROMPT = f"Repeat this paragraph exactly, fixing the typo:\n\n{TYPO}"


def engine(spec: SpeculativeConfig, q8_activations: bool = False):
    src = resolve(None)
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory=256 << 20,
                       speculative=spec, q8_activations=q8_activations)
    return build_llm_engine(src.path, src.format, cfg, chip="cpu", progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--q8-activations", action="store_true", help="as serve --q8-activations (one int8 activation part)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    off = engine(SpeculativeConfig(), args.q8_activations)
    on = engine(SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=args.min,
                                  prompt_lookup_max=args.max), args.q8_activations)
    tok = off.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    warm = SamplingParams(max_tokens=8, temperature=0)
    for e in (off, on):
        e.generate([ids], warm)  # load the kernels, fill nothing that matters (the prompt's blocks are cached
        # in both engines alike, so every timed round below starts from the same prefix-cache state)
    times = {"off": [], "ngram": []}
    outs = {}
    before = on.stats()
    for _ in range(args.rounds):
        for name, e in (("off", off), ("ngram", on)):
            t = time.perf_counter()
            out = e.generate([ids], params)[0]
            times[name].append(time.perf_counter() - t)
            outs.setdefault(name, out)
            assert out == outs[name], f"{name}: output changed between rounds"
    after = on.stats()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    draft_tokens = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    n = len(outs["off"])
    tps = {k: n * len(v) / sum(v) for k, v in times.items()}
    best = {k: n / min(v) for k, v in times.items()}
    same = outs["off"] == outs["ngram"]
    print(f"CPU ISA class {native.isa_class()}; prompt {len(ids)} tokens, output {n} tokens, K={args.k}, n-gram "
          f"{args.min}..{args.max}, {args.rounds} alternating rounds, {torch.get_num_threads()} thread(s)"
          f"{', --q8-activations' if args.q8_activations else ''}")
    print(f"{'mode':8} {'tok/s (mean)':>13} {'tok/s (best)':>13}")
    for k in times:
        print(f"{k:8} {tps[k]:13.1f} {best[k]:13.1f}")
    print(f"speedup: {tps['ngram'] / tps['off']:.2f}x (mean), {best['ngram'] / best['off']:.2f}x (best round)")
    if drafts:
        print(f"acceptance length {1 + accepted / drafts:.2f} (drafts {drafts}, draft tokens {draft_tokens}, "
              f"accepted {accepted}, rate {accepted / max(draft_tokens, 1):.2f}; per position {per_pos}); "
              f"steps per output token {drafts / max(n * args.rounds, 1):.2f} speculated")
    print(f"identical text: {same}")
    print("output:", repr(tok.decode(outs["ngram"])[:300]))
    if not same:
        raise SystemExit("speculation changed the output")


if __name__ == "__main__":
    main()
