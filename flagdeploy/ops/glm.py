"""Hot ops of GLM-5.3-Flash (`glm5_next`): MoE routing and experts, KDA linear attention, its short
convolution and gated norm, hyper-connection mixing, the DSA kpool indexer and sparse attention.

Importing this module declares the ops in the registry (so the op tests and every backend see them);
models call the module-level functions below (`glm_ops.moe_router(...)`), each a registry dispatch.

Conventions, shared with `flagdeploy.ops.reference`: one sequence per call where an op is sequential
(T tokens of it), plain torch written for clarity, internal maths in at least float32 (float64 stays
float64 so the specification itself can be checked), every output in the dtype of the main input.
Outputs are float tensors only: selections are returned as dense 0/1 masks or dense routing weights
rather than index tensors, which keeps every op checkable by the generic float64 comparison.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from . import registry as _registry
from .reference import _TOL, _randn, linear_fp8_block, linear_w8a16, linear_w8a8_dynamic
from .weights import Fp8BlockWeight, Int8Weight, W8A8Weight
from .registry import OpSpec, Tolerance, register_op


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation type: float32 for 16-bit inputs, float64 kept (the spec check runs in it)."""
    return torch.promote_types(dtype, torch.float32)


# ---- MoE ----------------------------------------------------------------------------------------------


def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """Sigmoid router with DeepSeek-V3 group-limited selection; dense routing weights [T, E].

    The correction bias only steers *which* experts win (load balancing); the weights themselves come
    from the unbiased sigmoid scores. Groups are ranked by the sum of their two best biased scores.
    The result is dense (zero for unselected experts) so that it is a plain float output.
    """
    acc = _acc(x.dtype)
    num_experts = weight.shape[0]
    scores = (x.to(acc) @ weight.to(acc).t()).sigmoid()
    biased = scores + correction_bias.to(acc)
    per_group = biased.view(-1, n_group, num_experts // n_group)
    group_rank = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    keep_groups = group_rank.topk(topk_group, dim=-1).indices
    group_ok = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, keep_groups, True)
    expert_ok = group_ok.repeat_interleave(num_experts // n_group, dim=1)
    chosen = biased.masked_fill(~expert_ok, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, chosen)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * routed_scaling_factor
    return torch.zeros_like(scores).scatter_(1, chosen, w).to(x.dtype)


# The linear each kind of quantized expert bank runs (integer arithmetic for W8A8, as the chip does it).
_EXPERT_LINEAR = {Int8Weight: linear_w8a16, W8A8Weight: linear_w8a8_dynamic, Fp8BlockWeight: linear_fp8_block}


def _expert_linear(x: torch.Tensor, w, e: int) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return (x.to(w.dtype) @ w[e].t()).to(x.dtype)
    return _EXPERT_LINEAR[type(w)](x, w.expert(e))


def moe_experts(
    x: torch.Tensor, routing: torch.Tensor, gate_up, down, limit: float | None, top_k: int | None = None
) -> torch.Tensor:
    """Routed experts: sum over e of routing[:, e] * down_e(swiglu(gate_up_e x)), clamped SwiGLU.

    gate_up [E, 2I, H] (gate rows first, then up), down [E, H, I]: the fused layout transformers
    keeps; either may be a quantized bank (Int8Weight / W8A8Weight / Fp8BlockWeight with q [E, N, K]), in
    which case each expert runs that scheme's linear (W8A8 and FP8 quantise the SwiGLU output again
    before down), or a dense bank narrower than x (bfloat16 experts in a float32 run), whose matmuls take
    their inputs rounded to its dtype and give x's dtype back.
    Only experts that some token picked are computed. `top_k`, when given, promises at most that many
    nonzero weights per row (the router's k): a backend may size its dispatch by it instead of reading
    the routing back to the host, which a captured graph cannot do. The result does not depend on it.
    """
    return experts_loop(x, routing, gate_up, down, limit, _expert_linear, x.dtype)


def experts_loop(x, routing, gate_up, down, limit, linear, acc_dtype: torch.dtype) -> torch.Tensor:
    """The per-expert loop of `moe_experts` with the expert linears given (`linear(rows, bank, e)`), summed
    in `acc_dtype`: a backend runs it with its own kernels where it has no batched form."""
    out = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    for e in (routing != 0).any(0).nonzero().flatten().tolist():
        rows = (routing[:, e] != 0).nonzero().flatten()
        gate, up = linear(x[rows], gate_up, e).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        y = linear(F.silu(gate) * up, down, e)
        out.index_add_(0, rows, (y.to(acc_dtype) * routing[rows, e, None].to(acc_dtype)))
    return out.to(x.dtype)


# ---- KDA (Kimi delta attention) ---------------------------------------------------------------------


def _kda_prepare(q, k, v, g, beta, state):
    """L2-normalise q/k as FLA does (sqrt(sum + eps), not max), scale q, lift everything to acc."""
    acc = _acc(q.dtype)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = state.to(acc) if state is not None else q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    return q, k, v, g, beta, s


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token: the specification of KDA (decode uses it as is).

    q/k [T, H, Dk], v [T, H, Dv], g [T, H, Dk] log-decay per key channel, beta [T, H], state
    [H, Dk, Dv]. Per token: S <- diag(exp g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
    Returns (o [T, H, Dv] in q's dtype, new state in the state's dtype, float32 when none given).
    """
    state_dtype = state.dtype if state is not None else _acc(q.dtype)
    out_dtype = v.dtype
    q, k, v, g, beta, s = _kda_prepare(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp().unsqueeze(-1)
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + k[t].unsqueeze(-1) * ((v[t] - pred) * beta[t].unsqueeze(-1)).unsqueeze(-2)
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out.to(out_dtype), s.to(state_dtype)


def kda_gates(f: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
              lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's per-token gates from their projections: (log-decay g [T, H, Dk], beta [T, H] in b's dtype).

    f [T, H*Dk] (f_b_proj's output), b [T, H] (b_proj's output), dt_bias [H*Dk], a_log [H]. With a lower
    bound (GLM-5.3-Flash: -5) g = lower_bound * sigmoid(exp(a_log) (f + dt_bias)), bounded below so that
    the state never decays faster than exp(lower_bound) per token; without, Kimi's
    g = -exp(a_log) softplus(f + dt_bias). beta = sigmoid(b). g comes in f's and dt_bias's promoted dtype:
    float32 for a 16-bit model, whose dt_bias stays float32 (transformers' _keep_in_fp32_modules).
    """
    acc = _acc(f.dtype)
    heads = a_log.shape[0]
    raw = (f.to(acc) + dt_bias.to(acc)).view(f.shape[0], heads, -1)
    rate = a_log.to(acc).exp().view(1, -1, 1)
    g = lower_bound * torch.sigmoid(rate * raw) if lower_bound is not None else -rate * F.softplus(raw, threshold=20.0)
    return g.to(torch.promote_types(f.dtype, dt_bias.dtype)), torch.sigmoid(b)


def kda_recurrent_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state_pool: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """`kda_recurrent` for one new token of each of B sequences whose states are rows of a pool (decode).

    q/k [B, H, Dk], v [B, H, Dv], g [B, H, Dk], beta [B, H]; state_pool [S, H, Dk, Dv] (row state_slots[b]
    is sequence b's state; updated in place), state_slots [B] distinct. Returns o [B, H, Dv]; equals
    `kda_recurrent(q[b:b+1], ..., state_pool[state_slots[b]])` per sequence.
    """
    return _kda_update_with(_registry.OPS["kda_recurrent"].reference)(q, k, v, g, beta, state_pool, state_slots)


def _kda_update_with(recurrent):
    """kda_recurrent_update from a `kda_recurrent` implementation: the B sequences' heads side by side as
    the heads of one token (the recurrence is independent per head), the rows gathered and written back."""

    def update(q, k, v, g, beta, state_pool, state_slots):
        n, heads, dk, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[2]
        rows = state_pool.index_select(0, state_slots).view(n * heads, dk, dv)
        o, rows = recurrent(q.reshape(1, n * heads, dk), k.reshape(1, n * heads, dk), v.reshape(1, n * heads, dv),
                            g.reshape(1, n * heads, dk), beta.reshape(1, n * heads), rows)
        state_pool.index_copy_(0, state_slots, rows.view(n, heads, dk, dv).to(state_pool.dtype))
        return o.view(n, heads, dv)

    return update


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_recurrent` computed a chunk at a time (prefill): same inputs, same outputs.

    Within a chunk with cumulative log-decay G, the delta-rule corrections u_i solve the unit lower
    triangular system u_i + beta_i sum_{j<i} A_ij u_j = beta_i (v_i - (k_i e^{G_i})^T S0), with
    A_ij = sum_d k_i[d] k_j[d] e^{G_i[d] - G_j[d]}; outputs and the carried state follow in closed form.
    """
    state_dtype = state.dtype if state is not None else _acc(q.dtype)
    out_dtype = v.dtype
    q, k, v, g, beta, s = _kda_prepare(q, k, v, g, beta, state)
    outs = []
    for c0 in range(0, q.shape[0], chunk_size):
        qc, kc, vc, bc = (t[c0 : c0 + chunk_size].transpose(0, 1) for t in (q, k, v, beta))  # head-major
        G = g[c0 : c0 + chunk_size].transpose(0, 1).cumsum(1)  # [H, L, Dk]
        n = G.shape[1]
        below_eq = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # e^{G_i - G_j} only where j <= i (elsewhere it could overflow and is not used)
        decay = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~below_eq[..., None], float("-inf")).exp()
        A = torch.einsum("hid,hjd,hijd->hij", kc, kc, decay).tril(-1)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("hid,hdv->hiv", kc * G.exp(), s))
        system = torch.eye(n, dtype=q.dtype, device=q.device) + bc.unsqueeze(-1) * A
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        scores = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        outs.append((torch.einsum("hid,hdv->hiv", qc * G.exp(), s) + scores @ u).transpose(0, 1))
        last = G[:, -1:]
        s = s * last.exp().transpose(1, 2) + torch.einsum("hjd,hjv->hdv", kc * (last - G).exp(), u)
    return torch.cat(outs).to(out_dtype), s.to(state_dtype)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over T new tokens, continuing from `state` (prefill and decode).

    x [T, C], weight [C, K], state [K-1, C]: the previous K-1 inputs (zeros at sequence start).
    Returns (y [T, C], the last K-1 inputs as the next state), so a step of T=1 is the decode update.
    """
    acc = _acc(x.dtype)
    kw = weight.shape[1]
    prev = state if state is not None else x.new_zeros(kw - 1, x.shape[1])
    full = torch.cat([prev.to(x.dtype), x]).to(acc)  # [K-1+T, C]
    windows = full.unfold(0, kw, 1)  # [T, C, K]
    y = F.silu((windows * weight.to(acc)).sum(-1))
    return y.to(x.dtype), full[-(kw - 1) :].to(prev.dtype) if kw > 1 else prev


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                         state_slots: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d` for one new token of each of B sequences whose states are rows of a pool (decode).

    x [B, C], weight [C, K], state_pool [S, K-1, C] (row state_slots[b] holds sequence b's last K-1
    inputs; updated in place), state_slots [B] distinct. Returns y [B, C] in x's dtype; equals
    `causal_conv1d(x[b:b+1], weight, state_pool[state_slots[b]])` per sequence.
    """
    acc = _acc(x.dtype)
    window = torch.cat([state_pool[state_slots].to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    y = F.silu((window.to(acc) * weight.to(acc).t()).sum(1))
    state_pool[state_slots] = window[:, 1:].to(state_pool.dtype)
    return y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * sigmoid(gate), all in float32 (FLA's fused norm does not round in between)."""
    acc = _acc(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return (y * gate.to(acc).sigmoid()).to(x.dtype)


# ---- hyper-connections (mHC) ------------------------------------------------------------------------


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a block: collapse N residual streams into the block input; weights for `hc_post`.

    streams [T, N, D]; fn [(2+N)N, N*D]. One projection of the RMS-normalised streams yields pre (N),
    post (N) and comb (N x N); comb is pushed towards doubly stochastic by Sinkhorn so that mixing
    streams cannot grow their norm. Returns (post [T, N], comb [T, N, N], block input [T, D]).
    """
    pre, post, comb = hc_gates(streams, fn, base, scale, norm_eps, hc_eps)
    sinkhorn_(comb, sinkhorn_iters, hc_eps)
    return hc_collapse(streams, pre, post, comb)


def hc_gates(streams, fn, base, scale, norm_eps: float, hc_eps: float):
    """`hc_pre`'s first part: (pre [T, N], post [T, N], comb [T, N, N] before Sinkhorn), in acc."""
    acc = _acc(streams.dtype)
    t, n, _ = streams.shape
    flat = streams.reshape(t, -1).to(acc)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    proj = flat @ fn.to(acc).t()
    base, scale = base.to(acc), scale.to(acc)
    pre = torch.sigmoid(proj[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(proj[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax(proj[:, 2 * n :].view(t, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + hc_eps
    return pre, post, comb


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> None:
    """`hc_pre`'s Sinkhorn, in place: columns, then (rows, columns) iters - 1 times."""
    comb.div_(comb.sum(-2, keepdim=True).add_(eps))  # in place: 20 iterations, no allocation each
    for _ in range(iters - 1):
        comb.div_(comb.sum(-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(-2, keepdim=True).add_(eps))


def hc_collapse(streams, pre, post, comb):
    """`hc_pre`'s last part: the block input (streams weighted by pre), outputs in the streams' dtype."""
    collapsed = (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(1)
    return post.to(streams.dtype), comb.to(streams.dtype), collapsed.to(streams.dtype)


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a block: new stream i = post_i * block_out + sum_j comb[j, i] * stream_j."""
    return post.unsqueeze(-1) * block_out.unsqueeze(1) + comb.transpose(-1, -2) @ streams


# ---- DSA indexer and sparse attention ---------------------------------------------------------------


def _best_pools(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores of each row [..., n]; of equal scores the lower index first.

    torch.topk keeps an unspecified one of equal scores, and which one depends on the row's width and the
    device (a decode row is padded to its batch's widest block table): greedy output would then depend on
    what else is in flight. A stable descending sort keeps equal scores in index order. -0.0 is made 0.0
    first (a negative head weight times a relu'd 0.0), as the two compare equal in every backend's kernel."""
    scores = torch.where(scores == 0, torch.zeros_like(scores), scores)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def dsa_indexer_topk(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    q_start: int,
    index_topk: int,
    select_tail: bool,
) -> torch.Tensor:
    """Which keys each query attends to, as a 0/1 mask [T, S] (GLM-5.3 kpool DSA indexer).

    One sequence: keys/gate [S, D] for positions 0..S-1, queries q [T, Hi, D] at positions
    q_start..q_start+T-1. Keys are grouped in pools of P = ape.shape[0] consecutive positions; a
    complete pool is compressed to one key (softmax over its positions of gate + ape, per channel).
    A query scores each pool as sum_h w_h Hi^-1/2 relu(q_h . key D^-1/2), keeps the best
    index_topk / P pools that end at or before it, and (select_tail) the tokens of its own
    still-incomplete pool. Incomplete pools are never scored. Of equal scores (the relu gives 0.0 to a
    pool every head scores below zero, so exact ties are common) the lower pool index is kept
    (`_best_pools`): the selection is a function of the sequence alone, whatever else is batched with it
    or however wide its rows are padded, and every backend keeps the same pools.
    """
    acc = _acc(q.dtype)
    p = ape.shape[0]
    s_len, dim = keys.shape
    n_pools = s_len // p
    t_len, heads = q.shape[0], q.shape[1]
    mask = torch.zeros(t_len, s_len, dtype=q.dtype, device=q.device)
    pos = q_start + torch.arange(t_len, device=q.device)
    if n_pools:
        kp = keys[: n_pools * p].to(acc).view(n_pools, p, dim)
        logits = gate[: n_pools * p].to(acc).view(n_pools, p, dim) + ape.to(acc)
        pool_keys = (logits.softmax(1) * kp).sum(1)  # [n_pools, D]
        per_head = torch.relu(torch.einsum("thd,pd->thp", q.to(acc), pool_keys) * dim**-0.5)
        scores = torch.einsum("th,thp->tp", head_weights.to(acc) * heads**-0.5, per_head)
        pool_end = (torch.arange(n_pools, device=q.device) + 1) * p - 1
        visible = pool_end[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        k_sel = min(index_topk // p, n_pools)
        if k_sel:
            best = _best_pools(scores, k_sel)
            chosen = torch.zeros_like(visible).scatter_(1, best, True) & visible
            token_chosen = chosen.repeat_interleave(p, dim=1)
            mask[:, : n_pools * p] = token_chosen.to(q.dtype)
    if select_tail:
        tail_start = pos + 1 - (pos + 1) % p  # first token of the query's own incomplete pool
        cols = torch.arange(s_len, device=q.device)
        in_tail = (cols[None, :] >= tail_start[:, None]) & (cols[None, :] <= pos[:, None])
        mask = torch.maximum(mask, in_tail.to(q.dtype))
    return mask


def dsa_indexer_topk_decode(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    lengths: torch.Tensor,
    index_topk: int,
    select_tail: bool,
) -> torch.Tensor:
    """`dsa_indexer_topk` for one decoding query in each of B sequences, in shapes fixed by the batch
    (what a captured decode step needs: no per-sequence sizes read back to the host).

    q [B, Hi, D], head_weights [B, Hi]; keys / gate [B, S, D] hold each sequence's rows 0..S-1, of which
    only the first lengths[b] are its own (the rest is padding: whatever the gathered pages held);
    the query of sequence b sits at position lengths[b] - 1. Returns the mask [B, S]; row b equals
    `dsa_indexer_topk` on its first lengths[b] rows, zero-extended. Pools that end past the query are
    invisible and padding is never selected, so its content does not matter.
    """
    acc = _acc(q.dtype)
    p = ape.shape[0]
    b_len, s_len, dim = keys.shape
    n_pools, heads = s_len // p, q.shape[1]
    pos = lengths.to(q.device).long() - 1  # [B]
    cols = torch.arange(s_len, device=q.device)
    mask = torch.zeros(b_len, s_len, dtype=q.dtype, device=q.device)
    k_sel = index_topk // p
    if k_sel:
        kp = keys[:, : n_pools * p].to(acc).view(b_len, n_pools, p, dim)
        logits = gate[:, : n_pools * p].to(acc).view(b_len, n_pools, p, dim) + ape.to(acc)
        pool_keys = (logits.softmax(2) * kp).sum(2)  # [B, n_pools, D]
        per_head = torch.relu(torch.einsum("bhd,bpd->bhp", q.to(acc), pool_keys) * dim**-0.5)
        scores = torch.einsum("bh,bhp->bp", head_weights.to(acc) * heads**-0.5, per_head)
        pool_end = (torch.arange(n_pools, device=q.device) + 1) * p - 1
        visible = pool_end[None, :] <= pos[:, None]
        # k_sel -inf columns past the last pool: topk never runs short of pools, whatever the width, so the
        # step has one shape logic for every table width (no min(k, n_pools): a compiled step would
        # otherwise need one graph per side of it); the padding is never visible, so never chosen
        scores = F.pad(scores.masked_fill(~visible, float("-inf")), (0, k_sel), value=float("-inf"))
        best = _best_pools(scores, k_sel)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)[:, :n_pools] & visible
        mask[:, : n_pools * p] = chosen.repeat_interleave(p, dim=1).to(q.dtype)
    if select_tail:
        tail_start = pos + 1 - (pos + 1) % p
        in_tail = (cols[None, :] >= tail_start[:, None]) & (cols[None, :] <= pos[:, None])
        mask = torch.maximum(mask, in_tail.to(q.dtype))
    return mask


def latent_attention_decode(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its selected latent rows, keys and values both the latent (absorbed
    MLA decode: all heads share one latent row per token).

    q [B, H, R] (queries already carried into the latent space), latent [B, S, R], mask [B, S] nonzero
    where selected. Returns [B, H, R]; a sequence that selects nothing gets zeros.
    """
    acc = _acc(q.dtype)
    lat = latent.to(acc)
    scores = torch.einsum("bhr,bsr->bhs", q.to(acc), lat) * scale
    probs = scores.masked_fill((mask == 0).unsqueeze(1), float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhs,bsr->bhr", probs, lat).to(q.dtype)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of each query over the keys its mask selects (one sequence, MHA).

    q [T, H, D], k [S, H, D], v [S, H, Dv], mask [T, S] nonzero where selected (it carries
    causality). A query that selects nothing gets a zero output.
    """
    acc = _acc(q.dtype)
    scores = torch.einsum("thd,shd->hts", q.to(acc), k.to(acc)) * scale
    sel = (mask != 0).unsqueeze(0)
    probs = scores.masked_fill(~sel, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hts,shd->thd", probs, v.to(acc)).to(q.dtype)


# ---- declarations with their random-input makers ----------------------------------------------------

# Sequential ops (KDA, Sinkhorn) round more in 16 bits: a little more room than the elementwise ones.
_TOL_SEQ = {**_TOL, torch.bfloat16: Tolerance(atol=6e-2, rtol=6e-2)}


def _router_inputs(dtype, device, g):
    return (_randn(g, 6, 32, dtype=dtype, device=device), _randn(g, 16, 32, dtype=dtype, device=device, scale=0.3),
            _randn(g, 16, dtype=torch.float32, device=device, scale=0.1), 4, 4, 2, True, 2.5), {}


def _experts_inputs(dtype, device, g):
    x = _randn(g, 6, 16, dtype=dtype, device=device)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(6)])
    routing = torch.zeros(6, 5, dtype=torch.float64).scatter_(1, ids, torch.rand(6, 2, generator=g, dtype=torch.float64))
    return (x, routing.to(dtype=dtype, device=device), _randn(g, 5, 24, 16, dtype=dtype, device=device, scale=0.5),
            _randn(g, 5, 16, 12, dtype=dtype, device=device, scale=0.3), 2.0), {}


def _kda_args(dtype, device, g, t):
    h, dk, dv = 2, 8, 6
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, dk, generator=g, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(t, h, generator=g, dtype=torch.float64))
    return (_randn(g, t, h, dk, dtype=dtype, device=device), _randn(g, t, h, dk, dtype=dtype, device=device),
            _randn(g, t, h, dv, dtype=dtype, device=device), gate.to(dtype=dtype, device=device),
            beta.to(dtype=dtype, device=device), _randn(g, h, dk, dv, dtype=dtype, device=device, scale=0.3))


def _kda_recurrent_inputs(dtype, device, g):
    return _kda_args(dtype, device, g, 5), {}


def _kda_gates_inputs(dtype, device, g):
    h, dk = 3, 8
    return (_randn(g, 5, h * dk, dtype=dtype, device=device, scale=2.0), _randn(g, 5, h, dtype=dtype, device=device),
            _randn(g, h * dk, dtype=dtype, device=device), _randn(g, h, dtype=dtype, device=device, scale=0.5),
            -5.0), {}


def _kda_update_inputs(dtype, device, g):
    q, k, v, gate, beta, _ = _kda_args(dtype, device, g, 4)  # 4 sequences of one token each
    pool = _randn(g, 6, q.shape[1], q.shape[2], v.shape[2], dtype=dtype, device=device, scale=0.3)
    return (q, k, v, gate, beta, pool, torch.tensor([5, 0, 3, 2], device=device)), {}


def _kda_update_composite(impl):
    return _kda_update_with(impl("kda_recurrent"))


def _kda_chunk_inputs(dtype, device, g):
    return _kda_args(dtype, device, g, 11), {"chunk_size": 4}  # two full chunks and a partial one


def _conv_inputs(dtype, device, g):
    return (_randn(g, 5, 12, dtype=dtype, device=device), _randn(g, 12, 4, dtype=dtype, device=device, scale=0.5),
            _randn(g, 3, 12, dtype=dtype, device=device)), {}


def _conv_update_inputs(dtype, device, g):
    pool = _randn(g, 6, 3, 12, dtype=dtype, device=device)
    return (_randn(g, 4, 12, dtype=dtype, device=device), _randn(g, 12, 4, dtype=dtype, device=device, scale=0.5),
            pool, torch.tensor([5, 0, 3, 2], device=device)), {}


def _gated_norm_inputs(dtype, device, g):
    return (_randn(g, 6, 16, dtype=dtype, device=device), _randn(g, 6, 16, dtype=dtype, device=device),
            _randn(g, 16, dtype=dtype, device=device), 1e-5), {}


def _hc_pre_inputs(dtype, device, g):
    n, d = 3, 16
    return (_randn(g, 5, n, d, dtype=dtype, device=device), _randn(g, (2 + n) * n, n * d, dtype=dtype, device=device,
            scale=0.1), _randn(g, (2 + n) * n, dtype=dtype, device=device, scale=0.3),
            1.0 + _randn(g, 3, dtype=dtype, device=device, scale=0.2), 1e-5, 1e-6, 7), {}


def _hc_post_inputs(dtype, device, g):
    return (_randn(g, 5, 16, dtype=dtype, device=device), _randn(g, 5, 3, 16, dtype=dtype, device=device),
            _randn(g, 5, 3, dtype=dtype, device=device), torch.rand(5, 3, 3, generator=g, dtype=torch.float64).to(
            dtype=dtype, device=device)), {}


def _tied_pools(keys: torch.Tensor, tied: list[list[int]], p: int) -> torch.Tensor:
    """keys [B, S, D] made positive, except the rows of the pools tied[b] of each sequence b: negative.
    Against queries that are positive in every head such a pool scores relu(<0) = 0.0 exactly, in every
    dtype: exact ties, at the top-k cut when fewer pools score above 0.0 than the top-k keeps."""
    keys = keys.abs()
    for b, pools in enumerate(tied):
        for i in pools:
            keys[b, i * p : (i + 1) * p] *= -1
    return keys


def _indexer_inputs(dtype, device, g):
    """Four queries over 4 complete pools, 2 kept: pool 2 scores above 0.0 and pools 0, 1, 3 tie at
    exactly 0.0 (`_tied_pools`), so pools 2 and 0 are kept; query 1 weighs every head negatively (its
    pool 2 scores below the tied -0.0 / 0.0), so pools 0 and 1 are kept."""
    s, t, hi, d, p = 19, 4, 3, 8, 4  # 4 complete pools and a 3-token tail; the queries are the last 4
    weights = _randn(g, t, hi, dtype=dtype, device=device).abs() + 0.1
    weights[1] *= -1
    keys = _tied_pools(_randn(g, 1, s, d, dtype=dtype, device=device), [[0, 1, 3]], p)[0]
    return (_randn(g, t, hi, d, dtype=dtype, device=device).abs(), weights, keys,
            _randn(g, s, d, dtype=dtype, device=device), _randn(g, p, d, dtype=dtype, device=device), s - t, 8,
            True), {}


def _indexer_decode_inputs(dtype, device, g):
    """Exact ties at the top-k cut (`_tied_pools`), kept by the lower pool index in every backend:
    sequence 0 keeps pool 3 (the only one above 0.0) and pool 0 of the tied 0, 1, 2; sequence 1 weighs
    every head negatively, so its pool 1 scores below the tied 0, 2, 3, of which it keeps 0 and 2;
    sequence 2 has one complete pool, fewer than the top-k keeps."""
    b, s, hi, d, p = 3, 21, 3, 8, 4  # lengths: a pool boundary, a tail, and fewer pools than the top-k keeps
    weights = _randn(g, b, hi, dtype=dtype, device=device).abs() + 0.1
    weights[1] *= -1
    keys = _tied_pools(_randn(g, b, s, d, dtype=dtype, device=device), [[0, 1, 2], [0, 2, 3], []], p)
    return (_randn(g, b, hi, d, dtype=dtype, device=device).abs(), weights, keys,
            _randn(g, b, s, d, dtype=dtype, device=device), _randn(g, p, d, dtype=dtype, device=device),
            torch.tensor([16, 19, 7], device=device), 8, True), {}


def _latent_decode_inputs(dtype, device, g):
    b, s = 3, 9
    mask = torch.rand(b, s, generator=g) < 0.5
    mask[:, 0] = True
    mask[2] = False  # a sequence that selects nothing
    return (_randn(g, b, 2, 8, dtype=dtype, device=device), _randn(g, b, s, 8, dtype=dtype, device=device),
            mask.to(dtype=dtype, device=device), 8**-0.5), {}


def _sparse_attention_inputs(dtype, device, g):
    t, s = 4, 9
    mask = (torch.rand(t, s, generator=g) < 0.5).tril(s - t)
    mask[:, -1] = False
    mask[torch.arange(t), torch.arange(s - t, s)] = True  # each query sees at least itself
    return (_randn(g, t, 2, 8, dtype=dtype, device=device), _randn(g, s, 2, 8, dtype=dtype, device=device),
            _randn(g, s, 2, 6, dtype=dtype, device=device), mask.to(dtype=dtype, device=device), 8**-0.5), {}


for _spec in (
    OpSpec("moe_router", moe_router, _TOL, _router_inputs, moe_router.__doc__),
    OpSpec("moe_experts", moe_experts, _TOL, _experts_inputs, moe_experts.__doc__),
    OpSpec("kda_recurrent", kda_recurrent, _TOL_SEQ, _kda_recurrent_inputs, kda_recurrent.__doc__),
    OpSpec("kda_chunk", kda_chunk, _TOL_SEQ, _kda_chunk_inputs, kda_chunk.__doc__),
    OpSpec("kda_gates", kda_gates, _TOL, _kda_gates_inputs, kda_gates.__doc__),
    OpSpec("kda_recurrent_update", kda_recurrent_update, _TOL_SEQ, _kda_update_inputs, kda_recurrent_update.__doc__,
           writes=(5,), composite=_kda_update_composite),
    OpSpec("causal_conv1d", causal_conv1d, _TOL, _conv_inputs, causal_conv1d.__doc__),
    OpSpec("causal_conv1d_update", causal_conv1d_update, _TOL, _conv_update_inputs, causal_conv1d_update.__doc__,
           writes=(2,)),
    OpSpec("gated_rms_norm", gated_rms_norm, _TOL, _gated_norm_inputs, gated_rms_norm.__doc__),
    OpSpec("hc_pre", hc_pre, _TOL_SEQ, _hc_pre_inputs, hc_pre.__doc__),
    OpSpec("hc_post", hc_post, _TOL, _hc_post_inputs, hc_post.__doc__),
    OpSpec("dsa_indexer_topk", dsa_indexer_topk, _TOL, _indexer_inputs, dsa_indexer_topk.__doc__),
    OpSpec("sparse_attention", sparse_attention, _TOL, _sparse_attention_inputs, sparse_attention.__doc__),
    OpSpec("dsa_indexer_topk_decode", dsa_indexer_topk_decode, _TOL, _indexer_decode_inputs,
           dsa_indexer_topk_decode.__doc__),
    OpSpec("latent_attention_decode", latent_attention_decode, _TOL, _latent_decode_inputs,
           latent_attention_decode.__doc__),
):
    register_op(_spec)



moe_router = _registry.dispatch("moe_router")
moe_experts = _registry.dispatch("moe_experts")
kda_recurrent = _registry.dispatch("kda_recurrent")
kda_chunk = _registry.dispatch("kda_chunk")
kda_gates = _registry.dispatch("kda_gates")
kda_recurrent_update = _registry.dispatch("kda_recurrent_update")
causal_conv1d = _registry.dispatch("causal_conv1d")
causal_conv1d_update = _registry.dispatch("causal_conv1d_update")
gated_rms_norm = _registry.dispatch("gated_rms_norm")
hc_pre = _registry.dispatch("hc_pre")
hc_post = _registry.dispatch("hc_post")
dsa_indexer_topk = _registry.dispatch("dsa_indexer_topk")
sparse_attention = _registry.dispatch("sparse_attention")
dsa_indexer_topk_decode = _registry.dispatch("dsa_indexer_topk_decode")
latent_attention_decode = _registry.dispatch("latent_attention_decode")

__all__ = ["moe_router", "moe_experts", "kda_recurrent", "kda_chunk", "kda_gates", "kda_recurrent_update",
           "causal_conv1d", "causal_conv1d_update", "gated_rms_norm", "hc_pre", "hc_post", "dsa_indexer_topk",
           "sparse_attention", "dsa_indexer_topk_decode", "latent_attention_decode"]
