"""glm5_next's feed-forward blocks: the dense clamped-SwiGLU MLP and the sigmoid-routed MoE (routed
expert bank, shared expert, tensor and expert parallelism). Apart from the token mixers: an FFN sees
tokens only, never a cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flagdeploy import ops, parallel
from flagdeploy.ops import glm as glm_ops
from flagdeploy.ops.weights import Fp8BlockWeight, Int8Weight, W8A8Weight
from flagdeploy.parallel import Shard

from .. import overlap
from ..linear import column_parallel, row_parallel
from .common import _param
from .config import Glm5Config


class DenseMlp(nn.Module):
    """Clamped SwiGLU MLP (also the MoE's shared expert).

    Under TP gate/up are column-parallel and down row-parallel (intermediate size split). `partial`
    leaves down's output a partial sum (no all-reduce of its own): the MoE adds it to the routed
    experts' partial sums and reduces both at once.
    """

    def __init__(self, c: Glm5Config, inter: int, dtype: torch.dtype, what: str = "intermediate_size",
                 partial: bool = False):
        super().__init__()
        self.limit = c.swiglu_limit
        self.gate_up_proj = column_parallel({"gate_proj": inter, "up_proj": inter}, c.hidden_size, dtype, what=what)
        self.down_proj = row_parallel(c.hidden_size, inter, dtype, "down_proj", what=what)
        if partial:
            self.down_proj.reduce = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_up_proj(h), self.limit))


class ExpertBank(nn.Module):
    """The routed experts' weights, filled expert by expert from the checkpoint.

    Dense experts are copied straight into [E, 2I, H] / [E, H, I] parameters. When a checkpoint stores
    every expert in one quantized scheme (W8A8 or W8A16 int8 of one group size for gate/up and one for
    down, or FP8 block-scaled kept for an FP8 backend), the bank becomes one quantized bundle per
    projection instead, so that `moe_experts` runs that scheme's arithmetic; anything mixed is
    dequantized into the dense parameters.
    """

    _PARTS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.n_total, self.full_inter, self.hidden = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        # EP: experts [first, first + n) live here; TP: each of them keeps a share of its intermediate size
        self.first, self.n = parallel.split(self.n_total, parallel.ep_size(), parallel.ep_rank(),
                                            "routed experts (n_routed_experts)", "--ep")
        self.rows = parallel.tp_shard(self.full_inter, 0, "moe_intermediate_size")  # gate/up rows
        self.inter = self.rows.length if self.rows is not None else self.full_inter
        self.gate_up = _param(self.n, 2 * self.inter, self.hidden, dtype=dtype)
        self.down = _param(self.n, self.hidden, self.inter, dtype=dtype)
        self._pending: dict[tuple[int, str], Any] = {}

    def holds(self, e: int) -> bool:
        """Whether routed expert `e` (global id) lives on this rank."""
        return self.first <= e < self.first + self.n

    def shard(self, proj: str) -> Shard | None:
        """This rank's slice of one expert's checkpoint tensor: gate/up rows, down columns (TP)."""
        if self.rows is None:
            return None
        return self.rows if proj != "down_proj" else Shard(1, self.rows.start, self.rows.length, self.rows.full)

    def part_shape(self, part: tuple[int, str]) -> tuple[int, int]:
        """The whole checkpoint tensor's shape (a slice of it is accepted too)."""
        return (self.hidden, self.full_inter) if part[1] == "down_proj" else (self.full_inter, self.hidden)

    def _view(self, e: int, name: str) -> torch.Tensor:
        i, e = self.inter, e - self.first
        return {"gate_proj": self.gate_up[e, :i], "up_proj": self.gate_up[e, i:], "down_proj": self.down[e]}[name]

    def load_part(self, part: tuple[int, str], kind: str, value) -> None:
        """One expert's projection (global expert id), whole or already this rank's slice."""
        shard = self.shard(part[1])
        if shard is not None:
            if not isinstance(value, torch.Tensor):  # quantized bundles are split dense, as Linear does
                value = value.dequantize(self.gate_up.dtype)
            value = shard.take(value)
        if isinstance(value, torch.Tensor):
            dst = self._view(*part)
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"has shape {tuple(value.shape)}, this rank's slot is {tuple(dst.shape)}")
            dst.copy_(value)
        else:
            self._pending[part] = value

    def narrow_to_bf16(self) -> None:
        """Dense float32 banks whose every value is a bfloat16 number (a BF16 checkpoint's experts, run in
        float32) are stored as bfloat16: the weights are the checkpoint's exactly, in half the memory,
        and a decode step, which reads every expert's weights for a few tokens, reads half the bytes
        (`moe_experts` then rounds the matmuls' inputs to bfloat16). Banks that lose anything stay."""
        banks = (self.gate_up, self.down)
        if not all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in banks):
            return
        narrow = [b.to(torch.bfloat16) for b in banks]
        # expert by expert: the comparison's float32 temporaries stay one expert large
        if all(torch.equal(n[e].float(), b[e]) for n, b in zip(narrow, banks) for e in range(b.shape[0])):
            del self.gate_up, self.down
            self.gate_up, self.down = (nn.Parameter(n, requires_grad=False) for n in narrow)

    def finalize(self) -> None:
        self._join_pending()
        # the backend lays the banks out for its kernels (a Parameter stays a Parameter)
        banks = ops.prepare_weight("moe_experts", (self.gate_up, self.down))
        if banks[0] is not self.gate_up or banks[1] is not self.down:
            del self.gate_up, self.down
            self.gate_up, self.down = banks

    def _join_pending(self) -> None:
        if not self._pending:
            return
        bundles = list(self._pending.values())
        gate_up_groups = {getattr(b, "group_size", None) for (_, name), b in self._pending.items() if name != "down_proj"}
        down_groups = {getattr(b, "group_size", None) for (_, name), b in self._pending.items() if name == "down_proj"}
        kinds = {type(b) for b in bundles}
        banks = None
        if (len(bundles) == 3 * self.n and kinds <= {Int8Weight, W8A8Weight, Fp8BlockWeight}
                and len(kinds) == len(gate_up_groups) == len(down_groups) == 1):
            get = lambda e, name: self._pending[(e, name)]  # noqa: E731
            mine = range(self.first, self.first + self.n)
            kind = type(bundles[0])
            try:
                banks = (kind.stack([kind.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in mine]),
                         kind.stack([get(e, "down_proj") for e in mine]))
            except ValueError:  # FP8 halves off a scale-block boundary, unequal blocks: dense below
                banks = None
        if banks is not None:
            del self.gate_up, self.down  # the dense parameters give way to the banks
            self.gate_up, self.down = banks
        else:
            for (e, name), b in self._pending.items():
                self._view(e, name).copy_(b.dequantize(self.gate_up.dtype))
        self._pending.clear()


class MoE(nn.Module):
    """Sigmoid-routed experts (group-limited top-k) plus the always-on shared expert.

    The router is replicated: every rank routes every token identically. Under TP the routed and the
    shared experts' outputs are partial sums over the intermediate shard, reduced by one all-reduce.
    Under EP see `_expert_parallel`.
    """

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        self.router = _param(c.n_routed_experts, c.hidden_size, dtype=dtype)
        self.correction_bias = _param(c.n_routed_experts, dtype=torch.float32)
        self.experts = ExpertBank(c, dtype)
        self.shared = DenseMlp(c, c.moe_intermediate_size * c.n_shared_experts, dtype, "moe_intermediate_size",
                               partial=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = self.c
        ep = parallel.ep_size() > 1
        shared = None if ep else overlap.start(self.shared, h)  # beside the router and the routed experts, on a GPU
        routing = glm_ops.moe_router(h, self.router, self.correction_bias, c.num_experts_per_tok, c.n_group,
                                     c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if ep:
            return self._expert_parallel(h, routing)
        x = self.experts
        routed = glm_ops.moe_experts(h, routing, x.gate_up, x.down, c.swiglu_limit, top_k=c.num_experts_per_tok)
        return self._tp_sum(routed + overlap.finish(shared))

    @staticmethod
    def _tp_sum(partial: torch.Tensor) -> torch.Tensor:
        """The one all-reduce of the MoE over the TP group (routed + shared partial sums together)."""
        return ops.all_reduce(partial, parallel.tp_group()) if parallel.tp_size() > 1 else partial

    def _expert_parallel(self, h: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """The MoE with the routed experts spread over the EP group.

        Every EP rank has all T tokens; EP rank r takes the r-th contiguous block of ceil(T / ep) of
        them (the last blocks shorter or empty), so each token is dispatched exactly once. Each of
        the block's (token, expert) choices travels to the rank holding the expert (counts first, then
        the rows and the expert ids, all-to-all), that rank runs its local experts on what arrived,
        the outputs travel back by the inverse all-to-all and are weighted and summed per token here.
        The shared expert runs on the same block; with TP the block's partial sums are reduced once;
        an all-gather over the EP group finally gives every rank all T rows again.
        """
        c, bank, group = self.c, self.experts, parallel.ep_group()
        ep, t = parallel.ep_size(), h.shape[0]
        per = -(-t // ep)
        a, b = min(parallel.ep_rank() * per, t), min((parallel.ep_rank() + 1) * per, t)
        x, mine = h[a:b], routing[a:b]
        # dispatch: this block's choices grouped by owning rank (experts are laid out rank by rank)
        token, expert = mine.nonzero(as_tuple=True)
        order = torch.argsort(expert, stable=True)
        token, expert = token[order], expert[order]
        weight = mine[token, expert]
        owner = expert // bank.n
        send = torch.bincount(owner, minlength=ep)
        recv = parallel.all_to_all(send, [1] * ep, [1] * ep, group)
        send_n, recv_n = send.tolist(), recv.tolist()
        rows = parallel.all_to_all(x[token], send_n, recv_n, group)
        ids = parallel.all_to_all(expert, send_n, recv_n, group) - bank.first
        # the owner: each received row goes to exactly one local expert, with weight 1 (weighted at home)
        pick = torch.zeros(rows.shape[0], bank.n, dtype=rows.dtype, device=rows.device)
        pick.scatter_(1, ids.unsqueeze(1), 1.0)
        done = glm_ops.moe_experts(rows, pick, bank.gate_up, bank.down, c.swiglu_limit)
        back = parallel.all_to_all(done, recv_n, send_n, group)
        # combine: the block's weighted sums plus the shared expert, padded to `per` rows for the gather
        out = h.new_zeros(per, h.shape[1])
        out[: b - a].index_add_(0, token, (back * weight.unsqueeze(1)).to(out.dtype))
        out[: b - a] += self.shared(x)
        out = self._tp_sum(out)
        return parallel.all_gather(out, dim=0, group=group)[:t]
