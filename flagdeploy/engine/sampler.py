"""Next-token choice per row: greedy rows in one argmax, sampled rows with their own generators.

`probs_for` is the one place a request's temperature, top_k and top_p turn logits into the distribution
a token is drawn from; `sample` (one row per sequence) and speculative rejection sampling (`rejection.py`,
1 + k rows per sequence) both go through it and through `draw`, so the two can never disagree on what
"the target distribution" of a request is.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flagdeploy import ops

from .request import SamplingParams
from .sequence import Sequence


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [R, V] (any device; R rows of one request)
    -> normalised probabilities [R, V] float32 on the CPU, where a sequence's generator lives (seeded,
    device-independent draws). Temperature first, then min_p, then top_k (ties with the k-th value stay), then
    top_p over what is left (the token that crosses top_p stays). Row-wise only: a row's result does not depend
    on the other rows. A row masked to nothing comes back non-finite or all zero (`draw` refuses it).

    On the CPU each row is computed with numpy (`_host_probs`), on other devices with torch (below)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.stack([_host_probs(row, params) for row in _host_float32(logits)]))
    return _device_probs(logits, params)


def _device_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`probs_for` on an accelerator, in torch ops: the reference `_host_probs` is tested against."""
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
    generator); None when the row has nothing to draw from (the caller keeps the argmax then).

    By the inverse of the row's cumulative distribution at one uniform draw of the generator, found block by
    block (the block's running sum, then within the block). (torch.multinomial draws one exponential variate
    per vocabulary entry for a single sample: ~1 ms a token for a 49k vocabulary on one core, a fifth of a
    small model's whole decode step; numpy's running sum of the whole row ~0.2 ms.)"""
    p = _host_float32(probs).astype(np.float64)
    if not np.isfinite(p).all():
        return None
    blocks = np.cumsum(np.add.reduceat(p, np.arange(0, len(p), _BLOCK)))
    if not blocks[-1] > 0:
        return None
    target = float(torch.rand((), generator=generator, dtype=torch.float64)) * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    inner = np.cumsum(p[b * _BLOCK:(b + 1) * _BLOCK]) + (blocks[b - 1] if b else 0.0)
    i = b * _BLOCK + int(np.searchsorted(inner, target, side="right"))  # the first entry past it: p > 0 there
    if i < len(p) and p[i] > 0:
        return i
    return int(np.flatnonzero(p[: b * _BLOCK + len(inner)])[-1])  # (the target at the block's end, rounded up)


_BLOCK = 256  # entries of a row a block of `draw` spans


def _floor_of_top(x: np.ndarray, k: int) -> float:
    """A value at most x's k-th largest (at least k entries are >= it), cheaply: the k-th largest of the maxima
    of 4k blocks of x (k of them are k distinct entries). A full partition of a 49k row is ~0.3 ms; this, and
    then selecting among the few entries above it, a fraction of that. x's k-th largest itself where 4k blocks
    would be single entries."""
    if 4 * k >= len(x):
        return float(np.partition(x, len(x) - k)[len(x) - k])
    maxima = np.maximum.reduceat(x, np.arange(0, len(x), -(-len(x) // (4 * k))))
    return float(np.partition(maxima, len(maxima) - k)[len(maxima) - k])


def _kth_largest(x: np.ndarray, k: int) -> float:
    """x's k-th largest entry, partitioning only the entries at or above `_floor_of_top`."""
    above = x[x >= _floor_of_top(x, k)]
    if len(above) < k:  # NaNs (they compare false)
        above = x
    return float(np.partition(above, len(above) - k)[len(above) - k])


def _host_float32(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a float32 array, converted by numpy: torch's conversion of a vocabulary-wide row
    opens an OpenMP region, whose worker then spins on the core the CPU kernels' own threads need (see
    model_runner.take_rows)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:  # bf16 is float32's upper half
        return (t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    a = t.numpy()
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _host_probs(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`probs_for` of one row on the CPU, single-threaded and without sorting the vocabulary: the same
    distribution as the torch path (the same masks; sums in another order). top_k by selecting among the
    entries above a cheap bound; top_p by sorting only the likeliest tokens: every token at least as likely as
    a bound on the 64th (then 512th, ...) likeliest, a run of the descending order that holds the token crossing
    top_p once some token in it is left out. (A stable sort of a 49k vocabulary is ~4 ms on one core.)"""
    with np.errstate(invalid="ignore", over="ignore"):  # a row masked to nothing: NaN, which `draw` refuses
        rows = x / np.float32(params.temperature)
        if params.min_p:
            rows = np.where(rows < rows.max() + np.float32(math.log(params.min_p)), np.float32(-np.inf), rows)
        if params.top_k:
            kth = np.float32(_kth_largest(rows, min(params.top_k, rows.size)))
            rows = np.where(rows < kth, np.float32(-np.inf), rows)
        e = np.exp(rows - rows.max())
        probs = e / e.sum()
        if params.top_p < 1.0:
            likeliest = 64
            while True:
                cut = _floor_of_top(probs, min(likeliest, probs.size))
                # in index order, so that the stable sort breaks ties by index; zeros (masked) never count
                run = np.flatnonzero(probs >= cut) if cut > 0 else np.flatnonzero(probs > 0)
                run = run[np.argsort(-probs[run], kind="stable")]
                sorted_p = probs[run]
                keep = np.cumsum(sorted_p, dtype=np.float64) - sorted_p < params.top_p
                if not keep.all() or not cut > 0 or likeliest >= probs.size:
                    probs = np.zeros_like(probs)
                    probs[run[keep]] = sorted_p[keep]
                    break
                likeliest *= 8
        return probs / probs.sum()


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
