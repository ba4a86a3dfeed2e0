"""What a conversion did and what it cost: sizes and weight error per tensor, and the model-level check.

The per-tensor error is ||W_converted - W_source||_F / ||W_source||_F against the source's own values
(FP8 dequantised in float32). The model-level check (`--eval-text`) runs the source and the converted
checkpoint in the builtin runtime on the same text: perplexity of each and the mean KL divergence
KL(source || converted) of their next-token distributions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch


def build_report(rows: list[dict], notes: list[str], **meta) -> dict:
    by_scheme: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes_before": 0, "bytes_after": 0, "max_rel_error": 0.0})
    for r in rows:
        s = by_scheme[r["scheme"]]
        s["tensors"] += 1
        s["bytes_before"] += r["bytes_before"]
        s["bytes_after"] += r["bytes_after"]
        s["max_rel_error"] = max(s["max_rel_error"], r["rel_error"])
    before, after = sum(r["bytes_before"] for r in rows), sum(r["bytes_after"] for r in rows)
    totals = {"tensors": len(rows), "bytes_before": before, "bytes_after": after,
              "ratio": after / before if before else 1.0, "max_rel_error": max((r["rel_error"] for r in rows), default=0.0)}
    return {**meta, "notes": notes, "totals": totals, "schemes": dict(by_scheme), "tensors": rows}


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def format_table(report: dict, worst: int = 8) -> str:
    """Per scheme, the totals, the tensors with the largest error, and the model-level check if run."""
    lines = [f"{'scheme':<14}{'tensors':>9}{'before':>14}{'after':>14}{'max rel err':>13}"]
    for name, s in sorted(report["schemes"].items()):
        lines.append(f"{name:<14}{s['tensors']:>9}{_gib(s['bytes_before']):>14}{_gib(s['bytes_after']):>14}"
                     f"{s['max_rel_error']:>13.2e}")
    t = report["totals"]
    lines.append(f"{'total':<14}{t['tensors']:>9}{_gib(t['bytes_before']):>14}{_gib(t['bytes_after']):>14}"
                 f"{t['max_rel_error']:>13.2e}   (size x{t['ratio']:.3f})")
    bad = sorted((r for r in report["tensors"] if r["rel_error"] > 0), key=lambda r: -r["rel_error"])[:worst]
    if bad:
        lines.append("largest errors:")
        lines += [f"  {r['rel_error']:.2e}  {r['scheme']:<13} {r['name']}" for r in bad]
    ev = report.get("eval")
    if ev:
        lines.append(f"eval on {ev['tokens']} tokens: perplexity {ev['perplexity_source']:.4f} -> "
                     f"{ev['perplexity_converted']:.4f} ({ev['perplexity_change']:+.2%}), mean KL {ev['mean_kl']:.3e}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def _logits(path: Path, ids: list[int], window: int) -> torch.Tensor:
    """Next-token logits at every position, in windows of `window` tokens (each window from scratch)."""
    from flagdeploy.engine.replica import load_model

    model, _ = load_model(path, "safetensors", torch.float32, "cpu", progress=False)
    model.prepare(window)
    return torch.cat([model.score(torch.tensor(ids[i:i + window])) for i in range(0, len(ids), window)])


def evaluate(source: Path, converted: Path, text: str, window: int = 512) -> dict:
    """Perplexity of both checkpoints on `text` and mean KL(source || converted) per next token."""
    from flagdeploy.tokenizer import Tokenizer

    ids = Tokenizer.from_source(source, "safetensors").encode(text)
    if len(ids) < 2:
        raise ValueError("the evaluation text must have at least two tokens")
    ref, got = _logits(source, ids, window), _logits(converted, ids, window)
    starts = set(range(0, len(ids), window))  # the last position of a window predicts the next window's first
    keep = torch.tensor([i for i in range(len(ids) - 1) if i + 1 not in starts])
    targets = torch.tensor(ids)[keep + 1]
    lp_ref, lp_got = ref[keep].log_softmax(-1), got[keep].log_softmax(-1)
    nll = lambda lp: float(-lp.gather(1, targets[:, None]).mean())  # noqa: E731
    ppl_ref, ppl_got = math.exp(nll(lp_ref)), math.exp(nll(lp_got))
    kl = float((lp_ref.exp() * (lp_ref - lp_got)).sum(-1).mean())
    return {"tokens": len(keep), "perplexity_source": ppl_ref, "perplexity_converted": ppl_got,
            "perplexity_change": ppl_got / ppl_ref - 1, "mean_kl": kl}
