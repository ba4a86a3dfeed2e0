"""Model families written against flagdeploy.ops, keyed by the family name in ModelConfig."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .llama import load_hf_weights as _llama_weights

FAMILIES = {"llama": (LlamaForCausalLM, _llama_weights)}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str):
    cls, _ = FAMILIES[cfg.architecture]
    with torch.device(device):
        return cls(cfg, dtype).eval()


def load_weights(model, tensors, quantize_head: bool = False) -> None:
    FAMILIES[model.cfg.architecture][1](model, tensors, quantize_head)
