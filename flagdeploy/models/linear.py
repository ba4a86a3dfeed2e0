"""A linear layer whose weight may be dense or a quantized bundle, possibly fused from several parts."""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy import ops
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight

# Which op runs a weight: by the bundle's type (a W8A8 bundle also quantises the activations).
_OP = {Int4Weight: "linear_w4a16", Int8Weight: "linear_w8a16", W8A8Weight: "linear_w8a8_dynamic",
       Fp8BlockWeight: "linear_fp8_block"}


class Linear(nn.Module):
    """y = x W^T (+ b). `parts` names the checkpoint tensors fused into W, in row order (q, k, v).

    Parts arrive one by one from a loader (`load_part`); `finalize` joins them and hands quantized
    bundles to the active backend to lay out. Mixed dense/quantized parts are joined dense.
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, parts: tuple[str, ...],
                 bias: bool = False):
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.parts = parts
        self.weight: torch.Tensor | None = None
        self.qweight: Int4Weight | Int8Weight | W8A8Weight | Fp8BlockWeight | None = None
        self.bias: torch.Tensor | None = None
        self.has_bias = bias
        self._pending: dict[tuple[str, str], object] = {}
        self._op = "linear"

    def load_part(self, part: str, kind: str, value) -> None:
        """kind is 'weight' or 'bias'; value a tensor or a quantized weight bundle."""
        self._pending[(part, kind)] = value

    def finalize(self) -> None:
        ws = [self._pending.pop((p, "weight")) for p in self.parts]
        if self.has_bias:
            self.bias = torch.cat([self._pending.pop((p, "bias")).to(self.dtype) for p in self.parts])
        layouts = {(type(w), getattr(w, "group_size", None)) for w in ws}
        q = None
        if len(layouts) == 1 and type(ws[0]) in _OP:
            try:
                q = ws[0] if len(ws) == 1 else type(ws[0]).cat(ws)
            except ValueError:  # parts that cannot share one layout are joined dense below
                q = None
        if q is None:
            dense = [w.to(self.dtype) if isinstance(w, torch.Tensor) else w.dequantize(self.dtype) for w in ws]
            self.weight = dense[0] if len(dense) == 1 else torch.cat(dense)
        else:
            self._op = _OP[type(q)]
            self.qweight = ops.prepare_weight(self._op, q)
        shape = (self.out_features, self.in_features)
        got = (self.qweight.out_features, self.qweight.in_features) if q is not None else tuple(self.weight.shape)
        if got != shape:
            raise ValueError(f"fused weight {'+'.join(self.parts)} has shape {got}, the config implies {shape}")

    def part_shape(self, part: str) -> tuple[int, int] | None:
        """A checkpoint part's [out, in], where it is known (one part; fused parts may differ in rows)."""
        return (self.out_features, self.in_features) if len(self.parts) == 1 else None

    def init_random(self, gen: torch.Generator, std: float = 0.02, device: torch.device | str = "cpu") -> None:
        """Random weights of the right shape instead of loaded parts (`--load-format dummy`); `gen` is a
        CPU generator, so the weights are the same whatever the device."""
        self._pending.clear()
        w = torch.randn(self.out_features, self.in_features, generator=gen, device="cpu") * std
        self.weight = w.to(device=device, dtype=self.dtype)
        self.bias = torch.zeros(self.out_features, dtype=self.dtype, device=device) if self.has_bias else None

    def quantize_int8(self) -> None:
        """Re-store a dense weight as per-channel int8 (used for lm_head in the quantized weight format)."""
        q = Int8Weight.quantize(self.weight)
        self.weight, self._op = None, "linear_w8a16"
        self.qweight = ops.prepare_weight(self._op, q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:  # a dense layer after a 16-bit one gets its input in its own dtype
            return ops.linear(x.to(self.weight.dtype), self.weight, self.bias)
        return getattr(ops, self._op)(x, self.qweight, self.bias)
