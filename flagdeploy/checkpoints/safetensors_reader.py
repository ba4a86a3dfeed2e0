"""HF safetensors directories: config.json plus one file or shards named by model.safetensors.index.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from flagdeploy.errors import ModelLoadError
from flagdeploy.models import config_from_hf
from flagdeploy.ops.weights import FP8_DTYPES, Int8Weight, W8A8Weight
from flagdeploy.parallel import Shard


def raw_config(path: Path) -> dict:
    """config.json as a dict."""
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} could not be read ({exc}); the directory needs the model's config.json.") from exc


def optional_json(path: Path) -> dict | None:
    """A checkpoint's optional JSON file (a processor's settings), None where it is absent; a file that is
    there but cannot be read is an error naming it."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}; restore the checkpoint's copy of it.") from None


def read_config(path: Path):
    """The model's config (its family's dataclass), validated before any weight is read."""
    return config_from_hf(raw_config(path))


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


def iter_tensors(path: Path, dtype: torch.dtype, plan: Callable[[str], object] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors read lazily, one at a time, shard after shard (memory-mapped by safetensors).

    `plan(name)` (a tensor-parallel rank's model) may answer "skip" (never read: an expert another
    rank holds) or a `Shard` (read only that slice of a 16/32-bit tensor); None reads it whole.

    Cast to the run dtype, except what carries quantized values: FP8 weights and their block scales go
    on as stored, so that the model's loader can pair and dequantise them (a plain cast would drop the
    scales' meaning), and a `flagdeploy quantize` checkpoint's int8 weights come out as weight bundles
    (W8A8Weight / Int8Weight, per its `quantization_config.modules`) that run the int8 ops.
    """
    raw = _raw_tensors(path, dtype, plan)
    schemes = _flagdeploy_schemes(path)
    return _int8_bundles(raw, schemes) if schemes else raw


_SLICEABLE = {"BF16", "F16", "F32", "F64"}


def _raw_tensors(path: Path, dtype: torch.dtype, plan=None) -> Iterator[tuple[str, torch.Tensor]]:
    for f in shard_files(path):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                what = plan(name) if plan is not None else None
                if what == "skip":
                    continue
                if isinstance(what, Shard) and (part := sf.get_slice(name)).get_dtype() in _SLICEABLE:
                    index = [slice(None)] * len(part.get_shape())
                    index[what.dim] = slice(what.start, what.start + what.length)
                    t = part[tuple(index)]
                else:
                    t = sf.get_tensor(name)
                as_stored = t.dtype in FP8_DTYPES or t.dtype == torch.int8 or name.endswith(("_scale_inv", ".weight_scale"))
                yield name, t if as_stored else t.to(dtype)


def _flagdeploy_schemes(path: Path) -> dict[str, str]:
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("modules", {}) if qc.get("quant_method") == "flagdeploy" else {}


# the bundle each int8 scheme of a converted checkpoint loads as
_INT8_BUNDLES = {"w8a8_dynamic": W8A8Weight, "w8a16": Int8Weight}


def _int8_bundles(tensors, schemes: dict[str, str]):
    """Pair each int8 `X.weight` with its `X.weight_scale` ([out, 1] per channel, or [out, in / G])."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        base = name.rsplit(".", 1)[0]
        if schemes.get(base) not in _INT8_BUNDLES or not name.endswith((".weight", ".weight_scale")):
            yield name, t
            continue
        other = base + (".weight_scale" if name.endswith(".weight") else ".weight")
        if other not in pending:
            pending[name] = t
            continue
        q, scale = (t, pending.pop(other)) if name.endswith(".weight") else (pending.pop(other), t)
        n, k = q.shape
        scales = scale.float().reshape(n, -1)
        group = 0 if scales.shape[1] == 1 else k // scales.shape[1]
        yield base + ".weight", _INT8_BUNDLES[schemes[base]](q, scales if group else scales[:, 0], n, k, group_size=group)
    if pending:
        raise ModelLoadError(f"{len(pending)} int8 tensors have no partner (weight or weight_scale), e.g. "
                             f"{sorted(pending)[:3]}; the converted checkpoint is incomplete. Convert it again.")


def tensor_names(path: Path) -> list[str]:
    """Every tensor name of the checkpoint, from its index (or the shards' headers): nothing is read."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for f in shard_files(path):
        with safe_open(f, framework="pt") as sf:
            names.extend(sf.keys())
    return names


def count_tensors(path: Path) -> int:
    total = 0
    for f in shard_files(path):
        with safe_open(f, framework="pt") as sf:
            total += len(list(sf.keys()))
    return total
