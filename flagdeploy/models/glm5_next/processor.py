"""GLM-5.3-Flash's media processor at serve time: an image, or a video's sampled frames, become the
pixel rows the vision tower takes (`PixelInputs`) and the prompt text that stands for them, both as
transformers' `Glm5NextProcessor` makes them (tests/test_glm5_processor.py checks them against it).

GLM's chat template writes one placeholder per media part (`placeholder`); `expand` widens each to
as many image tokens as the tower gives rows (a video as one group per temporal pair of frames, each
with its timestamp), and `positions` finds, in the tokenized prompt, the positions those rows fill, as
the model's `get_placeholder_mask` does: images and videos share the image token, and a video's are the
ones between `<|begin_of_video|>` and `<|end_of_video|>`.

Images go through transformers' own (PIL) image processor. Videos are laid out here, because
transformers' video processor needs torchvision, which cannot be installed beside our CPU torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from transformers import Glm5NextImageProcessorPil
from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize

from flagdeploy.errors import ModelLoadError
from flagdeploy.checkpoints.safetensors_reader import optional_json

from .config import MM_TOKEN_IDS
from .vision import Glm5VisionConfig

IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
BEGIN_OF_IMAGE, END_OF_IMAGE = "<|begin_of_image|>", "<|end_of_image|>"
BEGIN_OF_VIDEO, END_OF_VIDEO = "<|begin_of_video|>", "<|end_of_video|>"
_PLACEHOLDERS = {"image": BEGIN_OF_IMAGE + IMAGE_TOKEN + END_OF_IMAGE,
                 "video": BEGIN_OF_VIDEO + VIDEO_TOKEN + END_OF_VIDEO}
_KIND_OF = {IMAGE_TOKEN: "image", VIDEO_TOKEN: "video"}
_MEDIA_TOKEN = re.compile(f"{re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)}")


@dataclass(frozen=True, eq=False)
class PixelInputs:
    """One image or video as the vision tower takes it: `pixel_values` [patches, channels × temporal
    patch × patch²] float32 and `grid_thw` [1, 3] (temporal pairs, patch rows, patch columns); each
    merge_size × merge_size block of a frame's patches becomes one of the tower's rows."""

    kind: str  # "image" | "video"
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """The tower's feature rows for this item: the image-token positions it fills in the prompt."""
        t, h, w = self.grid_thw[0].tolist()
        return t * h * w // self.merge_size ** 2


Item = tuple[PixelInputs, list[float] | None]  # an item and, for a video, its timestamps per temporal pair


@dataclass(frozen=True)
class Glm5VideoSettings:
    """What transformers' `Glm5NextVideoProcessor` is configured with (its class attributes, in
    transformers 5.24, are the defaults; the test reads them from its source, as the class itself
    cannot be imported without torchvision). `fps` and `max_frames` are for whoever samples the frames."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    patch_expand_factor: int = 1
    min_image_tokens: int = 16
    max_image_tokens: int = 240000
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    fps: float = 2
    max_frames: int = 2048

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Glm5VideoSettings:
        """From a video processor config; refuses the settings this layout does not follow rather than
        feed the model pixels it was not trained on."""
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True), ("resample", 3)):
            if key in d and d[key] != want:
                raise ModelLoadError(f"video processor setting {key}={d[key]!r} is not supported (GLM-5.3-Flash "
                                     f"uses {want!r}); remove it from the checkpoint's video processor config.")
        values = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        for name in ("image_mean", "image_std"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


@dataclass
class Glm5MediaProcessor:
    """Per request: `image_inputs` / `video_inputs` for each media item, `expand` on the rendered prompt,
    then `positions` on its token ids to place the tower's rows."""

    image_processor: Glm5NextImageProcessorPil
    video: Glm5VideoSettings
    image_token_id: int = MM_TOKEN_IDS["image_token_id"]
    video_token_id: int = MM_TOKEN_IDS["video_token_id"]
    image_start_token_id: int = MM_TOKEN_IDS["image_start_token_id"]
    image_end_token_id: int = MM_TOKEN_IDS["image_end_token_id"]
    video_start_token_id: int = MM_TOKEN_IDS["video_start_token_id"]
    video_end_token_id: int = MM_TOKEN_IDS["video_end_token_id"]

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN

    @classmethod
    def from_checkpoint(cls, path: Path, hf_config: dict[str, Any]) -> Glm5MediaProcessor:
        """Settings from the checkpoint's processor files, found as transformers finds them (the nested
        processor_config.json first, then preprocessor_config.json, which also serves the video processor
        when video_preprocessor_config.json is absent; transformers' defaults when none is there), token
        ids from the top level of its config.json (`hf_config`)."""
        path = Path(path)
        nested = optional_json(path / "processor_config.json") or {}
        legacy = optional_json(path / "preprocessor_config.json")
        image_cfg = nested["image_processor"] if "image_processor" in nested else legacy
        own = optional_json(path / "video_preprocessor_config.json")
        video_cfg = nested["video_processor"] if "video_processor" in nested else own if own is not None else legacy
        image_processor = Glm5NextImageProcessorPil.from_dict(image_cfg or {})
        video = Glm5VideoSettings.from_dict(video_cfg or {})
        # the tower's rows per item must be the tokens the prompt holds for it
        vision = Glm5VisionConfig.from_hf(hf_config.get("vision_config") or {})
        tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        for kind, got in (("image", image_processor), ("video", video)):
            ours = (got.patch_size, got.temporal_patch_size, got.merge_size)
            if ours != tower:
                raise ModelLoadError(
                    f"{path}: the {kind} processor's (patch_size, temporal_patch_size, merge_size) {ours} differ from "
                    f"the vision tower's {tower} in config.json; the processor files belong to another model.")
        ids = {name: int(hf_config[name]) if hf_config.get(name) is not None else default
               for name, default in MM_TOKEN_IDS.items()}
        return cls(image_processor, video, **ids)

    def placeholder(self, kind: str) -> str:
        """What GLM's chat template writes for one image or video content part (as vLLM's GLM-4.1V
        examples write it): `expand` widens its middle token."""
        if kind not in _PLACEHOLDERS:
            raise ValueError(f"unknown media kind {kind!r}; expected 'image' or 'video'")
        return _PLACEHOLDERS[kind]

    def image_inputs(self, image: Image.Image) -> PixelInputs:
        """Through transformers' own image processor: the same pixels, bit for bit."""
        out = self.image_processor(images=[image], return_tensors="pt")
        return PixelInputs("image", out["pixel_values"], out["image_grid_thw"], self.image_processor.merge_size)

    def video_inputs(self, frames: Sequence[Image.Image],
                     timestamps: Sequence[float]) -> tuple[PixelInputs, list[float]]:
        """Frames already sampled (at `video.fps`), all of one size, with their times in seconds, laid out
        as `Glm5NextVideoProcessor` lays them out after sampling: the same canvas for all frames (its
        `smart_resize`, the frame count included), content resized then zero-padded at the bottom and
        right, rescaled and normalised in float32 as its fused step does, an odd frame count padded with
        the last frame, then temporal pairs of 2 × 2 merge blocks row by row, each patch flattened as
        (channel, frame, row, column). Returns it with the timestamps `expansion` needs (one per pair).

        Resizing is PIL's bicubic (the image processor's), where transformers uses torchvision's bicubic on
        uint8 tensors: pixels of resized frames may differ from it by a rounding step. Frames within the
        token budget (neither under its minimum nor over its maximum) are only zero-padded, never resized,
        and are exactly its pixels."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        if len(timestamps) != len(frames):
            raise ValueError(f"a video has {len(frames)} frames but {len(timestamps)} timestamps; give one per frame")
        sizes = {frame.size for frame in frames}
        if len(sizes) > 1:
            raise ValueError(f"a video's frames must all have one size; got (width, height) {sorted(sizes)}")
        v, n = self.video, len(frames)
        (width, height), = sizes
        th, tw, ch, cw = self._canvas(n, height, width)
        x = torch.zeros(n, 3, th, tw, dtype=torch.uint8)
        for i, frame in enumerate(frames):
            frame = frame.convert("RGB")
            if (ch, cw) != (height, width):
                frame = frame.resize((cw, ch), Image.Resampling.BICUBIC)
            x[i, :, :ch, :cw] = torch.from_numpy(np.array(frame)).permute(2, 0, 1)
        mean = torch.tensor(v.image_mean) * (1.0 / v.rescale_factor)
        std = torch.tensor(v.image_std) * (1.0 / v.rescale_factor)
        x = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        tp, p, m = v.temporal_patch_size, v.patch_size, v.merge_size
        if pad := -n % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        t, h, w = x.shape[0] // tp, th // p, tw // p
        x = x.view(t, tp, 3, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        inputs = PixelInputs("video", x.reshape(t * h * w, 3 * tp * p * p), torch.tensor([[t, h, w]]), m)
        # replace_video_token's choice: every second frame's time ("mrope"), as many as there are pairs
        pair_times = [float(s) for s in timestamps[::2]][:t]
        return inputs, pair_times + pair_times[-1:] * (t - len(pair_times))

    def _canvas(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(canvas height, width, content height, width): `Glm5NextVideoProcessor.resize`'s sizes."""
        v = self.video
        factor = v.patch_size * v.merge_size * v.patch_expand_factor
        th, tw = smart_resize(num_frames=frames, height=height, width=width, temporal_factor=v.temporal_patch_size,
                              factor=factor, min_pixels=v.min_image_tokens, max_pixels=v.max_image_tokens)
        scale = min(th / height, tw / width)
        if frames * height * width >= v.temporal_patch_size * factor ** 2 * v.min_image_tokens:
            scale = min(1.0, scale)  # shrink to the budget, but only enlarge what is under its minimum
        return th, tw, max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))

    def expansion(self, inputs: PixelInputs, timestamps: Sequence[float] | None = None) -> str:
        """The text that replaces the item's one `<|image|>` / `<|video|>`: an image token per feature row,
        a video's grouped per temporal pair with the pair's time (`video_inputs`' timestamps)."""
        if inputs.kind == "image":
            return IMAGE_TOKEN * inputs.num_tokens
        t, h, w = inputs.grid_thw[0].tolist()
        if timestamps is None or len(timestamps) != t:
            raise ValueError(f"a video of {t} temporal pairs needs {t} timestamps (video_inputs returns them); "
                             f"got {None if timestamps is None else len(timestamps)}")
        frame = IMAGE_TOKEN * (h * w // inputs.merge_size ** 2)
        return "".join(f"{BEGIN_OF_IMAGE}{frame}{END_OF_IMAGE}{s:.1f} seconds" for s in timestamps)

    def expand(self, text: str, items: Sequence[Item]) -> str:
        """`text` with its `<|image|>` placeholders replaced by the images' expansions and its `<|video|>`
        ones by the videos', each kind in its own order (as transformers pairs them). A placeholder typed in
        a user's own text counts like the template's, so the counts then disagree and this refuses."""
        queues: dict[str, list[str]] = {"image": [], "video": []}
        for inputs, timestamps in items:
            queues[inputs.kind].append(self.expansion(inputs, timestamps))
        found = _MEDIA_TOKEN.findall(text)
        for token, kind in _KIND_OF.items():
            if found.count(token) != len(queues[kind]):
                raise ValueError(
                    f"the prompt has {found.count(token)} {kind} placeholder(s) {token} but the request carries "
                    f"{len(queues[kind])} {kind}(s); each {kind} content part must be one placeholder, and message "
                    f"text must not contain {token}")
        pending = {kind: iter(q) for kind, q in queues.items()}
        return _MEDIA_TOKEN.sub(lambda match: next(pending[_KIND_OF[match.group()]]), text)

    def positions(self, ids: Sequence[int], items: Sequence[Item]) -> list[list[int]]:
        """For each item of `items`, the positions in `ids` its feature rows fill, split as the model's
        `get_placeholder_mask` and `masked_scatter` split them: image tokens inside a video span are
        videos', in span order (each span one video's), the others images', in order, each image taking
        as many as it has rows."""
        ids_t = torch.as_tensor(list(ids), dtype=torch.long)
        is_media = ids_t == self.image_token_id
        starts = (ids_t == self.video_start_token_id).cumsum(0)
        in_video = starts > (ids_t == self.video_end_token_id).cumsum(0)
        image_pos = torch.nonzero(is_media & ~in_video).flatten()
        video_pos = torch.nonzero(is_media & in_video).flatten()
        per_span = torch.unique_consecutive(starts[video_pos], return_counts=True)[1].tolist()
        spans = [span.tolist() for span in video_pos.split(per_span)]
        images = [x.num_tokens for x, _ in items if x.kind == "image"]
        videos = [x.num_tokens for x, _ in items if x.kind == "video"]
        if len(image_pos) != sum(images):
            raise ValueError(f"the prompt holds {len(image_pos)} image-token positions outside video spans but its "
                             f"{len(images)} image(s) give {sum(images)} rows; expand the prompt with these items")
        if [len(s) for s in spans] != videos:
            raise ValueError(f"the prompt's video spans hold {[len(s) for s in spans]} image tokens but its videos "
                             f"give {videos} rows; expand the prompt with these items")
        image_groups, video_groups = iter(image_pos.split(images)), iter(spans)
        return [next(image_groups).tolist() if x.kind == "image" else next(video_groups) for x, _ in items]

