"""Quantized weight bundles in their canonical (chip-neutral) layout.

A backend that runs an op natively may `prepare` a bundle into its own layout at load time (packed
int4 tiles on the CPU, NZ fractal format on Ascend) and keeps whatever it needs in `prepared`; the
reference implementations only read the canonical fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

# FP8 storage types (checkpoints keep FP8 weights with block scales beside them); the tuple is empty
# on a torch without FP8 dtypes.
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_to_float(w: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 tensor `w`. torch's own e4m3 cast is scalar code on the CPU (~0.5 G
    values/s); e4m3fn bits re-read as float16 (sign, then the 7 exponent+mantissa bits shifted into
    place) and scaled by 2^8 give the same value for every finite e4m3fn number, subnormals included,
    at ~3x the speed. (0x7F/0xFF, e4m3fn's NaN, would come out as +-480: checkpoints hold no NaN.)"""
    if w.dtype != getattr(torch, "float8_e4m3fn", None) or w.device.type != "cpu":
        return w.to(torch.float32, copy=True)  # always a new tensor: callers scale it in place
    bits = (w.view(torch.int8).to(torch.int16) << 7) & -16385  # sign-extended, then clear bit 14 (0xBFFF)
    return bits.view(torch.float16).float().mul_(256.0)


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight [..., R, C] from FP8 values and one inverse scale per (rows, cols) block, partial
    edge blocks included; the scales are broadcast in place, never repeated into a weight-sized tensor."""
    *lead, rows, cols = w.shape
    br, bc = block
    sr, sc = scale_inv.shape[-2:]
    if (sr, sc) != (-(-rows // br), -(-cols // bc)):
        raise ValueError(f"inverse scales of shape {(sr, sc)} do not cover a {(rows, cols)} weight in {block} blocks")
    if (rows, cols) == (sr * br, sc * bc):  # whole blocks: no padded copy
        out = fp8_to_float(w)
    else:
        out = torch.zeros(*lead, sr * br, sc * bc, dtype=torch.float32, device=w.device)
        out[..., :rows, :cols] = fp8_to_float(w)
    out.view(*lead, sr, br, sc, bc).mul_(scale_inv.float()[..., :, None, :, None])
    return out[..., :rows, :cols]


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 inverse scale per block) with each block's absmax mapped to 448."""
    rows, cols = w.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block[0], bc, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


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
    """Symmetric int8 weights, used weight-only (W8A16): w[n, k] = q[n, k] * scales[n] per output channel
    (group_size 0), or q[n, k] * scales[n, k // G] per group of G input channels.

    A bank of experts is the same bundle with a leading expert dim on q and scales (q [E, N, K]);
    `expert(e)` is one of them. out_features / in_features are N and K either way.
    """

    q: torch.Tensor | None  # [N, K] (or [E, N, K]) int8
    scales: torch.Tensor | None  # [N] or [N, K // G] (or with a leading E) float32
    out_features: int
    in_features: int
    prepared: Any = None
    group_size: int = 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.scales.to(torch.float32)
        s = s.repeat_interleave(self.group_size, dim=-1) if self.group_size else s[..., None]
        return (self.q.to(torch.float32) * s).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = 0):
        """Round-to-nearest with scale = absmax / 127 per channel (or per group): no calibration needed."""
        wf = w.to(torch.float32)
        if group_size:
            if wf.shape[-1] % group_size:
                raise ValueError(f"in_features {wf.shape[-1]} is not a multiple of the group size {group_size}")
            groups = wf.unflatten(-1, (-1, group_size))
            scales = groups.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
            q = torch.round(groups / scales[..., None]).clamp(-127, 127).flatten(-2)
        else:
            scales = wf.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
            q = torch.round(wf / scales[..., None]).clamp(-127, 127)
        return cls(q.to(torch.int8), scales, w.shape[-2], w.shape[-1], group_size=group_size)

    @classmethod
    def cat(cls, parts: list["Int8Weight"]):
        """Fuse along the output dim (q/k/v into qkv, gate/up into gate_up); all parts share one layout."""
        if len({(type(p), p.group_size) for p in parts}) != 1:
            raise ValueError("fused int8 parts must share one scheme and group size")
        return cls(torch.cat([p.q for p in parts], dim=-2), torch.cat([p.scales for p in parts], dim=-2 if parts[0].group_size else -1),
                   sum(p.out_features for p in parts), parts[0].in_features, group_size=parts[0].group_size)

    @classmethod
    def stack(cls, experts: list["Int8Weight"]):
        """A bank of experts from one bundle per expert."""
        return replace(experts[0], q=torch.stack([e.q for e in experts]), scales=torch.stack([e.scales for e in experts]),
                       prepared=None)

    def expert(self, e: int):
        return replace(self, q=self.q[e], scales=self.scales[e], prepared=None)


@dataclass
class PiecewiseWeight:
    """A fused linear (qkv, gate_up) whose parts came in different quantized layouts: a GGUF Q4_K_M's Q4_K q and k
    beside its Q6_K v. Each run of parts that share a layout is one bundle (a piece), run by its own kernel, the
    pieces' outputs side by side in part order. Joined into one int8 weight instead, the 4-bit parts took twice their
    bytes and every part a second rounding; each piece here is exactly as the file holds it."""

    pieces: list  # Int4Weight / Int8Weight bundles, in row order

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.pieces)

    @property
    def in_features(self) -> int:
        return self.pieces[0].in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.pieces])


@dataclass
class W8A8Weight(Int8Weight):
    """Per-output-channel int8 weights whose linear also quantises its activations to int8, per token
    at run time (W8A8 dynamic: Ascend's `npu_dynamic_quant` + `npu_quant_matmul`). Same storage as
    Int8Weight with group_size 0; the type is what selects the integer-arithmetic op."""

    def __post_init__(self):
        if self.group_size:
            raise ValueError("W8A8 dynamic weights are per output channel (group_size 0)")


def to_device(x, device):
    """A tensor, or a weight bundle with its tensors, on `device` (loaders read onto the CPU)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return replace(x, **{f.name: getattr(x, f.name).to(device) for f in fields(x)
                         if isinstance(getattr(x, f.name), torch.Tensor)})


def stripped(w, **prepared_fields):
    """A copy of bundle `w` with its canonical tensors dropped, once a backend has its own layout."""
    fields = {"q": None, "scales": None}  # the bundle keeps its type, shape and group size
    if isinstance(w, Int4Weight):
        fields["zeros"] = None
    return replace(w, **fields, prepared=prepared_fields)


@dataclass
class Fp8BlockWeight:
    """FP8 e4m3 weights with one float32 inverse scale per (rows, cols) block: a published FP8 checkpoint
    kept as stored, for chips whose matrix unit takes FP8 (Hopper, Ascend 950)."""

    q: torch.Tensor | None  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor | None  # [ceil(N / block[0]), ceil(K / block[1])] float32
    block: tuple[int, int]
    out_features: int
    in_features: int
    prepared: Any = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp8_block_dequantize(self.q, self.scale_inv, self.block).to(dtype)

    @classmethod
    def cat(cls, parts: list["Fp8BlockWeight"]) -> "Fp8BlockWeight":
        """Fuse along the output dim; each part must end on a block boundary for the scale grid to stack."""
        if any(p.out_features % p.block[0] or p.block != parts[0].block for p in parts[:-1]):
            raise ValueError("FP8 parts that do not end on a scale-block boundary cannot be fused")
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale_inv for p in parts]), parts[0].block,
                   sum(p.out_features for p in parts), parts[0].in_features)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> "Fp8BlockWeight":
        """Per block of `w` ([N, K], or a bank [E, N, K]) the absmax at e4m3's largest value."""
        if w.dim() == 3:
            return cls.stack([cls.quantize(x, block) for x in w])
        q, s = fp8_block_quantize(w.float(), block)
        return cls(q, s, tuple(block), w.shape[-2], w.shape[-1])

    @classmethod
    def stack(cls, experts: list["Fp8BlockWeight"]) -> "Fp8BlockWeight":
        """A bank of experts (q [E, N, K], scales [E, N / b0, K / b1]) from one bundle per expert."""
        if len({(e.block, e.q.shape) for e in experts}) != 1:
            raise ValueError("FP8 experts of different shapes or scale blocks cannot form one bank")
        return replace(experts[0], q=torch.stack([e.q for e in experts]),
                       scale_inv=torch.stack([e.scale_inv for e in experts]), prepared=None)

    def expert(self, e: int) -> "Fp8BlockWeight":
        return replace(self, q=self.q[e], scale_inv=self.scale_inv[e], prepared=None)


def fp8_quant_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations to e4m3 per token and group of `group` input channels (DeepSeek-style dynamic
    quantisation): (q [T, K], scale float32 [T, ceil(K / group)]) with each group's absmax at 448."""
    t, k = x.shape
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(t, -1, group)
    scale = (xf.abs().amax(-1) / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (xf / scale[..., None]).view(t, -1)[:, :k].to(torch.float8_e4m3fn)
    return q, scale
