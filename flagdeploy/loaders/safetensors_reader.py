"""HF safetensors directories: config.json plus one file or shards named by model.safetensors.index.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from flagdeploy.errors import ModelLoadError
from flagdeploy.models import config_from_hf
from flagdeploy.ops.weights import FP8_DTYPES


def read_config(path: Path):
    """The model's config (its family's dataclass), validated before any weight is read."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} could not be read ({exc}); the directory needs the model's config.json.") from exc
    return config_from_hf(cfg)


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    absent = [f.name for f in files if not f.exists()]
    if absent or not files:
        raise ModelLoadError(
            f"{path} is missing weight files ({', '.join(absent) or 'no *.safetensors at all'}). Download the "
            f"complete checkpoint (every shard listed in model.safetensors.index.json)."
        )
    return files


def iter_tensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors read lazily, one at a time, shard after shard (memory-mapped by safetensors).

    Cast to the run dtype, except FP8 weights and their block scales: those go on as stored, so that
    the model's loader can pair them and dequantise (a plain cast would drop the scales' meaning).
    """
    for f in shard_files(path):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                yield name, t if t.dtype in FP8_DTYPES or name.endswith("_scale_inv") else t.to(dtype)


def count_tensors(path: Path) -> int:
    total = 0
    for f in shard_files(path):
        with safe_open(f, framework="pt") as sf:
            total += len(list(sf.keys()))
    return total
