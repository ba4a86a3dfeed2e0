"""GLM-5.3-Flash's vision tower: pixels of images and video frames → rows for the text model's
embedding sequence, one row per image placeholder token. Mirrors transformers' `Glm5NextVisionModel`
(with `Glm5NextModel.get_image_features` / `get_video_features`, whose output this is).

    patch embed   a linear map of each (channels × 2 frames × 14 × 14) patch, flattened by the processor
    blocks        pre-norm ViT blocks: RMSNorm; qkv with per-head RMSNorm on q and k and a 2-D rotary
                  embedding (half the rotated pairs turn with the patch's row, half with its column);
                  attention among the patches of one frame only, in both directions; clamped SwiGLU
    merge         RMSNorm, then each 2 × 2 block of neighbouring patches (adjacent rows: the processor
                  orders patches block by block) becomes one row of the text model's width, followed by
                  the merger (linear, LayerNorm, GELU, clamped SwiGLU)

A video is the same as its frames (temporal pairs, `t` in grid_thw) given as separate images: frames
never attend to each other, and every frame gets the same positions. The tower is small next to the
text model and is replicated under tensor parallelism (whole tensors in every slot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flagdeploy import ops
from flagdeploy.errors import ModelLoadError

from ..linear import Linear
from .common import _lin, _param
from ..slots import linear_slots

log = logging.getLogger(__name__)


@dataclass
class Glm5VisionConfig:
    """The vision tower's facts, with transformers' `Glm5NextVisionConfig` defaults for anything a
    config omits (the published one is written with them)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536  # the text model's hidden size: the merger's output width
    projection_intermediate_size: int = 10240
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    attention_bias: bool = True
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Glm5VisionConfig:
        """From the `vision_config` dict of an HF `glm5_next` config. Refuses what transformers' forward
        would compute differently from this tower (another activation or rope type, head sizes the
        2-D rotary embedding cannot split)."""
        out = cls()
        aliases = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}  # transformers' attribute_map
        for key, value in d.items():
            name = aliases.get(key, key)
            if name in cls.__dataclass_fields__ and value is not None:
                setattr(out, name, value)
        rope = d.get("rope_parameters") or {}
        out.rope_theta = float(rope.get("rope_theta", d.get("rope_theta", out.rope_theta)))
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"vision hidden_act {d['hidden_act']!r} is not supported (GLM-5.3-Flash uses silu).")
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"vision rope_type {rope['rope_type']!r} is not supported (GLM-5.3-Flash uses axial).")
        if out.hidden_size % out.num_heads or (out.hidden_size // out.num_heads) % 4:
            raise ModelLoadError(f"vision hidden_size {out.hidden_size} over {out.num_heads} heads must give a head "
                                 "size divisible by 4 (rows and columns each rotate half of each head).")
        return out


# each item's (first patch row, frames, patches per frame): the groups attention stays within
_Frames = list[tuple[int, int, int]]


def _gate_up(inter: int, in_f: int, dtype: torch.dtype, bias: bool = False) -> Linear:
    return Linear(2 * inter, in_f, dtype, ("gate_proj", "up_proj"), bias=bias,
                  part_rows={"gate_proj": inter, "up_proj": inter})


class _Qkv(Linear):
    """The fused qkv projection, its output rows regrouped by head once the weight is joined: [q, k, v] of
    head 0, then of head 1, ... instead of all q heads, all k heads, all v heads. Each output element is the
    same dot product either way; what changes is where it lands: the q rows (and the k rows) of all patches
    and heads are then one evenly strided run of [head_dim] vectors, which the per-head RMS norms read in
    place, where the checkpoint's order made `ops.rms_norm` copy q and k out first. Quantized weights are
    left in the checkpoint's order (`interleaved` False)."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype, bias: bool):
        super().__init__(3 * hidden, hidden, dtype, ("qkv",), bias=bias)
        self.heads = heads
        self.interleaved = False  # set once the dense weight is regrouped

    def finalize(self) -> None:
        # regrouped before `Linear.finalize`, so that the backend lays out (`prepare_weight`) the final order
        w = self._pending.get(("qkv", "weight"))
        if isinstance(w, torch.Tensor) and w.shape[0] == self.out_features:
            for kind in ("weight", "bias"):
                t = self._pending.get(("qkv", kind))
                if t is not None:
                    self._pending[("qkv", kind)] = t.reshape(3, self.heads, -1).transpose(0, 1).reshape(t.shape)
            self.interleaved = True
        super().finalize()


class _Block(nn.Module):
    def __init__(self, c: Glm5VisionConfig, dtype: torch.dtype):
        super().__init__()
        h, i, b = c.hidden_size, c.intermediate_size, c.attention_bias
        self.heads, self.eps, self.limit = c.num_heads, c.rms_norm_eps, c.swiglu_limit
        self.norm1 = _param(h, dtype=dtype)
        self.norm2 = _param(h, dtype=dtype)
        self.qkv = _Qkv(h, c.num_heads, dtype, b)
        self.q_norm = _param(h // c.num_heads, dtype=dtype)
        self.k_norm = _param(h // c.num_heads, dtype=dtype)
        self.proj = _lin(h, h, dtype, "proj", bias=b)
        self.gate_up = _gate_up(i, h, dtype, bias=b)
        self.down = _lin(h, i, dtype, "down_proj", bias=b)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: _Frames,
                next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream after this block, its RMS norm by `next_norm`) from (the stream before it, its
        norm by `norm1`): each residual add is fused with the norm that follows it (`ops.add_rms_norm`, one
        pass where an add and a norm were two), the next block's `norm1` (or the post-norm) included."""
        a = self._attention(normed, cos, sin, frames)
        normed, x = ops.add_rms_norm(a, x, self.norm2, self.eps)
        m = self.down(ops.swiglu(self.gate_up(normed), self.limit))
        normed, x = ops.add_rms_norm(m, x, next_norm, self.eps)
        return x, normed

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: _Frames) -> torch.Tensor:
        """Bidirectional attention within each frame. `ops.attention_prefill` is causal (it is the text
        model's), so this calls torch's SDPA directly: once per item, its frames (all of one length)
        as the batch, which keeps a long video to one call instead of one per frame. q, k and v go in as
        strided [frames, heads, patches, head_dim] views of [patches, heads, head_dim] rows (the layout
        SDPA's fast kernels take as it is); a lone item's output is used in place."""
        n = x.shape[0]
        if self.qkv.interleaved:
            q, k, v = self.qkv(x).view(n, self.heads, 3, -1).unbind(2)
        else:
            q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = ops.rope(ops.rms_norm(q, self.q_norm, self.eps), ops.rms_norm(k, self.k_norm, self.eps), cos, sin)
        outs = []
        for start, t, per_frame in frames:
            rows = slice(start, start + t * per_frame)
            qs, ks, vs = (z[rows].view(t, per_frame, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(t * per_frame, -1))
        return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))


class Glm5VisionTower(nn.Module):
    """Built empty in `dtype`; fill every `weight_slots` entry, `finalize`, then call it.

    On a GPU the blocks are a few hundred kernels a forward, and launching them from Python costs about
    as long as running them (H200: ~17 ms of kernels, 10-40 ms of host time by the host's speed). So
    when one input layout (the items' frames and patch counts) comes twice in a row, the blocks are
    captured as one CUDA graph and replayed from then on while the layout stays the same: a video
    read in equal chunks, a stream of images of one size. One graph at a time (its memory pool holds
    one forward's block activations, what an eager forward peaks at); a new layout runs eagerly and
    drops it. `cuda_graphs = False` (on the class or an instance) turns this off; the CPU never graphs."""

    cuda_graphs = True

    def __init__(self, cfg: Glm5VisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        c = self.cfg = cfg
        self.dtype = dtype
        h, m, d = c.hidden_size, c.spatial_merge_size, c.out_hidden_size
        # the two convolutions' kernels equal their strides: linear maps of flattened patches, kept in the
        # checkpoint's conv layout and read as [out, in] matrices
        self.patch_weight = _param(h, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size, dtype=dtype)
        self.patch_bias = _param(h, dtype=dtype)
        self.blocks = nn.ModuleList(_Block(c, dtype) for _ in range(c.depth))
        self.post_norm = _param(h, dtype=dtype)
        self.downsample_weight = _param(d, h, m, m, dtype=dtype)
        self.downsample_bias = _param(d, dtype=dtype)
        self.merger_proj = _lin(d, d, dtype, "proj")
        self.merger_norm_weight = _param(d, dtype=dtype)
        self.merger_norm_bias = _param(d, dtype=dtype)
        p = c.projection_intermediate_size
        self.merger_gate_up = _gate_up(p, d, dtype)
        self.merger_down = _lin(d, p, dtype, "down_proj")
        self._graph: tuple | None = None  # (layout, graph, its static inputs x/cos/sin, its output)
        self._last_layout: tuple | None = None  # the layout of the last eager forward on the GPU

    def item_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Rows of `forward`'s output per item (image or video), in order: its placeholder tokens in the
        prompt, and the split that gives each item's features (`features.split(item_tokens(grid_thw))`)."""
        return [t * h * w // self.cfg.spatial_merge_size ** 2 for t, h, w in grid_thw.tolist()]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Features [sum(item_tokens(grid_thw)), out_hidden_size] of the items of `grid_thw` ([items, 3]:
        temporal pairs, patch rows, patch columns), their patches packed in `pixel_values` [patches,
        channels * temporal_patch_size * patch_size²] as the image and video processors lay them out.
        Items never see one another: each one's rows are what it alone would give (up to rounding)."""
        c, m = self.cfg, self.cfg.spatial_merge_size
        x = ops.linear(pixel_values.to(self.dtype), self.patch_weight.flatten(1), self.patch_bias)
        cos, sin, frames = self._rotary(grid_thw, x.device)
        x = self._blocks_on_device(x, cos, sin, frames) if x.is_cuda else self._blocks(x, cos, sin, frames)
        # each merge block's m² rows, channel-major, as the downsample conv's [out, channels, m, m] reads them
        x = x.view(-1, m * m, c.hidden_size).transpose(1, 2).reshape(-1, m * m * c.hidden_size)
        x = self.merger_proj(ops.linear(x, self.downsample_weight.flatten(1), self.downsample_bias))
        x = F.gelu(F.layer_norm(x, (c.out_hidden_size,), self.merger_norm_weight, self.merger_norm_bias, 1e-5))
        return self.merger_down(ops.swiglu(self.merger_gate_up(x), c.swiglu_limit))

    def _blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: _Frames) -> torch.Tensor:
        """The blocks, then the post-norm. The stream and its norm travel together: each block's last
        residual add is fused with the norm after it."""
        norms = [b.norm1 for b in self.blocks[1:]] + [self.post_norm]
        normed = ops.rms_norm(x, self.blocks[0].norm1 if len(self.blocks) else self.post_norm, self.cfg.rms_norm_eps)
        for block, next_norm in zip(self.blocks, norms):
            x, normed = block(x, normed, cos, sin, frames, next_norm)
        return normed

    def _blocks_on_device(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: _Frames) -> torch.Tensor:
        """`_blocks` as a replayed CUDA graph where this layout came last time too (see the class); the
        graph's output is its own buffer, read by the merger before any later replay (stream order)."""
        if not self.cuda_graphs:
            return self._blocks(x, cos, sin, frames)
        layout = (tuple(frames), tuple(x.shape), x.dtype, x.device)
        graph = self._graph
        if graph is not None and graph[0] == layout:
            _, g, (xs, cs, ss), out = graph
            xs.copy_(x)
            cs.copy_(cos)
            ss.copy_(sin)
            g.replay()
            return out
        self._graph = None  # another layout: the graph's pool goes
        if layout != self._last_layout:
            self._last_layout = layout
            return self._blocks(x, cos, sin, frames)
        from flagdeploy.engine.cuda_graphs import capture

        static = (x.clone(), cos.clone(), sin.clone())
        try:
            g, out = capture(lambda: self._blocks(*static, frames), None)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # no graph: eager from now on
            log.warning("vision tower: CUDA graph capture failed (%s); the blocks run eagerly", exc)
            self.cuda_graphs = False
            return self._blocks(x, cos, sin, frames)
        self._graph = (layout, g, static, out)
        g.replay()
        return out

    def _rotary(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, _Frames]:
        """cos/sin [patches, head_dim / 2] (float32) of every patch's (row, column), and each item's (first
        row, frames, patches per frame). Patches come in merge blocks of m × m, block after block along
        the rows of blocks, so patch k of a frame sits in block k // m² at offset k % m² within it."""
        c, m = self.cfg, self.cfg.spatial_merge_size
        # transformers' inverse frequencies, computed as it does (float32), so the angles match bitwise
        half = c.hidden_size // c.num_heads // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
        angles, frames, start = [], [], 0
        for t, h, w in grid_thw.tolist():
            k = torch.arange(h * w, device=device)
            block, r = k // (m * m), k % (m * m)
            pos = torch.stack([block // (w // m) * m + r // m, block % (w // m) * m + r % m], dim=-1)
            angles.append((pos.float()[..., None] * inv_freq).flatten(1).repeat(t, 1))
            frames.append((start, t, h * w))
            start += t * h * w
        a = torch.cat(angles)
        return a.cos(), a.sin(), frames

    # ---- weights --------------------------------------------------------------------------------------

    def weight_slots(self, prefix: str = "visual.") -> dict[str, tuple]:
        """Checkpoint name → slot (as `Glm5NextForCausalLM.weight_slots`) under `prefix`: transformers'
        `model.visual.*` names less the `model.` that `names._canonical` strips. All whole (replicated)."""
        p = prefix
        slots: dict[str, tuple] = {p + "patch_embed.proj.weight": (self.patch_weight, None),
                                   p + "patch_embed.proj.bias": (self.patch_bias, None)}
        for i, b in enumerate(self.blocks):
            pb = f"{p}blocks.{i}."
            slots[pb + "norm1.weight"] = (b.norm1, None)
            slots[pb + "norm2.weight"] = (b.norm2, None)
            slots[pb + "attn.q_norm.weight"] = (b.q_norm, None)
            slots[pb + "attn.k_norm.weight"] = (b.k_norm, None)
            for sub, lin in (("attn.", b.qkv), ("attn.", b.proj), ("mlp.", b.gate_up), ("mlp.", b.down)):
                slots.update(linear_slots(pb + sub, lin))
        slots[p + "post_layernorm.weight"] = (self.post_norm, None)
        slots[p + "downsample.weight"] = (self.downsample_weight, None)
        slots[p + "downsample.bias"] = (self.downsample_bias, None)
        slots[p + "merger.post_projection_norm.weight"] = (self.merger_norm_weight, None)
        slots[p + "merger.post_projection_norm.bias"] = (self.merger_norm_bias, None)
        for lin in (self.merger_proj, self.merger_gate_up, self.merger_down):
            slots.update(linear_slots(p + "merger.", lin))
        return slots

    def finalize(self) -> None:
        """Join the loaded linear parts (once all slots are filled)."""
        self._graph = self._last_layout = None  # a graph reads the weights it was captured with
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()
