"""bf16 decode error of the GLM-5.3-Flash slice over many decode tokens, ours against transformers' own,
with and without speculation: both measured from one float32 reference in the same run.

    python benchmarks/h200_glm5_accuracy.py [--seeds 0,1,2] [--prompt 64] [--steps 64] [--k 3]
    python benchmarks/h200_glm5_accuracy.py --tiny        # the same logic on the CPU at toy size

The slice of benchmarks/h200_glm5_slice.py (3 KDA layers + 1 MLA/DSA layer, all MoE, true dims, random
weights drawn per seed; no LM head: every path returns the final normed hidden states). Per seed, two
sequences of --prompt tokens, then --steps decode tokens, teacher-forced (the same random token stream
fed to every path, so the paths differ only in their arithmetic, never in what they were fed):

- reference: transformers' `Glm5NextTextModel` in float32 with its own cache;
- `ours fp32` / `ours fp32 verify`: our engine's runner in float32, plain and verify steps (checks the
  driver: must be ~1e-4 or better);
- `transformers bf16`: the same weights rounded to bf16, transformers' forward (its own error);
- `ours packed`: `forward_packed` with per-sequence caches (prefill path ops);
- `ours eager` / `ours graph`: the engine's runner, `forward_decode` eagerly / replayed as a CUDA graph
  (what `flagdeploy serve` runs);
- `ours ref ops`: the eager runner with every CUDA override on the decode path on its plain-torch
  reference (separates the kernels' arithmetic from the model's);
- `ours verify`: the runner's verify steps with K drafts per step (graphed), drafts taken from the stream
  and spoiled at a cycling position so every acceptance length 0..K occurs: the rows of accepted tokens
  are the outputs compared, the state rows they continue from are the ones the engine would pick.

Error per decode position = |out - ref| / |ref| over the hidden vector (relative RMS), reported as the
mean over positions and sequences, at a few positions, and the worst; the acceptance line: ours within
1.5x of transformers' bf16 error (issue 29).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_glm5_slice import (  # noqa: E402
    TINY,
    TRUE,
    Ours,
    Theirs,
    build_ours,
    build_theirs,
    sync,
    with_reference,
)

from flagdeploy import ops  # noqa: E402
from flagdeploy.engine.model_runner import SequenceStateRunner  # noqa: E402
from flagdeploy.engine.request import SamplingParams  # noqa: E402
from flagdeploy.engine.scheduler import ScheduledBatch  # noqa: E402
from flagdeploy.engine.sequence import Sequence  # noqa: E402
from flagdeploy.ops import registry  # noqa: E402

BATCH = 2
FLIP = 0.1  # a position this far off has an expert choice (or indexer pick) that differs from the reference's


def token_stream(seed: int, length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, vocab, (BATCH, length), generator=g)


def through_model(runner, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """`Ours` / `Theirs`: prefill then one teacher-forced step per token; [B, steps, H] float32 on the CPU."""
    device = next(iter(runner.model.parameters())).device
    with torch.inference_mode():
        runner.prefill(ids[:, :prompt].to(device))
        outs = [runner.step(ids[:, t: t + 1].to(device)).float().cpu() for t in range(prompt, ids.shape[1])]
    return torch.cat(outs, dim=1)


class Driven:
    """Our engine's runner (block pools, state rows, CUDA graphs when asked) fed the stream as the engine
    feeds it: one prefill step, then decode steps, or verify steps of 1 + K rows per sequence."""

    def __init__(self, model, ids: torch.Tensor, prompt: int, graphs: bool, k: int, device: str, bs: int = 16):
        self.ids, self.prompt, self.k = ids, prompt, k
        length = ids.shape[1] + k + 1
        per = -(-length // bs)
        self.runner = SequenceStateRunner(model, BATCH * per, bs, device, BATCH,
                                          {"max_model_len": length} if graphs and device == "cuda" else None,
                                          spec_tokens=k)
        self.seqs = []
        for i in range(BATCH):
            seq = Sequence(f"s{i}", ids[i, :prompt].tolist(), SamplingParams(max_tokens=8, temperature=0), 8)
            seq.block_table = list(range(i * per, (i + 1) * per))
            self.seqs.append(seq)
        with torch.inference_mode():
            self.runner.run(ScheduledBatch(self.seqs, [prompt] * BATCH))
        self.out = torch.zeros(BATCH, ids.shape[1] - prompt, model.cfg.hidden_size)
        for i, seq in enumerate(self.seqs):
            seq.num_computed = prompt
            seq.token_ids.append(int(ids[i, prompt]))

    def _keep(self, i: int, first: int, rows: torch.Tensor) -> None:
        self.out[i, first - self.prompt: first - self.prompt + rows.shape[0]] = rows.float().cpu()

    def _advance(self, seq, n: int) -> None:
        i, total = self.seqs.index(seq), self.ids.shape[1]
        seq.num_computed += n
        seq.token_ids.extend(int(t) for t in self.ids[i, seq.num_tokens: seq.num_computed + 1])
        assert seq.num_tokens == min(seq.num_computed + 1, total), (i, seq.num_tokens)

    def plain(self) -> torch.Tensor:
        with torch.inference_mode():
            while self.seqs[0].num_computed < self.ids.shape[1]:
                out, _ = self.runner.run(ScheduledBatch(self.seqs, [1] * BATCH))
                for i, seq in enumerate(self.seqs):
                    self._keep(i, seq.num_computed, out[i: i + 1])
                    self._advance(seq, 1)
        return self.out

    def speculative(self) -> tuple[torch.Tensor, dict[int, int]]:
        """Verify steps until every position is computed; sequence i's step s accepts (s + i) % (K + 1)
        drafts (the one after them spoiled), fewer near the stream's end. Returns the outputs and how
        often each acceptance length occurred."""
        total, step, seen = self.ids.shape[1], 0, {}
        with torch.inference_mode():
            while any(seq.num_computed < total for seq in self.seqs):
                live = [s for s in self.seqs if s.num_computed < total]
                drafts, accept = [], []
                for seq in live:
                    i, c = self.seqs.index(seq), seq.num_computed
                    k = min(self.k, total - 1 - c)  # drafts must be stream tokens that exist
                    a = min((step + i) % (self.k + 1), k)
                    d = self.ids[i, c + 1: c + 1 + k].tolist()
                    if a < k:
                        d[a] = d[a] % (self.ids.max().item()) + 1  # a wrong token: rejected at row a
                    drafts.append(d)
                    accept.append(a)
                    seen[a] = seen.get(a, 0) + 1
                out, _ = self.runner.run(ScheduledBatch(live, [1 + len(d) for d in drafts], drafts))
                at = 0
                for seq, d, a in zip(live, drafts, accept):
                    self._keep(self.seqs.index(seq), seq.num_computed, out[at: at + a + 1])
                    at += 1 + len(d)
                    self._advance(seq, a + 1)  # a drafts and the bonus token (the stream's, teacher-forced)
                step += 1
        return self.out, seen


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[B, steps] relative RMS error of each position's hidden vector."""
    return (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)


def summary(err: torch.Tensor, marks: list[int]) -> str:
    at = " ".join(f"{err[:, m - 1].mean():.3f}" for m in marks if m <= err.shape[1])
    return (f"mean {err.mean():.3f}  median {err.median():.3f}  over {FLIP:g} {(err > FLIP).float().mean():.0%}  "
            f"at {at}  worst {err.max():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64, help="decode tokens per sequence")
    ap.add_argument("--k", type=int, default=3, help="drafts per verify step")
    ap.add_argument("--tiny", action="store_true", help="toy size on the CPU (checks the script)")
    args = ap.parse_args()
    if args.tiny:
        device, text = "cpu", TINY
        args.prompt, args.steps = min(args.prompt, 12), min(args.steps, 12)
    else:
        device, text = "cuda", TRUE
    ops.use_backend("cuda" if device == "cuda" else "cpu")
    vocab, marks = text["vocab_size"], [1, 2, 8, 16, 32, 64]
    t0 = time.perf_counter()
    rows: dict[str, list[torch.Tensor]] = {}
    seen_all: dict[int, int] = {}

    def record(name: str, err: torch.Tensor, seed: int) -> None:
        rows.setdefault(name, []).append(err)
        print(f"seed {seed} {name:<18} {summary(err, marks)}", flush=True)

    for seed in (int(s) for s in args.seeds.split(",")):
        ids = token_stream(seed, args.prompt + args.steps, vocab)
        model = build_ours(text, torch.float32, device, seed=seed)
        ref = through_model(Theirs(build_theirs(model, text, device)), ids, args.prompt)
        record("ours fp32 (check)", rel_err(Driven(model, ids, args.prompt, False, 0, device).plain(), ref), seed)
        out, _ = Driven(model, ids, args.prompt, False, args.k, device).speculative()  # (fp32 experts: not graphable)
        record("ours fp32 verify", rel_err(out, ref), seed)
        del model
        gc.collect()
        sync()
        if device == "cuda":
            torch.cuda.empty_cache()
        model = build_ours(text, torch.bfloat16, device, seed=seed)
        record("transformers bf16", rel_err(through_model(Theirs(build_theirs(model, text, device)), ids, args.prompt),
                                            ref), seed)
        record("ours packed", rel_err(through_model(Ours(model), ids, args.prompt), ref), seed)
        record("ours eager", rel_err(Driven(model, ids, args.prompt, False, 0, device).plain(), ref), seed)
        with with_reference(sorted(registry._active)):  # every op on its plain-torch reference
            record("ours ref ops", rel_err(Driven(model, ids, args.prompt, False, 0, device).plain(), ref), seed)
        record("ours graph", rel_err(Driven(model, ids, args.prompt, True, 0, device).plain(), ref), seed)
        out, seen = Driven(model, ids, args.prompt, True, args.k, device).speculative()
        record(f"ours verify K={args.k}", rel_err(out, ref), seed)
        for a, n in seen.items():
            seen_all[a] = seen_all.get(a, 0) + n
        del model, out
        gc.collect()
        sync()
        if device == "cuda":
            torch.cuda.empty_cache()

    import transformers
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{name}  torch {torch.__version__}  transformers {transformers.__version__}  ({time.perf_counter() - t0:.0f} s)")
    print(f"rel RMS error of the final hidden states from transformers' float32, {args.prompt}-token prompts x {BATCH} "
          f"sequences, {args.steps} teacher-forced decode tokens, seeds {args.seeds}; verify steps: acceptance "
          f"lengths seen {dict(sorted(seen_all.items()))}")
    print(f"| path | mean | median | positions > {FLIP:g} | {' | '.join(f'pos {m}' for m in marks if m <= args.steps)} "
          "| worst | mean / transformers bf16 | median / transformers bf16 |")
    print("|---|---:|---:|---:|" + "---:|" * len([m for m in marks if m <= args.steps]) + "---:|---:|---:|")
    base = torch.stack(rows["transformers bf16"])
    for path, errs in rows.items():
        e = torch.stack(errs)  # [seeds, B, steps]
        at = " | ".join(f"{e[:, :, m - 1].mean():.3f}" for m in marks if m <= args.steps)
        print(f"| {path} | {e.mean():.4f} | {e.median():.4f} | {(e > FLIP).float().mean():.0%} | {at} | {e.max():.3f} "
              f"| {e.mean() / base.mean():.2f} | {e.median() / base.median():.2f} |")


if __name__ == "__main__":
    main()
