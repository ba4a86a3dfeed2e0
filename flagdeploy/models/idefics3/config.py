"""The facts of an Idefics3 checkpoint (SmolVLM): a llama-family text model, a SigLIP vision encoder and
the connector between them, read from the HF `idefics3` config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagdeploy.errors import ModelLoadError

from ..config import ModelConfig, from_hf_config as llama_config

# the activations transformers' SigLIP may name, as torch's GELU flavours
GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass
class SiglipConfig:
    """The vision encoder's facts, with transformers' `Idefics3VisionConfig` defaults for anything a
    config omits."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-6
    gelu_approximate: str = "tanh"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> SiglipConfig:
        aliases = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}
        out = cls()
        for key, value in d.items():
            name = aliases.get(key, key)
            if name in cls.__dataclass_fields__ and value is not None:
                setattr(out, name, value)
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act not in GELU_APPROXIMATE:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported (SigLIP encoders use "
                                 f"{', '.join(GELU_APPROXIMATE)}).")
        out.gelu_approximate = GELU_APPROXIMATE[act]
        for name in ("image_size", "patch_size"):
            if not isinstance(getattr(out, name), int):
                raise ModelLoadError(f"vision {name} {getattr(out, name)!r} must be one number (square patches and "
                                     "images, as Idefics3's processor makes them).")
        if out.image_size % out.patch_size or out.hidden_size % out.num_heads:
            raise ModelLoadError(f"vision image_size {out.image_size} must be a multiple of patch_size "
                                 f"{out.patch_size}, and hidden_size {out.hidden_size} of num_attention_heads "
                                 f"{out.num_heads}.")
        return out

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class Idefics3Config(ModelConfig):
    """The text model's llama-family facts (`architecture` "idefics3"), plus the encoder and connector."""

    vision: SiglipConfig = field(default_factory=SiglipConfig)
    scale_factor: int = 2
    image_token_id: int = 128257

    @property
    def image_seq_len(self) -> int:
        """Rows the connector gives per image tile: the image tokens each tile stands for in the prompt."""
        return self.vision.patches_per_side ** 2 // self.scale_factor ** 2


def from_hf_config(cfg: dict[str, Any]) -> Idefics3Config:
    """From an `idefics3` config.json. The text model must be one the llama family serves."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text.setdefault("rms_norm_eps", 1e-5)  # Idefics3Config's own default for its text model
    base = llama_config(text)
    vision = SiglipConfig.from_hf(cfg.get("vision_config") or {})
    scale = int(cfg.get("scale_factor", 2))
    if vision.patches_per_side % scale:
        raise ModelLoadError(f"scale_factor {scale} must divide the vision encoder's {vision.patches_per_side} "
                             "patches per side (the connector folds scale x scale patches into one row).")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    fields = {**base.__dict__, "architecture": "idefics3", "tie_word_embeddings": bool(tie),
              "source_model_type": "idefics3"}
    return Idefics3Config(**fields, vision=vision, scale_factor=scale,
                          image_token_id=int(cfg.get("image_token_id", 128257)))
