"""One glm5_next block: a token mixer (KDA or MLA) and an FFN (dense or MoE), each between
manifold-constrained hyper-connections over the N residual streams. Apart from the model, which only
stacks blocks and adds the embedding, the head and the caches around them.
"""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy import ops
from flagdeploy.ops import glm as glm_ops

from .cache import DecodeBatch, Span
from .common import _param
from .config import Glm5Config
from .kda import KdaAttention
from .mla import MlaAttention
from .moe import DenseMlp, MoE


class HyperConnection(nn.Module):
    """The learned mHC weights of one block (projection, biases, three scales)."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        n = c.hc_mult
        self.fn = _param((2 + n) * n, n * c.hidden_size, dtype=dtype)
        self.base = _param((2 + n) * n, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)

    def pre(self, streams: torch.Tensor, c: Glm5Config):
        return glm_ops.hc_pre(streams, self.fn, self.base, self.scale, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)


class Glm5Layer(nn.Module):
    def __init__(self, c: Glm5Config, idx: int, dtype: torch.dtype):
        super().__init__()
        self.c, self.idx = c, idx
        self.kind = c.layer_types[idx]
        if self.kind == "linear_attention":
            self.attn: nn.Module = KdaAttention(c, dtype)
        else:
            self.attn = MlaAttention(c, dtype, full_indexer=c.indexer_types[idx] == "full")
        self.mlp: nn.Module = MoE(c, dtype) if c.mlp_layer_types[idx] == "sparse" else DenseMlp(c, c.intermediate_size,
                                                                                                 dtype)
        self.input_norm = _param(c.hidden_size, dtype=dtype)
        self.post_norm = _param(c.hidden_size, dtype=dtype)
        self.attn_hc = HyperConnection(c, dtype)
        self.ffn_hc = HyperConnection(c, dtype)

    def forward(self, streams: torch.Tensor, states: list, spans: list[Span], prev_masks: list | None):
        """streams [T, N, D] of the packed tokens → (streams, this layer's selection masks or None)."""
        if self.kind == "linear_attention":
            return self._block(streams, lambda h: (self.attn(h, states, spans), None))
        return self._block(streams, lambda h: self.attn(h, states, spans, prev_masks))

    def decode(self, streams: torch.Tensor, batch: DecodeBatch, rows: torch.Tensor | None,
               prev_mask: torch.Tensor | None):
        """streams [B, N, D], one token per sequence → (streams, this layer's selection mask or None)."""
        pool = batch.pools[self.idx]
        if self.kind == "linear_attention":
            return self._block(streams, lambda h: (self.attn.decode(h, batch, pool), None))
        return self._block(streams, lambda h: self.attn.decode(h, batch, pool, rows, prev_mask))

    def _block(self, streams: torch.Tensor, mix):
        """mHC around the token mixer `mix` (normed input → (output, masks)), then around the FFN."""
        c = self.c
        post, comb, h = self.attn_hc.pre(streams, c)
        h, masks = mix(ops.rms_norm(h, self.input_norm, c.rms_norm_eps))
        streams = glm_ops.hc_post(h, streams, post, comb)
        post, comb, h = self.ffn_hc.pre(streams, c)
        h = self.mlp(ops.rms_norm(h, self.post_norm, c.rms_norm_eps))
        return glm_ops.hc_post(h, streams, post, comb), masks
