"""CUDA overrides. Norms, rope, KV writes and attention come from torch's fused kernels (SDPA picks
FlashAttention for 16-bit inputs), shared with the cpu backend; here: int8 x int8 matmuls through cuBLASLt
(`_int_mm`), weight-only linears on a dense 16-bit copy made once at load (cuBLAS beats dequantising per
call), and MoE experts through one grouped GEMM on Hopper (`_grouped_mm`) instead of a loop per expert, and FP8 block-scaled linears on Hopper's FP8 tensor cores (cuBLASLt block scaling through
`F.scaled_mm`: activations 1x128, weights 128x128, as DeepSeek/GLM checkpoints are quantised).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from flagdeploy.ops import reference
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight, fp8_quant_groups, stripped

log = logging.getLogger(__name__)

_INT_MM_MIN_ROWS = 17  # cuBLASLt's int8 GEMM wants more than 16 rows: decode batches are padded up


def prepare_dense(w: Int4Weight | Int8Weight):
    return stripped(w, dense=w.dequantize(torch.bfloat16))


def linear_w4a16(x, w: Int4Weight, bias=None):
    y = F.linear(x.to(torch.bfloat16), w.prepared["dense"])
    return y + bias.to(y.dtype) if bias is not None else y


linear_w8a16 = linear_w4a16


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    a = reference.a16_dtype(x.dtype)
    qx, sx = reference.dynamic_quant(x.to(a))
    m = qx.shape[0]
    if m < _INT_MM_MIN_ROWS:
        qx = torch.cat([qx, qx.new_zeros(_INT_MM_MIN_ROWS - m, qx.shape[1])])
    acc = torch._int_mm(qx, q.t())[:m]
    return (acc.float() * sx[:, None] * scales.float()).to(a)


def linear_w8a8_dynamic(x, w: W8A8Weight, bias=None):
    if w.in_features % 8 or w.out_features % 8:  # cuBLASLt int8 alignment
        return reference.linear_w8a8_dynamic(x, w, bias)
    y = _int8_mm(x, w.q, w.scales)
    return y + bias.to(y.dtype) if bias is not None else y


def _grouped_ok(x: torch.Tensor, gate_up, down) -> bool:
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and x.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] >= 9
            and all(d % 8 == 0 for d in (*gate_up.shape[1:], *down.shape[1:])))


def moe_experts(x, routing, gate_up, down, limit):
    """Tokens sorted by expert, one grouped GEMM for gate/up and one for down, then weighted back."""
    if not _grouped_ok(x, gate_up, down):
        return OPS["moe_experts"].reference(x, routing, gate_up, down, limit)
    tok, exp = routing.nonzero(as_tuple=True)  # one row per (token, picked expert), sorted by token
    order = exp.argsort(stable=True)
    tok, exp = tok[order], exp[order]
    counts = torch.bincount(exp, minlength=gate_up.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    y = torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(1, 2), offs=offs)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * routing[tok, exp, None].float())
    return out.to(x.dtype)


_FP8_NATIVE = {"ok": hasattr(F, "scaled_mm")}  # cleared, with a log line, if this torch/cuBLAS refuses blockwise FP8


def linear_fp8_block(x, w: Fp8BlockWeight, bias=None):
    """cuBLASLt wants the token count a multiple of 4, the activation scales outer-dim-major and the
    weight scales' K-block count a multiple of 4: pad both (zeros do not change the product)."""
    if not _FP8_NATIVE["ok"] or w.block != (128, 128) or w.in_features % 128 or w.out_features % 128:
        return reference.linear_fp8_block(x, w, bias)
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    qx, sx = fp8_quant_groups(xp, 128)
    s = w.scale_inv.float()
    s = F.pad(s, (0, -s.shape[1] % 4)) if s.shape[1] % 4 else s
    try:
        y = F.scaled_mm(qx, w.q.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128, s.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)[:m]
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.warning("blockwise FP8 GEMM unavailable (%s); linear_fp8_block runs the reference", exc)
        _FP8_NATIVE["ok"] = False
        return reference.linear_fp8_block(x, w, bias)
    return y + bias.to(y.dtype) if bias is not None else y
