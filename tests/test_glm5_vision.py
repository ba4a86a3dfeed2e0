"""GLM-5.3-Flash's vision tower (flagdeploy.models.glm5_next.vision) against transformers' own: what
`get_image_features` / `get_video_features` hand the language model, for images laid out by the model's
image processor (its PIL flavour: the torchvision one cannot be installed beside our CPU torch) and for
video frames in the video processor's layout.

A tiny random configuration keeps the real structure (14-pixel patches over 2 frames, 2 × 2 merge, head
size divisible by 4 for the 2-D rotary embedding); the SwiGLU clamp is lowered to 2 so that it bites.
transformers' init leaves norms at one and biases at zero and keeps the blocks' outputs small next to the
residual, which would hide mistakes: every vision tensor is redrawn at unit scale (seeded).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    Glm5NextImageProcessorPil,
)

from flagdeploy.models.glm5_next import Glm5VisionConfig, Glm5VisionTower, _canonical  # noqa: E402
from flagdeploy.models.slots import copy_param  # noqa: E402

VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=32,
              projection_intermediate_size=40, swiglu_limit=2.0)
# the smallest text model transformers builds: one KDA layer with a dense MLP (never run here)
TEXT = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8,
            index_head_dim=8, index_n_heads=2, linear_head_dim=8, linear_num_heads=2, hc_mult=2, pad_token_id=0,
            layer_types=["linear_attention"], mlp_layer_types=["dense"], indexer_types=["full"])
FP32_TOL = 1e-5  # relative RMS error, float32 against float32 (measured: 1.1e-6 to 1.4e-6)
# relative RMS error of ours in bfloat16 against transformers in float32 (measured: 1.28e-2, transformers'
# own bfloat16 1.29e-2), and at most 1.5x transformers' own
BF16_TOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.model.visual.named_parameters():
            r = torch.randn(t.shape, generator=gen)
            if t.dim() > 1:  # weights: unit gain (fan_in ** -0.5)
                t.copy_(r * (t[0].numel() ** -0.5))
            else:  # norm weights around one, biases around zero
                t.copy_(r * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    return model


def _tower(hf, dtype: torch.dtype) -> Glm5VisionTower:
    """Ours, filled through `weight_slots` from transformers' state dict by its own names."""
    tower = Glm5VisionTower(Glm5VisionConfig.from_hf(hf.config.vision_config.to_dict()), dtype)
    slots = tower.weight_slots()
    seen = set()
    for name, t in hf.state_dict().items():
        if ".visual." not in name:
            continue
        key = _canonical(name)
        slot = slots[key]
        if len(slot) == 2:
            copy_param(name, slot[0], t, slot[1])
        else:
            slot[0].load_part(slot[1], slot[2], t)
        seen.add(key)
    assert seen == set(slots)
    tower.finalize()
    return tower


@pytest.fixture(scope="module")
def ours(hf):
    return _tower(hf, torch.float32)


def _images(*sizes: tuple[int, int]):
    """pixel_values and image_grid_thw of random RGB images of (width, height) `sizes`."""
    gen = torch.Generator().manual_seed(2)
    imgs = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())
            for w, h in sizes]
    out = Glm5NextImageProcessorPil()(images=imgs, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _video(frames: int, height: int, width: int, p: int = 14, m: int = 2, tp: int = 2):
    """pixel_values_videos and video_grid_thw of random normalised frames, laid out as
    Glm5NextVideoProcessor.patchify lays them out (checked bitwise against transformers 5.24's): temporal
    pairs, then m × m merge blocks row by row, each patch flattened as (channel, frame, row, column). The
    video processor itself needs torchvision, which cannot be installed beside our CPU torch."""
    x = torch.randn(frames, 3, height, width, generator=torch.Generator().manual_seed(3))
    t, h, w = frames // tp, height // p, width // p
    x = x.view(t, tp, 3, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, 3 * tp * p * p), torch.tensor([[t, h, w]])


def _hf_images(hf, pv, grid):
    with torch.no_grad():
        return torch.cat(hf.get_image_features(pv, grid).pooler_output)


def test_config_defaults_are_transformers():
    hf_cfg = Glm5NextConfig().vision_config
    ours = Glm5VisionConfig.from_hf({})
    for name in Glm5VisionConfig.__dataclass_fields__:
        want = hf_cfg.rope_parameters["rope_theta"] if name == "rope_theta" else getattr(hf_cfg, name)
        assert getattr(ours, name) == want, name


@pytest.mark.parametrize("size", [(90, 60), (50, 130)])
def test_image_matches_transformers(hf, ours, size):
    pv, grid = _images(size)
    want = _hf_images(hf, pv, grid)
    got = ours(pv, grid)
    assert got.shape == want.shape and got.shape[0] == sum(ours.item_tokens(grid))
    assert _rel(got, want) < FP32_TOL


def test_video_matches_transformers(hf, ours):
    pv, grid = _video(frames=4, height=84, width=112)
    with torch.no_grad():
        want = torch.cat(hf.get_video_features(pv, grid).pooler_output)
    got = ours(pv, grid)
    assert got.shape == want.shape == (sum(ours.item_tokens(grid)), VISION["out_hidden_size"])
    assert _rel(got, want) < FP32_TOL


def test_items_in_one_call_are_each_alone(hf, ours):
    """Two images and a video in one call: each item's rows are what it gives alone (the engine batches
    items and caches each apart)."""
    pv, grid = _images((90, 60), (50, 130))
    vpv, vgrid = _video(frames=2, height=56, width=84)
    together = ours(torch.cat([pv, vpv]), torch.cat([grid, vgrid]))
    parts = together.split(ours.item_tokens(torch.cat([grid, vgrid])))
    patches = grid.prod(-1).tolist()
    alone = [ours(x, g[None]) for x, g in zip(pv.split(patches), grid)] + [ours(vpv, vgrid)]
    assert len(parts) == 3
    for a, b in zip(parts, alone):
        assert _rel(a, b) < 1e-6
    assert _rel(together[: sum(ours.item_tokens(grid))], _hf_images(hf, pv, grid)) < FP32_TOL


def test_bf16_error_is_transformers_own(hf):
    """Ours in bfloat16 against transformers in float32, no worse than 1.5x transformers' own bfloat16 error."""
    pv, grid = _images((90, 60), (50, 130))
    want = _hf_images(hf, pv, grid)
    theirs = _rel(_hf_images(copy.deepcopy(hf).to(torch.bfloat16), pv, grid), want)
    err = _rel(_tower(hf, torch.bfloat16)(pv, grid), want)
    assert err < BF16_TOL and err < 1.5 * theirs, (err, theirs)
