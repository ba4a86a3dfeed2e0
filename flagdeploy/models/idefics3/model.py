"""Idefics3 (SmolVLM): the llama family's text model with a SigLIP image encoder in front of it.

The text model is `LlamaForCausalLM` unchanged (paged k/v, CUDA graphs and torch.compile for decode
steps, tensor parallelism); what this adds is the encoder (`encode_media`, run by the engine's encoder
cache) and, in a step that computes prompt positions of an image, its rows in place of those positions'
token embeddings (the llama family's `forward(embeds=...)`). Checkpoint names are transformers': `model.text_model.*`
for the text model, `model.vision_model.*` and `model.connector.*` for the encoder, `lm_head.weight`.
"""

from __future__ import annotations

import torch

from ..llama import LlamaForCausalLM, load_hf_weights
from .config import Idefics3Config, from_hf_config
from .vision import SiglipEncoder

_TEXT = "model.text_model."
# patches the encoder runs at once (whole tiles; a SmolVLM tile is 1,024): tiles never see one another, so
# a request of many images is encoded in pieces with the same rows, and the activation peak is bounded
ENCODER_CHUNK_PATCHES = 32768


def encoder_activation_bytes(hf_config: dict, dtype_bytes: int = 2) -> int:
    """The encoder's activation peak on ENCODER_CHUNK_PATCHES patches (what the planner reserves beside
    the text model's): inside a layer the residual, its norm and either q, k, v and the attention output or
    the MLP's two intermediate tensors."""
    v = from_hf_config(hf_config).vision
    per_tile = v.patches_per_side ** 2
    patches = max(1, ENCODER_CHUNK_PATCHES // per_tile) * per_tile
    return patches * max(6 * v.hidden_size, 2 * v.hidden_size + 2 * v.intermediate_size) * dtype_bytes


class Idefics3ForCausalLM(LlamaForCausalLM):
    input_modalities = ("text", "image")

    def __init__(self, cfg: Idefics3Config, dtype: torch.dtype = torch.float32):
        super().__init__(cfg, dtype)
        self.vision = SiglipEncoder(cfg.vision, cfg.scale_factor, cfg.hidden_size, dtype)

    def weight_slots(self) -> dict[str, tuple]:
        """The llama family's slots under transformers' `model.text_model.` (the head stays `lm_head`),
        then the encoder's."""
        slots = {(name if name == "lm_head.weight" else _TEXT + name.removeprefix("model.")): slot
                 for name, slot in super().weight_slots().items()}
        slots.update(self.vision.weight_slots())
        return slots

    def encode_media(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The engine's encoder-cache call: rows for the items whose tiles are concatenated in
        `pixel_values` ([tiles, 3, S, S]); `grid` ([items, 3]: tiles, rows, columns) is the processor's
        layout, which the rows do not depend on beyond the tile count."""
        if int(grid[:, 0].sum()) != pixel_values.shape[0]:
            raise ValueError(f"the items' grids count {int(grid[:, 0].sum())} tiles, the pixels hold {pixel_values.shape[0]}")
        per_chunk = max(1, ENCODER_CHUNK_PATCHES // self.cfg.vision.patches_per_side ** 2)
        return torch.cat([self.vision(tiles) for tiles in pixel_values.split(per_chunk)]).to(self.dtype)


__all__ = ["Idefics3ForCausalLM", "load_hf_weights"]
