"""Idefics3's (SmolVLM's) media processor at serve time: an image becomes the tiles the encoder takes
(`TileInputs`) and the prompt text that stands for them, both as transformers' `Idefics3Processor`
makes them (tests/test_idefics3.py checks them against it).

A large image is resized so that its sides are multiples of the tile size and cut into rows × columns
tiles, followed by a global view of the whole image at one tile's size; a small one (or with image
splitting off) is one tile. The model's chat template writes `<image>` for an image content part;
`expand` widens it to each tile's `<image>` run (one token per encoder row) between
`<fake_token_around_image>` markers, the tiles tagged `<row_r_col_c>` and the global view `<global-img>`.
Images only: the model has no video input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image
from transformers import Idefics3ImageProcessorPil

from flagdeploy.errors import ModelLoadError
from flagdeploy.checkpoints.safetensors_reader import optional_json

from .config import from_hf_config

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
_IMAGE = re.compile(re.escape(IMAGE_TOKEN))


@dataclass(frozen=True, eq=False)
class TileInputs:
    """One image as the encoder takes it: `pixel_values` [tiles, 3, S, S] float32 and `grid_thw`
    [[tiles, rows, columns]] (rows = columns = 0: one tile, no split; otherwise rows × columns tiles and
    the global view)."""

    kind: str
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    tile_rows: int  # encoder rows per tile: `<image>` tokens per tile

    @property
    def num_tokens(self) -> int:
        return self.pixel_values.shape[0] * self.tile_rows


Item = tuple[TileInputs, Any]  # (an item, its timestamps: always None here)


@dataclass
class Idefics3MediaProcessor:
    """Per request: `image_inputs` for each image, `expand` on the rendered prompt, then `positions` on its
    token ids to place the encoder's rows."""

    image_processor: Idefics3ImageProcessorPil
    image_seq_len: int
    image_token_id: int

    image_token = IMAGE_TOKEN

    @classmethod
    def from_checkpoint(cls, path: Path, hf_config: dict[str, Any]) -> Idefics3MediaProcessor:
        """Settings from the checkpoint's processor files as transformers finds them (the nested
        processor_config.json first, then preprocessor_config.json; transformers' defaults when none is
        there), checked against the encoder in config.json."""
        path = Path(path)
        nested = optional_json(path / "processor_config.json") or {}
        image_cfg = nested.get("image_processor") or optional_json(path / "preprocessor_config.json") or {}
        image_processor = Idefics3ImageProcessorPil.from_dict(
            {k: v for k, v in image_cfg.items() if k not in ("image_processor_type", "processor_class")})
        cfg = from_hf_config(hf_config)
        seq_len = int(nested.get("image_seq_len", cfg.image_seq_len))
        tile = image_processor.max_image_size["longest_edge"]
        if seq_len != cfg.image_seq_len or tile != cfg.vision.image_size:
            raise ModelLoadError(
                f"{path}: the processor makes {tile} x {tile} tiles of {seq_len} image tokens, but config.json's "
                f"encoder takes {cfg.vision.image_size} x {cfg.vision.image_size} tiles and gives {cfg.image_seq_len} "
                "rows each; the processor files belong to another model.")
        return cls(image_processor, seq_len, cfg.image_token_id)

    def placeholder(self, kind: str) -> str:
        """What the model's chat template writes for one image content part: `expand` widens it."""
        if kind != "image":
            raise ValueError(f"this model takes images only, not {kind!r}")
        return IMAGE_TOKEN

    def image_inputs(self, image: Image.Image) -> TileInputs:
        """Through transformers' own (PIL) image processor: the same pixels, bit for bit."""
        out = self.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        if not bool(out["pixel_attention_mask"].all()):  # every tile is resized to the full tile size
            raise ValueError("the image processor padded a tile; image splitting settings this model does not use")
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        tiles = out["pixel_values"][0]
        return TileInputs("image", tiles, torch.tensor([[tiles.shape[0], rows, cols]]), self.image_seq_len)

    def expansion(self, inputs: TileInputs) -> str:
        """The text that replaces the image's one `<image>`, as `Idefics3Processor` writes it."""
        _, rows, cols = inputs.grid_thw[0].tolist()
        run = IMAGE_TOKEN * self.image_seq_len
        view = f"{FAKE_TOKEN}{GLOBAL_TAG}{run}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return view
        grid = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{view}"

    def expand(self, text: str, items: Sequence[Item]) -> str:
        """`text` with its i-th `<image>` replaced by the i-th image's expansion. An `<image>` typed in a
        user's own text counts like the template's, so the counts then disagree and this refuses."""
        found = len(_IMAGE.findall(text))
        if found != len(items):
            raise ValueError(f"the prompt has {found} image placeholder(s) {IMAGE_TOKEN} but the request carries "
                             f"{len(items)} image(s); each image content part must be one placeholder, and message "
                             f"text must not contain {IMAGE_TOKEN}")
        pending = iter([self.expansion(inputs) for inputs, _ in items])
        return _IMAGE.sub(lambda _: next(pending), text)

    def positions(self, ids: Sequence[int], items: Sequence[Item]) -> list[list[int]]:
        """For each image, the positions in `ids` its rows fill: the image tokens in order, each image
        taking as many as it has rows (as the model's `inputs_merger` fills them)."""
        where = torch.nonzero(torch.as_tensor(list(ids)) == self.image_token_id).flatten()
        sizes = [inputs.num_tokens for inputs, _ in items]
        if len(where) != sum(sizes):
            raise ValueError(f"the prompt holds {len(where)} image-token positions but its {len(sizes)} image(s) "
                             f"give {sum(sizes)} rows; expand the prompt with these items")
        return [group.tolist() for group in where.split(sizes)]

