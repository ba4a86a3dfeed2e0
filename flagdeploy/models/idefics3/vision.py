"""Idefics3's (SmolVLM's) image encoder: square image tiles → rows for the text model's embedding
sequence, one row per `<image>` token. Mirrors transformers' `Idefics3VisionTransformer` followed by
`Idefics3Connector` (what `Idefics3Model.get_image_features` returns).

    patch embed   a linear map of each (channels × patch × patch) patch (the conv's kernel is its stride),
                  plus a learned position embedding per patch
    layers        pre-norm ViT layers: LayerNorm, attention among the patches of one tile in both
                  directions (biases on q, k, v, out), LayerNorm, GELU MLP
    connector     post-LayerNorm, then pixel shuffle (each scale × scale block of patches becomes one row,
                  scale² times as wide) and one linear map to the text model's width

Every tile of the processor is image_size × image_size (a large image is cut into tiles plus a global
view, each resized to exactly that), so no tile has padded patches and the position of every patch is
its own grid index. The encoder is small next to the text model; under tensor parallelism it is
replicated (whole tensors in every slot)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flagdeploy import ops

from ..linear import Linear
from ..slots import linear_slots
from .config import SiglipConfig


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _Layer(nn.Module):
    def __init__(self, c: SiglipConfig, dtype: torch.dtype):
        super().__init__()
        h = c.hidden_size
        self.heads, self.eps, self.approximate = c.num_heads, c.layer_norm_eps, c.gelu_approximate
        self.norm1_weight, self.norm1_bias = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.norm2_weight, self.norm2_bias = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.qkv = Linear(3 * h, h, dtype, ("q_proj", "k_proj", "v_proj"), bias=True,
                          part_rows={"q_proj": h, "k_proj": h, "v_proj": h})
        self.out = Linear(h, h, dtype, ("out_proj",), bias=True)
        self.fc1 = Linear(c.intermediate_size, h, dtype, ("fc1",), bias=True)
        self.fc2 = Linear(h, c.intermediate_size, dtype, ("fc2",), bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tiles, patches, hidden]."""
        n, p, h = x.shape
        y = F.layer_norm(x, (h,), self.norm1_weight, self.norm1_bias, self.eps)
        q, k, v = self.qkv(y).view(n, p, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, h)
        x = x + self.out(a)
        y = F.layer_norm(x, (h,), self.norm2_weight, self.norm2_bias, self.eps)
        return x + self.fc2(F.gelu(self.fc1(y), approximate=self.approximate))

    def slots(self, prefix: str) -> dict[str, tuple]:
        s = {prefix + "layer_norm1.weight": (self.norm1_weight, None), prefix + "layer_norm1.bias": (self.norm1_bias, None),
             prefix + "layer_norm2.weight": (self.norm2_weight, None), prefix + "layer_norm2.bias": (self.norm2_bias, None)}
        s.update(linear_slots(prefix + "self_attn.", self.qkv))
        s.update(linear_slots(prefix + "self_attn.", self.out))
        s.update(linear_slots(prefix + "mlp.", self.fc1))
        s.update(linear_slots(prefix + "mlp.", self.fc2))
        return s


class SiglipEncoder(nn.Module):
    """The encoder and the connector; built empty in `dtype`, filled through `weight_slots`, joined by
    the text model's `finalize` (which finalizes every Linear it holds)."""

    def __init__(self, cfg: SiglipConfig, scale_factor: int, text_hidden: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        c = self.cfg = cfg
        self.scale, self.dtype = scale_factor, dtype
        h, p = c.hidden_size, c.patch_size
        self.patch_weight = _param(h, c.num_channels, p, p, dtype=dtype)
        self.patch_bias = _param(h, dtype=dtype)
        self.position_embedding = _param(c.patches_per_side ** 2, h, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(c, dtype) for _ in range(c.num_layers))
        self.post_norm_weight, self.post_norm_bias = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.proj = Linear(text_hidden, h * scale_factor ** 2, dtype, ("proj",))

    def tile_rows(self) -> int:
        """Rows per image tile."""
        return self.cfg.patches_per_side ** 2 // self.scale ** 2

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, channels, image_size, image_size] → [tiles × tile_rows(), text hidden], the
        tiles' rows in order. Tiles never see one another."""
        c, s = self.cfg, self.scale
        n, ch, height, width = pixel_values.shape
        if height != c.image_size or width != c.image_size or ch != c.num_channels:
            raise ValueError(f"image tiles must be {c.num_channels} x {c.image_size} x {c.image_size} (what the "
                             f"model's processor makes), not {ch} x {height} x {width}")
        g, p, h = c.patches_per_side, c.patch_size, c.hidden_size
        patches = pixel_values.to(self.dtype).view(n, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n * g * g, -1)
        x = ops.linear(patches, self.patch_weight.flatten(1), self.patch_bias).view(n, g * g, h)
        x = x + self.position_embedding[self._position_ids(x.device)]
        for layer in self.layers:
            x = layer(x)
        x = F.layer_norm(x, (h,), self.post_norm_weight, self.post_norm_bias, c.layer_norm_eps)
        # pixel shuffle: patch (row r, column col) goes to row (r // s, col // s), at offset
        # ((r % s) * s + col % s) × hidden of it, as transformers' `Idefics3Connector.pixel_shuffle` places it
        x = x.view(n, g // s, s, g // s, s, h).permute(0, 1, 3, 2, 4, 5).reshape(n * (g // s) ** 2, s * s * h)
        return self.proj(x)

    def _position_ids(self, device: torch.device) -> torch.Tensor:
        """Each patch's position-embedding row, computed as transformers computes it for a tile without
        padding (fractional coordinates bucketed in float32): the grid index itself wherever 1 / patches
        per side is exact in binary, and transformers' rounding where it is not."""
        g = self.cfg.patches_per_side
        boundaries = torch.arange(1 / g, 1.0, 1 / g, device=device)
        coords = (torch.arange(g, device=device, dtype=torch.float32) * (1.0 / torch.tensor(float(g), device=device)))
        bucket = torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
        return (bucket[:, None] * g + bucket[None, :]).flatten()

    def weight_slots(self, vision: str = "model.vision_model.", connector: str = "model.connector.") -> dict[str, tuple]:
        """Checkpoint name → slot, as `LlamaForCausalLM.weight_slots` (all whole: replicated)."""
        v = vision
        slots: dict[str, tuple] = {v + "embeddings.patch_embedding.weight": (self.patch_weight, None),
                                   v + "embeddings.patch_embedding.bias": (self.patch_bias, None),
                                   v + "embeddings.position_embedding.weight": (self.position_embedding, None),
                                   v + "post_layernorm.weight": (self.post_norm_weight, None),
                                   v + "post_layernorm.bias": (self.post_norm_bias, None)}
        for i, layer in enumerate(self.layers):
            slots.update(layer.slots(f"{v}encoder.layers.{i}."))
        slots.update(linear_slots(connector + "modality_projection.", self.proj))
        return slots
