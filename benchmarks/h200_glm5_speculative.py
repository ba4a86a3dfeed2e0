"""MTP speculative decoding on the GLM-5.3-Flash 4-layer slice at true dims, one GPU: the verify step and the
draft step against the plain decode step, and the decode rate speculation gives.

    python benchmarks/h200_glm5_speculative.py [--batches 1,8] [--context 256] [--k 3] [--steps 20]
    python benchmarks/h200_glm5_speculative.py --tiny        # the same logic on the CPU at toy size

The slice of benchmarks/h200_glm5_slice.py (3 KDA layers + 1 MLA/DSA layer, all MoE, hidden 4096, random
bf16 weights of the real shapes) with its real-size LM head (154,880 x 4096) and the MTP draft layer (one
MLA + full indexer + MoE block, eh_proj, norms; random too), routed and shared experts in FP8 (128x128
blocks), as the published checkpoint stores them. Everything runs as the engine runs it: the
`SequenceStateRunner` (block pools, 1 + K KDA state rows per sequence, CUDA graphs for the decode step and
for the verify step) and the `MtpProposer` (catch-up over the positions accepted since its last call, then
K - 1 chained draft steps).

Timed per batch size B, after a prefill of --context tokens per sequence (best of a few blocks of steps):
- decode: one plain decode step (B rows), the graphed step the engine replays;
- verify: one verify step of 1 + K rows per sequence (graphed; and eager, for the graphs' gain);
- draft: the proposer's work before a verify step at acceptance length AL (catch-up over AL rows per
  sequence, then K - 1 chained steps), eager.
Then decode tokens/s: plain = B / decode; speculative at acceptance length AL (tokens per verify step,
bonus included; 3 at K = 3 is the published GLM-5 family figure) = AL * B / (verify + draft); their ratio.
Random weights accept nothing, so AL is an input here, not a measurement; the engine's exactness and
acceptance accounting are tests (tests/test_mtp.py, tests/test_speculative_state.py).

The slice has 4 target layers to the MTP layer's one, so the draft weighs far more against a decode step
here than in the published model (45 layers): the last column scales the decode and verify steps by
45 / 4 (LM head included, so a rough figure) and keeps the draft as measured, a projection, not a
measurement.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_glm5_slice import (  # noqa: E402
    LAYERS,
    TINY,
    TRUE,
    build_ours,
    fp8_expert_banks,
    sync,
    use_experts,
)

from flagdeploy import ops  # noqa: E402
from flagdeploy.engine.model_runner import SequenceStateRunner  # noqa: E402
from flagdeploy.engine.mtp import MtpProposer, MtpState  # noqa: E402
from flagdeploy.engine.request import SamplingParams  # noqa: E402
from flagdeploy.engine.scheduler import ScheduledBatch  # noqa: E402
from flagdeploy.engine.sequence import Sequence  # noqa: E402


def best_time(fn, steps: int, blocks: int = 3) -> float:
    """Seconds per call, the best of `blocks` blocks of `steps` calls (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(blocks):
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / steps)
    return best


class Slice:
    """B sequences of --context prompt tokens in a runner with K draft-state rows each, prefilled, the MTP
    layer caught up over the prompts (as the engine has it after the prompts' first tokens)."""

    def __init__(self, model, batch: int, context: int, k: int, graphs: bool, device: str, vocab: int, bs: int = 16):
        self.k, self.batch = k, batch
        max_len = context + 4 * (k + 1) + 8
        per = -(-max_len // bs)
        self.runner = SequenceStateRunner(model, batch * per, bs, device, batch,
                                          {"max_model_len": max_len} if graphs and device == "cuda" else None,
                                          spec_tokens=k)
        self.runner.keep_hidden = True  # what the engine sets for an MTP proposer
        self.proposer = MtpProposer(model)
        self.proposer.bind(self.runner)
        g = torch.Generator().manual_seed(batch)
        self.seqs = []
        for i in range(batch):
            seq = Sequence(f"s{i}", torch.randint(1, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=64, temperature=0), 64)
            seq.block_table = list(range(i * per, (i + 1) * per))
            self.seqs.append(seq)
        logits, _ = self.runner.run(ScheduledBatch(self.seqs, [context] * batch))
        for seq, tok in zip(self.seqs, logits.argmax(-1).tolist()):
            start, hidden = self.runner.last_hidden[seq.seq_id]
            seq.num_computed = context
            seq.token_ids.append(tok)
            self.proposer.observe(seq, start, hidden)
        self.drafts = self.proposer.propose(self.seqs, [k] * batch)  # the prompt's catch-up, untimed
        self.last = {seq.seq_id: self.runner.last_hidden[seq.seq_id][1][-1:] for seq in self.seqs}

    def decode(self) -> None:
        self.runner.run(ScheduledBatch(self.seqs, [1] * self.batch))

    def verify(self) -> None:
        self.runner.run(ScheduledBatch(self.seqs, [1 + self.k] * self.batch, [d[: self.k] for d in self.drafts]))
        self.runner.verified.clear()  # the timed steps never advance: each one starts from the same rows

    def draft(self, accepted: int) -> None:
        """The proposer's work before a verify step after `accepted` tokens were accepted per sequence: a
        catch-up over that many positions, then the chain."""
        for seq in self.seqs:
            st: MtpState = seq.draft_state
            cached = seq.num_tokens - 1 - accepted
            st.cached, st.pending, st.num_pending = cached, [self.last[seq.seq_id].expand(accepted, -1)], accepted
        self.proposer.propose(self.seqs, [self.k] * self.batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--k", type=int, default=3, help="drafts per verify step")
    ap.add_argument("--al", type=float, default=3.0, help="acceptance length assumed (tokens per verify step)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--full-layers", type=int, default=45, help="the whole model's layers, for the projection")
    ap.add_argument("--tiny", action="store_true", help="toy size on the CPU (checks the script)")
    args = ap.parse_args()
    if args.tiny:
        device, text, args.context, args.steps = "cpu", TINY, min(args.context, 24), min(args.steps, 3)
    else:
        device, text = "cuda", TRUE
    ops.use_backend("cuda" if device == "cuda" else "cpu")
    t0 = time.perf_counter()
    model = build_ours(text, torch.bfloat16, device, head=True, mtp=True)
    use_experts(fp8_expert_banks(model), True, {})
    print(f"# {os.path.basename(__file__)}: device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"slice + MTP layer built in {time.perf_counter() - t0:.0f} s; K={args.k}, AL={args.al:g}, "
          f"context {args.context}, FP8 experts")
    accepted = max(int(round(args.al)), 1)
    print("| batch | decode ms | verify ms (graph) | verify ms (eager) | draft ms | verify+draft / decode | "
          f"plain tok/s | MTP tok/s at AL | speedup | speedup projected at {args.full_layers} layers |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        with torch.inference_mode():
            graphed = Slice(model, b, args.context, args.k, True, device, text["vocab_size"])
            t_dec = best_time(graphed.decode, args.steps)
            t_ver = best_time(graphed.verify, args.steps)
            t_draft = best_time(functools.partial(graphed.draft, accepted), args.steps)
            del graphed
            eager = Slice(model, b, args.context, args.k, False, device, text["vocab_size"])
            t_ver_eager = best_time(eager.verify, max(args.steps // 4, 1))
            del eager
        if device == "cuda":
            torch.cuda.empty_cache()
        plain = b / t_dec
        spec = args.al * b / (t_ver + t_draft)
        scale = args.full_layers / LAYERS
        projected = args.al * t_dec * scale / (t_ver * scale + t_draft)
        print(f"| {b} | {t_dec * 1e3:.2f} | {t_ver * 1e3:.2f} | {t_ver_eager * 1e3:.2f} | {t_draft * 1e3:.2f} | "
              f"{(t_ver + t_draft) / t_dec:.2f} | {plain:.0f} | {spec:.0f} | {spec / plain:.2f}x | {projected:.2f}x |")


if __name__ == "__main__":
    main()
