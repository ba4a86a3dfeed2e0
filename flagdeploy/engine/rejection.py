"""Speculative sampling: verify drafts of a sampled request so that what it emits is distributed exactly as
the target model's own samples (Leviathan et al. 2023, Chen et al. 2023).

Per sequence and step the target gives 1 + k rows p_0..p_k (`sampler.probs_for`: temperature, top_k, top_p
exactly as an unspeculated step draws from), p_j the distribution after the sequence's tokens and drafts
d_0..d_{j-1}. Draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
the replacement is drawn from norm(max(p_j - q_j, 0)) and the step ends; when all k are accepted, a bonus
token is drawn from p_k. Each emitted token is then distributed as p given the tokens before it.

Our proposers (prompt lookup, greedy MTP) draft deterministically: q_j is one-hot on d_j. Then the rule
reads: accept with probability p_j(d_j); on rejection draw from p_j with d_j taken out. Drawing x ~ p_j and
accepting iff x == d_j is that rule exactly (P(x = d_j) = p_j(d_j); given x != d_j, x is distributed as p_j
without d_j, renormalised), and it is what `rejection_sample` does when no `q` is given: one draw per
emitted token, from the same rows with the same `sampler.draw` an unspeculated step uses. So a seeded
request's generator is consumed exactly as without speculation, and where the verify rows' logits equal
plain decode rows' (dense weights: docs/speculative.md "Exactness") its output is token for token the same.
A proposer that samples its drafts hands its rows q (`q`, [k, V]) and gets the general rule.
"""

from __future__ import annotations

import torch

from .sampler import draw


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None,
                     q: torch.Tensor | None = None, fallback: list[int] | None = None) -> list[int]:
    """The tokens a speculating sampled sequence emits this step: the accepted drafts, then one more token
    (the replacement of the first rejected draft, or the bonus token after all k): 1..k+1 tokens.

    `probs` [k+1, V]: the target's processed distributions p_0..p_k on the CPU (`sampler.probs_for`);
    `drafts`: d_0..d_{k-1}; `generator`: the sequence's own (None: torch's default CPU generator);
    `q` [k, V]: the draft distributions, None for deterministic drafts (one-hot on d_j);
    `fallback[j]`: the target's argmax at row j, emitted (and compared with d_j) where row j has nothing to
    draw from (masked to nothing, non-finite), as `sampler.sample` keeps the argmax there."""
    k = len(drafts)
    assert probs.shape[0] == k + 1, (probs.shape, k)
    if q is None:
        return _one_hot(probs, drafts, generator, fallback)
    return _general(probs, drafts, q, generator, fallback)


def _one_hot(probs, drafts, generator, fallback) -> list[int]:
    out: list[int] = []
    for j in range(len(drafts) + 1):
        x = draw(probs[j], generator)
        if x is None:
            x = fallback[j] if fallback is not None else int(probs[j].nan_to_num(-1.0).argmax())
        out.append(x)
        if j == len(drafts) or x != drafts[j]:
            break
    return out


def _general(probs, drafts, q, generator, fallback) -> list[int]:
    k = len(drafts)
    q = q.float().cpu()
    q = q / q.sum(-1, keepdim=True)
    pos, d = torch.arange(k), torch.tensor(drafts, dtype=torch.long)
    p_d, q_d = probs[pos, d], q[pos, d]
    # u < min(1, p/q) as u q < p: q(d) = 0 (never for a draft drawn from q) accepts where the target allows it
    accept = (torch.rand(k, generator=generator) * q_d < p_d).tolist()  # one uniform per draft, drawn together
    valid = (torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)).tolist()
    for j in range(k):
        if not valid[j]:  # nothing to draw from: the target is its argmax here (a one-hot p_j)
            target = fallback[j] if fallback is not None else int(probs[j].nan_to_num(-1.0).argmax())
            if drafts[j] == target:
                continue
            return drafts[:j] + [target]
        if accept[j]:
            continue
        x = draw((probs[j] - q[j]).clamp_min(0), generator)
        if x is None:  # p_j == q_j up to rounding: a rejection of probability ~0; p_j is the residual's limit
            x = draw(probs[j], generator)
        return drafts[:j] + [x]
    x = draw(probs[k], generator)
    if x is None:
        x = fallback[k] if fallback is not None else int(probs[k].nan_to_num(-1.0).argmax())
    return drafts + [x]
