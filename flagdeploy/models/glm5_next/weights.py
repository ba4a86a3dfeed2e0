"""Loading glm5_next weights: FP8 block-scaled weights paired with their scales and dequantized (or
kept FP8), then every (name, tensor) put into the model's slots whole or as this rank's slice, with
missing and mismatched tensors named. Apart from the model it fills, which it imports.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch

from flagdeploy.errors import ModelLoadError
from flagdeploy.ops.weights import FP8_DTYPES, Fp8BlockWeight, fp8_block_dequantize

from ..slots import copy_param
from .model import Glm5NextForCausalLM
from .moe import ExpertBank
from .mtp import no_mtp_error
from .names import _slot_shard, checkpoint_names

log = logging.getLogger(__name__)


def dequantize_fp8_blocks(tensors: Iterable[tuple[str, Any]], block: tuple[int, int] = (128, 128), keep: bool = False):
    """Pair each FP8 `<name>.weight` with its `<name>.weight_scale_inv` (one float32 factor per block)
    and yield the weight in float32 (keep: as an Fp8BlockWeight, for FP8 matmuls); everything else
    passes through. Which tensors are FP8 is read from
    their dtype, not from `modules_to_not_convert` (whose matching is prefix/suffix-only upstream).
    A weight waits for its scale (or the reverse) only until the partner arrives, usually the next tensor.
    """
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def apply(w: torch.Tensor, s: torch.Tensor):
        try:
            out = fp8_block_dequantize(w, s, block)
            return Fp8BlockWeight(w, s, tuple(block), w.shape[0], w.shape[1]) if keep and w.dim() == 2 else out
        except ValueError as exc:
            raise ModelLoadError(f"{name}: {exc}; the checkpoint's weight_block_size does not match its scales.") from exc

    for name, t in tensors:
        if name.endswith(".weight_scale_inv"):
            w_name = name[: -len("_scale_inv")]
            if w_name in weights:
                yield w_name, apply(weights.pop(w_name), t)
            else:
                scales[w_name] = t
        elif isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:
            if name in scales:
                yield name, apply(t, scales.pop(name))
            else:
                weights[name] = t
        else:
            yield name, t
    if weights:
        raise ModelLoadError(f"{len(weights)} FP8 weights have no weight_scale_inv, e.g. {sorted(weights)[:3]}")
    if scales:
        raise ModelLoadError(f"{len(scales)} weight_scale_inv tensors have no FP8 weight beside them, e.g. "
                             f"{sorted(scales)[:3]}; the checkpoint's weights were not stored as FP8 or were "
                             f"converted without their scales. Re-download or re-convert it.")


def load_hf_weights(model: Glm5NextForCausalLM, tensors: Iterable[tuple[str, Any]], quantize_head: bool = False,
                    keep_fp8: bool = False, bf16_experts: bool = False) -> None:
    """Put (HF name, tensor) pairs into the model, then finalize it.

    Takes both the published checkpoint's names and transformers' `state_dict()` names (any of the
    usual prefixes); FP8 block-scaled weights are dequantized to the model's dtype on the way in, or with
    keep_fp8 stay FP8 in the linears and expert banks that take them (other tensors are dequantized).
    bf16_experts: dense expert banks whose every value is a bfloat16 number stay bfloat16
    (`ExpertBank.narrow_to_bf16`). A shape mismatch names the tensor and both shapes; missing tensors are named.

    Under TP/EP (the model built with the current parallel layout) each tensor may arrive whole or
    already as this rank's slice (a reader following `read_plan`); tensors of experts other ranks hold
    are dropped unread by the FP8 pairing and unreported.
    """
    slots = model.weight_slots()
    model._plan_slots = slots  # read_plan below looks names up in the same slots
    missing = set(slots)
    skipped: list[str] = []
    mine = ((n, t) for n, t in tensors if model.read_plan(n) != "skip")
    with torch.no_grad():
        for raw_name, raw in dequantize_fp8_blocks(mine, model.cfg.fp8_block or (128, 128), keep_fp8):
            for name, t in checkpoint_names(raw_name, raw):
                slot = slots.get(name)
                if slot is None:
                    if not model._expert_elsewhere(name):  # pieces of transformers' fused expert tensors
                        skipped.append(raw_name)
                    continue
                try:
                    if len(slot) == 2:
                        copy_param(f"{raw_name} ({name})", slot[0], t, slot[1])
                    else:
                        _load_part(raw_name, name, slot, t)
                except ValueError as exc:  # a tensor that is neither the whole one nor this rank's slice
                    msg = str(exc)
                    raise ModelLoadError(msg if msg.startswith("weight ") else f"weight {raw_name} ({name}) {msg}") from exc
                missing.discard(name)
    if model.mtp is not None and f"layers.{model.cfg.num_layers}.eh_proj.weight" in missing:
        raise no_mtp_error(model.cfg.num_layers)  # asked for the draft layer (--speculative mtp), not shipped
    if missing:
        few = ", ".join(sorted(missing, key=_natural)[:5])
        raise ModelLoadError(f"{len(missing)} weights are missing from the checkpoint, e.g. {few}")
    if skipped:  # the MTP draft layer when not asked for: not used by the plain model
        log.info("skipped %d checkpoint tensors the text model does not use, e.g. %s", len(skipped),
                 ", ".join(sorted(skipped, key=_natural)[:3]))
    if bf16_experts:
        for m in model.modules():
            if isinstance(m, ExpertBank):
                m.narrow_to_bf16()
    model.finalize()
    if quantize_head:
        model.lm_head.quantize_int8()


def _load_part(raw_name: str, name: str, slot: tuple, t) -> None:
    """A Linear's / the expert bank's part, whole or this rank's slice (either shape is accepted)."""
    owner, part, kind = slot
    full = owner.part_shape(part) if kind == "weight" else None
    got = tuple(t.shape) if isinstance(t, torch.Tensor) else (t.out_features, t.in_features)
    if full is not None:
        ok = {tuple(full)}
        shard = _slot_shard(slot)
        if shard is not None:
            ok.add(tuple(shard.length if d == shard.dim else n for d, n in enumerate(full)))
        if got not in ok:
            raise ModelLoadError(f"weight {raw_name} ({name}) has shape {got}, the config implies {tuple(full)}")
    owner.load_part(part, kind, t)


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]
