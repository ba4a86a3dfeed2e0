"""Model families written against flagdeploy.ops, keyed by the family name in their config.

Two kinds of model meet the engine. Paged models (llama) keep per-token k/v in the engine's block
pool. Sequence-state models (glm5_next) keep their per-token rows (MLA latent, indexer keys) in block
pools too, but also a fixed-size state (KDA conv + recurrent) in one row of state pools per running
sequence (`cache_pools`, `engine_cache`); the engine gives the row back on finish, abort or preemption,
and such models do not resume from the prefix cache. Outside the engine they run on a standalone cache
(`new_cache()`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from . import glm5_next, idefics3
from .config import ModelConfig, from_hf_config
from .llama import LlamaForCausalLM
from .llama import load_hf_weights as _llama_weights

FAMILIES = {
    "llama": (LlamaForCausalLM, _llama_weights),
    "glm5_next": (glm5_next.Glm5NextForCausalLM, glm5_next.load_hf_weights),
    "idefics3": (idefics3.Idefics3ForCausalLM, idefics3.load_hf_weights),
}

# HF model_type → config parser; everything else is tried as the llama family (which names what it
# does not support).
_CONFIG_PARSERS = {"glm5_next": glm5_next.from_hf_config, "glm5_next_text": glm5_next.from_hf_config,
                   "idefics3": idefics3.from_hf_config}


def config_from_hf(cfg: dict[str, Any]):
    return _CONFIG_PARSERS.get(cfg.get("model_type", ""), from_hf_config)(cfg)


def build_model(cfg, dtype: torch.dtype, device: str):
    cls, _ = FAMILIES[cfg.architecture]
    with torch.device(device):
        return cls(cfg, dtype).eval()


def load_weights(model, tensors, quantize_head: bool = False, keep_fp8: bool = False,
                 bf16_experts: bool = False) -> None:
    """keep_fp8: FP8 block-scaled linears stay FP8 (for a backend that runs `linear_fp8_block`);
    bf16_experts: expert banks whose values are all bfloat16 numbers stay bfloat16 (see `ExpertBank`)."""
    FAMILIES[model.cfg.architecture][1](model, tensors, quantize_head, keep_fp8, bf16_experts)


def has_sequence_state(model) -> bool:
    return hasattr(model, "new_cache")


# family → its media processor (images and video → the encoder's pixels and the prompt's placeholder
# text), "module:class" imported only when a model with an encoder is served (it needs transformers)
MEDIA_PROCESSORS = {"glm5_next": "flagdeploy.models.glm5_next.processor:Glm5MediaProcessor",
                    "idefics3": "flagdeploy.models.idefics3.processor:Idefics3MediaProcessor"}


# HF model_type → its vision encoder's activation peak from config.json (the planner's ledger line)
_ENCODER_PEAKS = {"glm5_next": lambda cfg: glm5_next.model.encoder_activation_bytes(cfg["vision_config"]),
                  "idefics3": lambda cfg: idefics3.model.encoder_activation_bytes(cfg)}


def encoder_activation_bytes(hf_config: dict[str, Any]) -> int:
    """What a multimodal checkpoint's vision encoder needs for activations at its peak; 0 for text only."""
    peak = _ENCODER_PEAKS.get(hf_config.get("model_type", ""))
    return peak(hf_config) if peak is not None and hf_config.get("vision_config") else 0


def media_processor(model, path: Path, hf_config: dict[str, Any]):
    """The processor for `model`'s media input, from its checkpoint directory; None for a text-only model."""
    if "image" not in getattr(model, "input_modalities", ()):
        return None
    module, name = MEDIA_PROCESSORS[model.cfg.architecture].split(":")
    return getattr(importlib.import_module(module), name).from_checkpoint(path, hf_config)


__all__ = ["FAMILIES", "ModelConfig", "build_model", "config_from_hf", "encoder_activation_bytes", "has_sequence_state",
           "load_weights", "media_processor"]
