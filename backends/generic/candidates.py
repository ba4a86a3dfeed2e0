"""The candidates of each hot op on the generic backend: FlagGems' kernel, the vendor's torch op, the reference.

Each candidate takes the op's own signature (flagdeploy.ops.reference) and maps it to the library's. The
FlagGems adapters follow its documented 5.0.2 signatures (docs/flaggems-and-vendors.md); `flag_gems` is
imported on first use only, here and nowhere else in flagdeploy, because it refuses to import on a host
without an accelerator. A candidate that cannot run (no FlagGems, a shape it does not take) raises: the
tuner records it as failed and it is never chosen.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from flagdeploy.ops import fused
from flagdeploy.ops.registry import OPS

_gems = None


def gems():
    """The `flag_gems` module, imported on first use (ImportError / RuntimeError where it cannot be)."""
    global _gems
    if _gems is None:
        _gems = importlib.import_module("flag_gems")
    return _gems


def reset() -> None:
    """Forget the imported module (tests swap a stand-in in and out)."""
    global _gems
    _gems = None


def gems_version() -> str | None:
    try:
        return str(getattr(gems(), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - absent or refusing: no version to record
        return None


# ---- FlagGems adapters: our signatures -> FlagGems' -------------------------------------------------------


def g_rms_norm(x, weight, eps):
    return gems().rms_norm(x, [x.shape[-1]], weight, eps)


def g_add_rms_norm(x, residual, weight, eps):
    # fused_add_rms_norm writes both inputs in place (after .contiguous()); the op leaves its inputs alone
    normed, h = gems().fused_add_rms_norm(x.clone(), residual.clone(), [x.shape[-1]], weight, eps)
    return normed, h


def g_swiglu(gate_up, limit=None):
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gems().silu_and_mul(gate, up)  # two tensors, not vLLM's packed [..., 2d]


def g_rope(q, k, cos, sin):
    # our cos/sin are already gathered per token ([T, D/2]): positions 0..T-1 index them as they are
    positions = torch.arange(q.shape[0], device=q.device)
    return gems().apply_rotary_pos_emb(q, k, cos, sin, positions, rotary_interleaved=False, inplace=False)


def g_write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    one = torch.ones((), dtype=torch.float32, device=k.device)
    gems().reshape_and_cache_flash(k, v, k_cache, v_cache, slot_mapping.long(), "auto", one, one)


def g_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    max_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    if k.stride() != v.stride():  # it asserts equal strides: the engine's k is roped, v a view of the fused qkv
        k, v = k.contiguous(), v.contiguous()
    return gems().flash_attn_varlen_func(q, k, v, max_q, cu_seqlens_q.int(), max_k, cu_seqlens_k=cu_seqlens_k.int(),
                                         softmax_scale=scale, causal=True)


def g_paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    b = q.shape[0]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    max_k = block_tables.shape[1] * k_cache.shape[1]  # a bound known without reading the lengths back
    return gems().flash_attn_varlen_func(q, k_cache, v_cache, 1, cu_q, max_k, seqused_k=context_lens.int(),
                                         softmax_scale=scale, causal=True, block_table=block_tables.int())


def g_argmax(logits):
    return gems().argmax(logits, dim=-1, keepdim=False)


def g_embedding(ids, table):
    return gems().embedding(table, ids)


def g_linear(x, weight, bias=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = gems().mm(x2, weight.t()) if bias is None else gems().addmm(bias, x2, weight.t())
    return y.reshape(*x.shape[:-1], weight.shape[0])


def g_moe_experts(x, routing, gate_up, down, limit, top_k=None):
    dense = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dtype == x.dtype
    if limit is not None or not dense:  # FlagGems' fused experts have no SwiGLU clamp and no such banks
        return OPS["moe_experts"].reference(x, routing, gate_up, down, limit, top_k)
    k = top_k or int((routing != 0).sum(-1).max())
    weights, ids = routing.float().topk(k, dim=-1)
    return gems().outplace_fused_experts(x, gate_up, down, weights, ids.int())


# ---- the vendor's torch ops (what the device's torch build runs natively) ---------------------------------


def t_moe_experts(x, routing, gate_up, down, limit, top_k=None):
    """Every expert on every token, weighted by the routing (zero for the experts a token did not pick): no
    read-back to the host, so a captured decode step can hold it; memory T x E x 2I."""
    dense = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dtype == x.dtype
    if not dense:
        return OPS["moe_experts"].reference(x, routing, gate_up, down, limit, top_k)
    gate, up = torch.einsum("th,enh->ten", x, gate_up).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down)
    return (y * routing.to(y.dtype).unsqueeze(-1)).sum(1)


def t_argmax(logits):
    return torch.argmax(logits, dim=-1)


def t_embedding(ids, table):
    return F.embedding(ids, table)


def t_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


# op -> candidate name -> implementation; "reference" is added for every op. Order is the tie order.
CANDIDATES: dict[str, dict[str, Callable]] = {
    "rms_norm": {"flaggems": g_rms_norm, "torch": fused.rms_norm},
    "add_rms_norm": {"flaggems": g_add_rms_norm, "torch": fused.add_rms_norm},
    "swiglu": {"flaggems": g_swiglu},
    "rope": {"flaggems": g_rope, "torch": fused.rope},
    "write_kv_cache": {"flaggems": g_write_kv_cache, "torch": fused.write_kv_cache},
    "attention_prefill": {"flaggems": g_attention_prefill, "torch": fused.attention_prefill},
    "paged_attention_decode": {"flaggems": g_paged_attention_decode, "torch": fused.paged_attention_decode},
    "argmax": {"flaggems": g_argmax, "torch": t_argmax},
    "embedding": {"flaggems": g_embedding, "torch": t_embedding},
    "linear": {"flaggems": g_linear, "torch": t_linear},
    "moe_experts": {"flaggems": g_moe_experts, "torch": t_moe_experts},
}


def candidates(op: str) -> dict[str, Callable]:
    """Every candidate of `op`, the reference last."""
    return {**CANDIDATES.get(op, {}), "reference": OPS[op].reference}
