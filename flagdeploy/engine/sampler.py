"""Next-token choice per row: greedy rows in one argmax, sampled rows with their own generators.

The ops `sample_probs` and `draw` are the one place a request's temperature, min_p, top_k and top_p turn logits
into the distribution a token is drawn from, and a uniform of the sequence's generator into a token; `sample`
(one row per sequence) and speculative rejection sampling (`rejection.py`, 1 + k rows per sequence, through
`probs_for` and `draw` here) both go through them, so the two can never disagree on what "the target
distribution" of a request is.
"""

from __future__ import annotations

import torch

from flagdeploy import ops

from .model_runner import take_rows
from .request import SamplingParams
from .sequence import Sequence


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [R, V] (any device; R rows of one request)
    -> normalised probabilities [R, V] float32 on the CPU, where a sequence's generator lives (seeded,
    device-independent draws). Temperature first, then min_p, then top_k (ties with the k-th value stay), then
    top_p over what is left (the token that crosses top_p stays): the op `sample_probs` (its reference says
    exactly; the CPU backend's kernel selects without sorting the vocabulary). Row-wise only: a row's result
    does not depend on the other rows. A row masked to nothing comes back NaN (`draw` refuses it)."""
    return ops.sample_probs(logits, *row_settings([params] * logits.shape[0], logits.device)).float().cpu()


def row_settings(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rows' temperature, top_k, top_p and min_p as the op `sample_probs` takes them, one entry a row."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    return (f32([p.temperature for p in params]), torch.tensor([p.top_k for p in params], device=device),
            f32([p.top_p for p in params]), f32([p.min_p for p in params]))


def uniform(generator: torch.Generator | None) -> float:
    """One draw's uniform from the sequence's generator (None: torch's default CPU generator)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


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
    generator); None when the row has nothing to draw from (the caller keeps the argmax then). By the inverse
    of the row's cumulative distribution at one uniform of the generator (the op `draw`), where
    torch.multinomial draws an exponential variate per vocabulary entry for one sample (~1 ms a token for a 49k
    vocabulary on one core)."""
    u = torch.tensor([uniform(generator)], dtype=torch.float64, device=probs.device)
    token = int(ops.draw(probs.reshape(1, -1), u)[0])
    return token if token >= 0 else None


def sample(logits: torch.Tensor, seqs: list[Sequence], skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """logits [S, V] float32, one row per sequence that needs a token this step. Rows in `skip` get their
    token elsewhere (a sampled sequence that speculates: `rejection.py` draws it from its verify rows);
    they get the argmax here and never touch their generator. The sampled rows go through `sample_probs` and
    `draw` together (on the CPU: the kernels' threads, rows in parallel), each with its own generator."""
    out = ops.argmax(logits).tolist()
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy and i not in skip]
    if rows:
        probs = ops.sample_probs(take_rows(logits, rows), *row_settings([seqs[i].params for i in rows], logits.device))
        u = torch.tensor([uniform(seqs[i].generator) for i in rows], dtype=torch.float64, device=probs.device)
        for i, token in zip(rows, ops.draw(probs, u).tolist()):
            if token >= 0:  # nothing to draw from (a row masked to nothing): keep the argmax, fail no one
                out[i] = token
    return out
