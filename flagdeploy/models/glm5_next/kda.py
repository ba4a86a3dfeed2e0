"""KDA (Kimi delta attention), glm5_next's linear-attention token mixer: short convs, a per-channel
forget gate and the gated delta rule over a recurrent state per sequence, packed or as one fixed-shape
decode step over the engine's state pools. Apart from MLA: the two mixers share no code.
"""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy.ops import glm as glm_ops

from ..linear import column_parallel, row_parallel
from .cache import DecodeBatch, KdaState, Span
from .common import _head_shard, _local_heads, _param
from .config import Glm5Config


class KdaAttention(nn.Module):
    """Kimi delta attention: short conv on q/k/v, per-channel forget gate, gated delta rule, gated norm."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        h, d, width = c.linear_num_heads, c.linear_head_dim, c.linear_num_heads * c.linear_head_dim
        # Under TP each rank holds whole heads: every per-channel tensor (q/k/v and their convs, the
        # gates' output rows, dt_bias) is cut by `channels`, the per-head ones (beta, A_log) by `heads`;
        # the low-rank input sides (f_a, g_a) and o_norm (one weight shared by all heads) are replicated,
        # and o_proj sums the heads' contributions over the group. The state then holds local heads only.
        what = "linear attention heads (linear_num_heads)"
        self.heads = _local_heads(h, what)
        self.channels, self.head_rows = _head_shard(h, d, what), _head_shard(h, 1, what)
        local = self.heads * d
        # Everything computed from the block input in one matmul: q/k/v (head-split under TP), the low-rank
        # input sides of the forget gate and the output gate (replicated) and beta (per head). At one token
        # each separate skinny matmul is a launch and a split-K reduce of its own.
        self.in_proj = column_parallel(
            {"q_proj": width, "k_proj": width, "v_proj": width, "f_a_proj": d, "g_a_proj": d, "b_proj": h},
            c.hidden_size, dtype, shards={"q_proj": self.channels, "k_proj": self.channels, "v_proj": self.channels,
                                          "f_a_proj": None, "g_a_proj": None, "b_proj": self.head_rows})
        self.in_split = (3 * local, d, d, self.heads)
        # float32 like transformers' _keep_in_fp32_modules: the conv, dt_bias and A_log stay exact
        self.conv_weight = _param(3 * local, c.linear_conv_kernel_dim, dtype=torch.float32)
        self.f_b_proj = column_parallel({"f_b_proj": width}, d, dtype, shards={"f_b_proj": self.channels})
        self.dt_bias = _param(local, dtype=torch.float32)
        self.A_log = _param(self.heads, dtype=torch.float32)
        self.g_b_proj = column_parallel({"g_b_proj": width}, d, dtype, shards={"g_b_proj": self.channels})
        self.o_norm = _param(d, dtype=dtype)
        self.o_proj = row_parallel(c.hidden_size, width, dtype, "o_proj", what=what)

    def _project(self, h: torch.Tensor):
        """(q/k/v before the conv [T, 3 local], log-decay g [T, H, D] float32, beta [T, H], output gate [T, H, D])."""
        mixed, f_a, g_a, b = self.in_proj(h).split(self.in_split, dim=-1)
        g, beta = glm_ops.kda_gates(self.f_b_proj(f_a), b, self.dt_bias, self.A_log, self.c.linear_lower_bound)
        return mixed, g, beta, self.g_b_proj(g_a).view(h.shape[0], self.heads, -1)

    def forward(self, h: torch.Tensor, states: list[KdaState], spans: list[Span]) -> torch.Tensor:
        """Projections run on the packed tokens; the conv and the recurrence per sequence."""
        c = self.c
        t, shape = h.shape[0], (h.shape[0], self.heads, c.linear_head_dim)
        mixed, g, beta, gate = self._project(h)
        out = h.new_empty(shape)
        stepping = [i for i, (a, b, _) in enumerate(spans) if b - a == 1 and states[i].recurrent is not None]
        if len(stepping) > 1:
            self._step_together([states[i] for i in stepping], [spans[i][0] for i in stepping], mixed, g, beta, out)
        done = set(stepping) if len(stepping) > 1 else set()
        for i, (state, (a, b, _)) in enumerate(zip(states, spans)):
            if i in done:
                continue
            conv, state.conv = glm_ops.causal_conv1d(mixed[a:b], self.conv_weight, state.conv)
            q, k, v = (x.reshape(b - a, *shape[1:]) for x in conv.chunk(3, dim=-1))
            kda = glm_ops.kda_recurrent if b - a == 1 and state.recurrent is not None else glm_ops.kda_chunk
            if state.recurrent is None:
                state.recurrent = torch.zeros(self.heads, c.linear_head_dim, c.linear_head_dim,
                                              dtype=torch.float32, device=h.device)
            out[a:b], state.recurrent = kda(q, k, v, g[a:b], beta[a:b], state.recurrent)
        return self.o_proj(glm_ops.gated_rms_norm(out, gate, self.o_norm, c.rms_norm_eps).reshape(t, -1))

    def decode(self, h: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token of each of B sequences, states read from and written back to the state pools by
        `batch.state_slots`; the conv and the delta rule run as one op call each for the whole batch."""
        c, n = self.c, h.shape[0]
        heads, d = self.heads, c.linear_head_dim
        mixed, g, beta, gate = self._project(h)
        if batch.waves is None:
            conv = glm_ops.causal_conv1d_update(mixed, self.conv_weight, pool["conv"], batch.state_slots)
            q, k, v = (part.reshape(n, heads, d) for part in conv.chunk(3, dim=-1))
            o = glm_ops.kda_recurrent_update(q, k, v, g, beta, pool["recurrent"], batch.state_slots)
        else:
            o = self._step_waves(mixed, g, beta, batch.waves, pool)
        return self.o_proj(glm_ops.gated_rms_norm(o, gate, self.o_norm, c.rms_norm_eps).reshape(n, -1))

    def _step_waves(self, mixed, g, beta, waves, pool: dict[str, torch.Tensor]) -> torch.Tensor:
        """A verify step: each wave's rows copy their source state rows into their target rows, then step
        those in place exactly as a plain decode step would (the same two ops, so the same numbers)."""
        heads, d = self.heads, self.c.linear_head_dim
        outs = []
        for a, b, src, dst in waves:
            if a:  # the first wave steps each sequence's own row; later ones continue from the previous wave's
                for key in ("conv", "recurrent"):
                    pool[key].index_copy_(0, dst, pool[key].index_select(0, src))
            conv = glm_ops.causal_conv1d_update(mixed[a:b], self.conv_weight, pool["conv"], dst)
            q, k, v = (part.reshape(b - a, heads, d) for part in conv.chunk(3, dim=-1))
            outs.append(glm_ops.kda_recurrent_update(q, k, v, g[a:b], beta[a:b], pool["recurrent"], dst))
        return torch.cat(outs)

    def _step_together(self, states: list[KdaState], rows: list[int], mixed, g, beta, out) -> None:
        """One decode step of B sequences as one op call each: both the conv and the delta rule act per
        channel / per head independently, so B sequences are B times the channels / heads of one."""
        c, n = self.c, len(rows)
        heads, width = self.heads, mixed.shape[1]
        x = mixed[rows].reshape(1, n * width)
        conv_state = torch.cat([s.conv for s in states], dim=1)
        conv, conv_state = glm_ops.causal_conv1d(x, self.conv_weight.repeat(n, 1), conv_state)
        q, k, v = (part.reshape(1, n * heads, c.linear_head_dim) for part in conv.view(n, width).chunk(3, dim=-1))
        recurrent = torch.cat([s.recurrent for s in states])
        o, recurrent = glm_ops.kda_recurrent(q, k, v, g[rows].reshape(1, n * heads, -1), beta[rows].reshape(1, n * heads),
                                             recurrent)
        out[rows] = o.view(n, heads, -1)
        for i, s in enumerate(states):
            s.conv = conv_state[:, i * width : (i + 1) * width]
            s.recurrent = recurrent[i * heads : (i + 1) * heads]
