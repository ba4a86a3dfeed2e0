"""Next-token choice per row: greedy rows in one argmax, sampled rows with their own generators.

`probs_for` is the one place a request's temperature, top_k and top_p turn logits into the distribution
a token is drawn from; `sample` (one row per sequence) and speculative rejection sampling (`rejection.py`,
1 + k rows per sequence) both go through it and through `draw`, so the two can never disagree on what
"the target distribution" of a request is.
"""

from __future__ import annotations

import math

import torch

from flagdeploy import ops

from .request import SamplingParams
from .sequence import Sequence


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [R, V] (any device; R rows of one request)
    -> normalised probabilities [R, V] float32 on the CPU, where a sequence's generator lives (seeded,
    device-independent draws). Temperature first, then min_p, then top_k (ties with the k-th value stay), then
    top_p over what is left (the token that crosses top_p stays). Row-wise only: a row's result does not depend
    on the other rows. A row masked to nothing comes back non-finite or all zero (`draw` refuses it)."""
    rows = logits.float() / params.temperature
    if params.min_p:  # relative to the most likely token, after temperature (vLLM's order)
        top = rows.max(-1, keepdim=True).values
        rows = rows.masked_fill(rows < top + math.log(params.min_p), float("-inf"))
    if params.top_k:
        kth = torch.topk(rows, min(params.top_k, rows.shape[-1]), dim=-1).values[..., -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    probs = rows.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(~keep, 0.0))
    probs = probs.cpu()
    return probs / probs.sum(-1, keepdim=True)


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The rows of requests with penalties or a logit_bias, changed as vLLM changes them (greedy rows too):
    repetition_penalty over the prompt's and output's tokens, then frequency and presence penalties over the
    output's, then logit_bias. Other rows (and the tensor itself, when none has any) are left as they are.
    Row i is sequence i's next token, so its history is the sequence's tokens so far."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        seq, p = seqs[i], seqs[i].params
        row = logits[i].float()
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(seq.token_ids, device=row.device).clamp(max=vocab - 1)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=row.device, dtype=row.dtype)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            row = row.index_add(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype))
        logits[i] = row.to(logits.dtype)
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """One token from a row of `probs_for` with the sequence's generator (None: torch's default CPU
    generator); None when the row has nothing to draw from (the caller keeps the argmax then)."""
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return None
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, seqs: list[Sequence], skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """logits [S, V] float32, one row per sequence that needs a token this step. Rows in `skip` get their
    token elsewhere (a sampled sequence that speculates: `rejection.py` draws it from its verify rows);
    they get the argmax here and never touch their generator."""
    out = ops.argmax(logits).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy or i in skip:
            continue
        tok = draw(probs_for(logits[i : i + 1], p)[0], seq.generator)
        if tok is not None:  # nothing to draw from (a row masked to nothing): keep the argmax, fail no one
            out[i] = tok
    return out
