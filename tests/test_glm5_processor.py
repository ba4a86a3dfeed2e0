"""GLM-5.3-Flash's media processor (flagdeploy.models.glm5_next.processor) against transformers 5.24: the
pixels of images (its PIL image processor), the layout of video frames, the prompt text that replaces each
placeholder (`Glm5NextProcessor` itself, run on a tiny offline tokenizer that knows GLM's special tokens at
their real ids) and the token positions the tower's rows fill (`Glm5NextModel.get_placeholder_mask`).

transformers' video processor imports torchvision, which cannot be installed beside our CPU torch, so its
`smart_resize`, `resize` and `patchify` are compiled here from its source with torchvision's three kernels
stubbed (resize: PIL bicubic, as ours; pad: zeros; normalize: subtract then divide), and its fused
rescale-and-normalize is TorchvisionBackend's own; inside `Glm5NextProcessor` a stand-in video processor
hands over our video's grid and the `VideoMetadata` its frame sampler would have made.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from PIL import Image  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    BatchFeature,
    Glm5NextConfig,
    Glm5NextImageProcessorPil,
    Glm5NextProcessor,
    PreTrainedTokenizerFast,
)
from transformers import image_utils as hf_image_utils  # noqa: E402
from transformers.image_processing_backends import TorchvisionBackend  # noqa: E402
from transformers.image_utils import SizeDict  # noqa: E402
from transformers.models.glm5_next import image_processing_pil_glm5_next  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextModel  # noqa: E402
from transformers.video_processing_utils import VideoProcessorMixin  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

from flagdeploy.errors import ModelLoadError  # noqa: E402
from flagdeploy.models.glm5_next.processor import Glm5MediaProcessor, Glm5VideoSettings  # noqa: E402

VIDEO_SRC = Path(image_processing_pil_glm5_next.__file__).with_name("video_processing_glm5_next.py")
SPECIAL = {"<|image|>": 154854, "<|video|>": 154855, "<|begin_of_image|>": 154830, "<|end_of_image|>": 154831,
           "<|begin_of_video|>": 154832, "<|end_of_video|>": 154833}
IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"


@pytest.fixture(scope="module")
def hf_config():
    return Glm5NextConfig().to_dict()


@pytest.fixture(scope="module")
def proc(tmp_path_factory, hf_config):
    return Glm5MediaProcessor.from_checkpoint(tmp_path_factory.mktemp("bare"), hf_config)


def _random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())


def _frames(n: int, width: int, height: int) -> list[Image.Image]:
    return [_random_image(width, height, seed=10 + i) for i in range(n)]


def _uint8(frames: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames])


# ---- transformers' video processor without torchvision -------------------------------------------------

def _class_body(name: str) -> dict[str, ast.expr]:
    tree = ast.parse(VIDEO_SRC.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.targets[0].id: n.value for n in cls.body if isinstance(n, ast.Assign)} | {
        n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _tv_pad(videos: torch.Tensor, padding: list[int], fill: int = 0) -> torch.Tensor:
    left, top, right, bottom = padding
    return torch.nn.functional.pad(videos, (left, right, top, bottom), value=fill)


def _tv_resize(self, videos: torch.Tensor, size: SizeDict, resample) -> torch.Tensor:
    b, t, c, _, _ = videos.shape
    frames = [Image.fromarray(f.permute(1, 2, 0).numpy()).resize((size.width, size.height), resample)
              for f in videos.flatten(0, 1)]
    return _uint8(frames).view(b, t, c, size.height, size.width)


def _tv_normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, inplace: bool = False):
    return (images - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)


@pytest.fixture(scope="module")
def hf_video_code():
    """`smart_resize`, `Glm5NextVideoProcessor.resize` and `.patchify`, compiled from transformers' source."""
    tree = ast.parse(VIDEO_SRC.read_text())
    body = _class_body("Glm5NextVideoProcessor")
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    ns = dict(math=math, torch=torch, SizeDict=SizeDict, tvF=SimpleNamespace(pad=_tv_pad),
              TorchvisionBackend=SimpleNamespace(resize=_tv_resize))
    exec(compile(ast.Module(body=defs + [body["resize"], body["patchify"]], type_ignores=[]), str(VIDEO_SRC), "exec"),
         ns)
    return ns


def _hf_video(code, frames: list[Image.Image], s: Glm5VideoSettings):
    """`Glm5NextVideoProcessor._preprocess` on one video of already sampled frames."""
    videos = code["resize"](None, _uint8(frames)[None], resample=Image.Resampling.BICUBIC,
                            factor=s.patch_size * s.merge_size * s.patch_expand_factor,
                            temporal_factor=s.temporal_patch_size, min_image_tokens=s.min_image_tokens,
                            max_image_tokens=s.max_image_tokens)
    backend = SimpleNamespace(normalize=_tv_normalize, _fuse_mean_std_and_rescale_factor=partial(
        TorchvisionBackend._fuse_mean_std_and_rescale_factor.__wrapped__, None))
    videos = TorchvisionBackend.rescale_and_normalize(backend, videos, True, s.rescale_factor, True, list(s.image_mean),
                                                      list(s.image_std))
    patches, t, h, w = code["patchify"](None, videos, patch_size=s.patch_size, merge_size=s.merge_size,
                                        temporal_patch_size=s.temporal_patch_size)
    return patches[0], torch.tensor([[t, h, w]])


def _layout(x: torch.Tensor, p: int = 14, m: int = 2, tp: int = 2) -> torch.Tensor:
    """tests/test_glm5_vision.py `_video`'s layout of normalised frames [frames, 3, height, width]."""
    frames, _, height, width = x.shape
    t, h, w = frames // tp, height // p, width // p
    x = x.reshape(t, tp, 3, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, 3 * tp * p * p)


def _normalised(frames: list[Image.Image]) -> torch.Tensor:
    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor.__wrapped__(
        None, True, hf_image_utils.OPENAI_CLIP_MEAN, hf_image_utils.OPENAI_CLIP_STD, True, 1 / 255)
    return _tv_normalize(_uint8(frames).float(), mean, std)


# ---- transformers' processor on an offline tokenizer ---------------------------------------------------

class _RecordingTokenizer(PreTrainedTokenizerFast):
    """Keeps the text the processor hands it: the expanded prompt."""

    def __call__(self, text=None, *args, **kwargs):
        self.seen = text
        return super().__call__(text, *args, **kwargs)


class _StandInVideoProcessor:
    """What `Glm5NextVideoProcessor` would return for videos already sampled: ours, and the metadata its
    `sample_frames` makes (an odd frame count padded with the last index)."""

    merge_size = 2

    def __init__(self, outputs: list[tuple[torch.Tensor, torch.Tensor, VideoMetadata]]):
        self.outputs = outputs

    def __call__(self, videos, **kwargs):
        return BatchFeature({"pixel_values_videos": torch.cat([o[0] for o in self.outputs]),
                             "video_grid_thw": torch.cat([o[1] for o in self.outputs]),
                             "video_metadata": [o[2] for o in self.outputs]})


class _Processor(Glm5NextProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor":  # its base class needs torchvision
            return super().check_argument_for_proper_class(argument_name, argument)


def _hf_processor(video_outputs=()) -> _Processor:
    vocab = {"[UNK]": 0, "look": 1, "at": 2, "and": 3, "then": 4, **SPECIAL}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = _RecordingTokenizer(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    assert tok.convert_tokens_to_ids(list(SPECIAL)) == list(SPECIAL.values())
    return _Processor(image_processor=Glm5NextImageProcessorPil(), tokenizer=tok,
                      video_processor=_StandInVideoProcessor(list(video_outputs)))


def _metadata(indices: list[int], fps: float) -> VideoMetadata:
    if len(indices) % 2:
        indices = indices + indices[-1:]
    return VideoMetadata(total_num_frames=indices[-1] + 1, fps=fps, frames_indices=indices)


# ---- tests ----------------------------------------------------------------------------------------------

def test_defaults_are_transformers(proc, hf_config):
    body = _class_body("Glm5NextVideoProcessor")
    for f in dataclasses.fields(Glm5VideoSettings):
        node = body.get(f.name)
        if node is None:
            want = getattr(VideoProcessorMixin, f.name)
        elif isinstance(node, ast.Name):
            want = tuple(getattr(hf_image_utils, node.id))
        else:
            want = ast.literal_eval(node)
        assert getattr(Glm5VideoSettings(), f.name) == want, f.name
    assert proc.video == Glm5VideoSettings()
    # the video module's smart_resize (which ours calls through the image module) is the same code
    sources = [Path(image_processing_pil_glm5_next.__file__).read_text(), VIDEO_SRC.read_text()]
    defs = [next(n for n in ast.parse(src).body if getattr(n, "name", None) == "smart_resize") for src in sources]
    assert ast.dump(defs[0]) == ast.dump(defs[1])
    assert proc.image_processor.to_dict() == Glm5NextImageProcessorPil().to_dict()
    assert (proc.image_token_id, proc.video_token_id, proc.image_start_token_id, proc.image_end_token_id,
            proc.video_start_token_id, proc.video_end_token_id) == tuple(
        hf_config[k] for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                               "video_start_token_id", "video_end_token_id")) == tuple(SPECIAL.values())
    assert proc.placeholder("image") == IMAGE and proc.placeholder("video") == VIDEO


@pytest.mark.parametrize("size", [(90, 60), (50, 130), (20, 10), (640, 480), (3000, 2000)])
def test_image_inputs_are_transformers(proc, size):
    image = _random_image(*size)
    want = Glm5NextImageProcessorPil()(images=image, return_tensors="pt")
    got = proc.image_inputs(image)
    assert got.kind == "image" and got.pixel_values.dtype == torch.float32
    assert torch.equal(got.pixel_values, want["pixel_values"]) and torch.equal(got.grid_thw, want["image_grid_thw"])
    assert got.num_tokens == int(want["image_grid_thw"].prod()) // 4


def test_video_layout_without_resizing(proc):
    frames = _frames(4, 112, 84)  # multiples of 28 within the token budget: no resizing, no padding
    inputs, times = proc.video_inputs(frames, [0.0, 0.5, 1.0, 1.5])
    assert torch.equal(inputs.grid_thw, torch.tensor([[2, 6, 8]])) and inputs.num_tokens == 24
    assert torch.equal(inputs.pixel_values, _layout(_normalised(frames)))
    assert times == [0.0, 1.0]


def test_odd_frame_count_repeats_the_last_frame(proc):
    frames = _frames(3, 112, 84)
    inputs, times = proc.video_inputs(frames, [0.0, 0.5, 1.0])
    assert torch.equal(inputs.grid_thw, torch.tensor([[2, 6, 8]]))
    assert torch.equal(inputs.pixel_values, _layout(_normalised(frames + frames[-1:])))
    assert times == [0.0, 1.0]


@pytest.mark.parametrize("frames, width, height, settings", [
    (4, 112, 84, {}),     # as is
    (2, 200, 150, {}),    # zero-padded to multiples of 28
    (2, 100, 70, {}),     # enlarged (under the minimum token count), then padded
    (3, 30, 20, {}),      # enlarged, odd frame count
    (5, 333, 222, {"max_image_tokens": 64}),  # shrunk into the budget (5 frames count as round(2.5) * 2 = 4)
    (1, 500, 90, {"max_image_tokens": 40}),   # one frame, shrunk, wide
    (2, 200, 150, {"patch_expand_factor": 2}),  # canvas in multiples of 56
])
def test_video_is_transformers_code(proc, hf_video_code, frames, width, height, settings):
    proc = dataclasses.replace(proc, video=dataclasses.replace(proc.video, **settings))
    clip = _frames(frames, width, height)
    inputs, _ = proc.video_inputs(clip, [i / 2 for i in range(frames)])
    want_pv, want_grid = _hf_video(hf_video_code, clip, proc.video)
    assert torch.equal(inputs.grid_thw, want_grid)
    assert torch.equal(inputs.pixel_values, want_pv)


@pytest.mark.parametrize("size", [(90, 60), (50, 130), (20, 10), (3000, 2000)])
def test_still_video_is_the_image(proc, size):
    """Two equal frames under the image budget are the image (the image processor repeats it over the
    temporal patch): the same resampling, canvas and normalisation, up to float rounding."""
    proc = dataclasses.replace(proc, video=dataclasses.replace(proc.video, max_image_tokens=8000))
    image = _random_image(*size)
    video, _ = proc.video_inputs([image, image], [0.0, 0.5])
    still = proc.image_inputs(image)
    assert torch.equal(video.grid_thw, still.grid_thw)
    assert torch.allclose(video.pixel_values, still.pixel_values, rtol=0, atol=1e-5)


def test_two_images_expand_as_transformers(proc):
    images = [_random_image(90, 60), _random_image(50, 130, seed=1)]
    text = f"look at {IMAGE} and {IMAGE} then"
    hf = _hf_processor()
    out = hf(text=text, images=images)
    ours = proc.expand(text, [(proc.image_inputs(im), None) for im in images])
    assert hf.tokenizer.seen == [ours]
    assert hf.tokenizer(ours)["input_ids"] == out["input_ids"][0]


@pytest.mark.parametrize("indices, fps", [([0, 1, 2, 3], 2.0), ([0, 1, 2, 3, 4], 2.0), ([0, 15, 30, 45, 60, 75], 30.0),
                                          ([3, 40, 77], 24.0)])
def test_video_expansion_is_replace_video_token(proc, indices, fps):
    meta = _metadata(indices, fps)
    inputs, times = proc.video_inputs(_frames(len(indices), 84, 56), [i / fps for i in indices])
    hf = _hf_processor()
    want = hf.replace_video_token({"video_grid_thw": inputs.grid_thw, "video_metadata": [meta]}, video_idx=0)
    assert proc.expansion(inputs, times) == want


def test_image_video_image_prompt_and_positions(proc):
    """The full processor on image, video, image: the same text and ids, and the positions of each item
    are where `get_placeholder_mask` puts image and video features, in order."""
    images = [_random_image(90, 60), _random_image(50, 130, seed=1)]
    indices = [0, 1, 2, 3, 4]
    video, times = proc.video_inputs(_frames(5, 112, 56), [i / 2 for i in indices])
    items = [(proc.image_inputs(images[0]), None), (video, times), (proc.image_inputs(images[1]), None)]
    text = f"look at {IMAGE} then {VIDEO} and {IMAGE}"
    hf = _hf_processor([(video.pixel_values, video.grid_thw, _metadata(indices, 2.0))])
    out = hf(text=text, images=images, videos=[_frames(5, 112, 56)])
    ours = proc.expand(text, items)
    assert hf.tokenizer.seen == [ours]
    ids = out["input_ids"][0]
    assert hf.tokenizer(ours)["input_ids"] == ids

    got = proc.positions(ids, items)
    assert [len(g) for g in got] == [x.num_tokens for x, _ in items]
    model = SimpleNamespace(config=Glm5NextConfig())
    image_mask, video_mask = Glm5NextModel.get_placeholder_mask(
        model, torch.tensor([ids]), inputs_embeds=torch.zeros(1, len(ids), 1))
    assert got[0] + got[2] == torch.nonzero(image_mask[0, :, 0]).flatten().tolist()
    assert got[1] == torch.nonzero(video_mask[0, :, 0]).flatten().tolist()
    # the processor's own token types agree: 1 for images, 2 for videos
    types = out["mm_token_type_ids"][0]
    assert all(types[p] == 1 for p in got[0] + got[2]) and all(types[p] == 2 for p in got[1])


def test_mismatches_are_refused(proc):
    image = proc.image_inputs(_random_image(90, 60))
    video, times = proc.video_inputs(_frames(2, 56, 56), [0.0, 0.5])
    with pytest.raises(ValueError, match="2 image placeholder"):
        proc.expand(f"{IMAGE}{IMAGE}", [(image, None)])
    with pytest.raises(ValueError, match="1 video placeholder"):
        proc.expand(f"{IMAGE} typed <|video|>", [(image, None)])
    with pytest.raises(ValueError, match="timestamps"):
        proc.expand(VIDEO, [(video, None)])
    ids = [SPECIAL["<|image|>"]] * (image.num_tokens - 1)
    with pytest.raises(ValueError, match="image-token positions"):
        proc.positions(ids, [(image, None)])
    span = [SPECIAL["<|begin_of_video|>"]] + [SPECIAL["<|image|>"]] * 3 + [SPECIAL["<|end_of_video|>"]]
    with pytest.raises(ValueError, match="video spans"):
        proc.positions(span, [(video, times)])
    with pytest.raises(ValueError, match="one per frame"):
        proc.video_inputs(_frames(2, 56, 56), [0.0])
    with pytest.raises(ValueError, match="one size"):
        proc.video_inputs([_random_image(56, 56), _random_image(84, 56)], [0.0, 0.5])


def test_from_checkpoint_reads_the_processor_files(tmp_path, hf_config):
    image = _random_image(640, 480)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 64}))
    small = Glm5MediaProcessor.from_checkpoint(tmp_path, hf_config)
    want = Glm5NextImageProcessorPil(max_image_tokens=64)(images=image, return_tensors="pt")
    assert torch.equal(small.image_inputs(image).grid_thw, want["image_grid_thw"])
    default = Glm5NextImageProcessorPil()(images=image)["image_grid_thw"][0]
    assert small.image_inputs(image).num_tokens <= 64 < int(default.prod()) // 4
    assert small.video.max_image_tokens == 64  # transformers' fallback for a missing video processor file

    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"max_image_tokens": 100, "fps": 1, "image_mean": [0.5, 0.5, 0.5], "do_sample_frames": True}))
    ids = dict(hf_config, image_token_id=7, video_end_token_id=9)
    loaded = Glm5MediaProcessor.from_checkpoint(tmp_path, ids)
    assert loaded.video == Glm5VideoSettings(max_image_tokens=100, fps=1, image_mean=(0.5, 0.5, 0.5))
    assert (loaded.image_token_id, loaded.video_end_token_id) == (7, 9)
    inputs, _ = loaded.video_inputs(_frames(2, 640, 480), [0.0, 0.5])
    assert inputs.num_tokens <= 100

    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"max_image_tokens": 32}, "video_processor": {"max_image_tokens": 50}}))
    nested = Glm5MediaProcessor.from_checkpoint(tmp_path, hf_config)
    assert (nested.image_processor.max_image_tokens, nested.video.max_image_tokens) == (32, 50)


@pytest.mark.parametrize("files, match", [
    ({"video_preprocessor_config.json": {"do_normalize": False}}, "do_normalize"),
    ({"preprocessor_config.json": {"merge_size": 4}}, "merge_size"),
    ({"preprocessor_config.json": "{not json"}, "cannot read"),
])
def test_from_checkpoint_refuses(tmp_path, hf_config, files, match):
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ModelLoadError, match=match):
        Glm5MediaProcessor.from_checkpoint(tmp_path, hf_config)
