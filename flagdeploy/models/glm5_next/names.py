"""Checkpoint tensor names: any of the usual prefixes and transformers' in-memory names mapped to the
published checkpoint's form (fused expert and conv tensors split), and which slice of a tensor a slot
takes. Apart because the model's `read_plan` needs them and the loader needs the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from flagdeploy.parallel import Shard

from ..linear import Linear
from ..slots import linear_slots
from .moe import ExpertBank, MoE

_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
# transformers' in-memory names → the checkpoint's (the inverse of its glm5_next conversion mapping)
_RENAMES = [
    (re.compile(r"\.self_attn\.forget_gate\.(f_a_proj|f_b_proj|dt_bias|A_log)"), r".self_attn.\1"),
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
]


# a routed expert's tensor, prefix-free: layer index, expert index
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _canonical(name: str) -> str:
    """A checkpoint or transformers name in real-checkpoint form, prefix-free (tensor-independent part
    of `checkpoint_names`)."""
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for pre in _PREFIXES:
        if name.startswith(pre):
            name = name[len(pre):]
            break
    for pat, rep in _RENAMES:
        name = pat.sub(rep, name)
    return name


def _slot_shard(slot: tuple) -> Shard | None:
    """This rank's slice of the checkpoint tensor a slot takes (None: whole)."""
    if len(slot) == 2:
        return slot[1]
    owner, part, kind = slot
    shard = owner.shards.get(part) if isinstance(owner, Linear) else owner.shard(part[1])
    if kind == "bias" and shard is not None and shard.dim != 0:
        return None  # a row-parallel layer's bias is whole (added once, after the sum)
    return shard


def mla_slots(sa: str, a) -> dict[str, tuple]:
    """`weight_slots` entries of an MlaAttention under `sa` ("layers.i.self_attn."), its DSA indexer
    included; fused parts in the published checkpoint's order (the tiny-checkpoint generator draws its
    random weights in this order)."""
    slots = {**linear_slots(sa, a.latent_proj, ["q_a_proj"]), **linear_slots(sa, a.q_b_proj),
             **linear_slots(sa, a.latent_proj, ["kv_a_proj_with_mqa"]), **linear_slots(sa, a.kv_b_proj),
             **linear_slots(sa, a.o_proj)}
    slots[sa + "q_a_layernorm.weight"] = (a.q_a_norm, None)
    slots[sa + "kv_a_layernorm.weight"] = (a.kv_a_norm, None)
    if a.indexer is not None:
        ix, si = a.indexer, sa + "indexer."
        slots.update(linear_slots(si, ix.wq_b))
        slots.update(linear_slots(si, ix.in_proj, ["wk"]))
        slots.update(linear_slots(si, ix.in_proj, ["weights_proj"]))
        slots[si + "index_kpool_compress_gate"] = (ix.in_proj, "index_kpool_compress_gate", "weight")
        slots[si + "index_kpool_compress_ape"] = (ix.compress_ape, None)
        slots[si + "k_norm.weight"] = (ix.k_norm_weight, None)
        slots[si + "k_norm.bias"] = (ix.k_norm_bias, None)
    return slots


def ffn_slots(sm: str, m) -> dict[str, tuple]:
    """`weight_slots` entries of an FFN under `sm` ("layers.i.mlp."): a MoE (router, this rank's routed
    experts one by one, shared expert) or a dense MLP."""
    if not isinstance(m, MoE):
        return {**linear_slots(sm, m.gate_up_proj), **linear_slots(sm, m.down_proj)}
    slots: dict[str, tuple] = {sm + "gate.weight": (m.router, None),
                               sm + "gate.e_score_correction_bias": (m.correction_bias, None)}
    for e in range(m.experts.first, m.experts.first + m.experts.n):
        for proj in ExpertBank._PARTS:
            slots[f"{sm}experts.{e}.{proj}.weight"] = (m.experts, (e, proj), "weight")
    slots.update(linear_slots(sm + "shared_experts.", m.shared.gate_up_proj))
    slots.update(linear_slots(sm + "shared_experts.", m.shared.down_proj))
    return slots


def checkpoint_names(name: str, tensor) -> Iterable[tuple[str, Any]]:
    """One incoming (name, tensor) in real-checkpoint form, prefix-free; transformers' fused tensors
    (`experts.gate_up_proj`, `conv1d.weight`) are split into the per-expert / per-projection pieces.
    Names of other parts (vision, MTP layer, scales) come back unchanged and are then ignored."""
    name = _canonical(name)
    if name == "lm_head.weight":
        yield name, tensor
        return
    if name.endswith(".mlp.experts.gate_up_proj") and isinstance(tensor, torch.Tensor):
        base = name[: -len("gate_up_proj")]
        for e, w in enumerate(tensor):
            gate, up = w.chunk(2, dim=0)
            yield f"{base}{e}.gate_proj.weight", gate
            yield f"{base}{e}.up_proj.weight", up
    elif name.endswith(".mlp.experts.down_proj") and isinstance(tensor, torch.Tensor):
        base = name[: -len("down_proj")]
        for e, w in enumerate(tensor):
            yield f"{base}{e}.down_proj.weight", w
    elif name.endswith(".self_attn.conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        for proj, w in zip(("q", "k", "v"), tensor.chunk(3, dim=0)):
            yield f"{base}{proj}_conv1d.weight", w
    else:
        yield name, tensor
