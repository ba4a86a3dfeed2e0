"""Quantized weight bundles in their canonical (chip-neutral) layout.

A backend that runs an op natively may `prepare` a bundle into its own layout at load time (packed
int4 tiles on the CPU, NZ fractal format on Ascend) and keeps whatever it needs in `prepared`; the
reference implementations only read the canonical fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

# FP8 storage types (checkpoints keep FP8 weights with block scales beside them); the tuple is empty
# on a torch without FP8 dtypes.
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass
class Int4Weight:
    """Group-wise asymmetric 4-bit weights: w[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G].

    q holds one value 0..15 per uint8 (the canonical form favours clarity; backends pack it).
    This is exactly GGUF's Q4_0 (zeros = 0) and Q4_1 (zeros = min + 8 * scale) with G = 32.
    """

    q: torch.Tensor | None  # [N, K] uint8
    scales: torch.Tensor | None  # [N, K // G]
    zeros: torch.Tensor | None  # [N, K // G]
    group_size: int
    out_features: int
    in_features: int
    prepared: Any = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group_size
        s = self.scales.to(torch.float32).repeat_interleave(g, dim=1)
        z = self.zeros.to(torch.float32).repeat_interleave(g, dim=1)
        return ((self.q.to(torch.float32) - 8) * s + z).to(dtype)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Fuse along the output dim (q/k/v into qkv, gate/up into gate_up)."""
        return Int4Weight(
            torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), torch.cat([p.zeros for p in parts]),
            parts[0].group_size, sum(p.out_features for p in parts), parts[0].in_features,
        )


@dataclass
class Int8Weight:
    """Per-output-channel symmetric int8 weights: w[n, k] = q[n, k] * scales[n]."""

    q: torch.Tensor | None  # [N, K] int8
    scales: torch.Tensor | None  # [N]
    out_features: int
    in_features: int
    prepared: Any = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        wf = w.to(torch.float32)
        scales = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, w.shape[0], w.shape[1])


def stripped(w, **prepared_fields):
    """A copy of bundle `w` with its canonical tensors dropped, once a backend has its own layout."""
    fields = {"q": None, "scales": None}
    if isinstance(w, Int4Weight):
        fields["zeros"] = None
    return replace(w, **fields, prepared=prepared_fields)
