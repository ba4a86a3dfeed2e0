"""A GGUF file's header and tensor table, read in one pass over a memory map; values decoded when asked.

gguf's own GGUFReader builds a numpy view for every part of every metadata entry up front: a 49k-token
vocabulary and its merges are ~300k views, 5-10 s of Python holding the GIL on a small CPU, paid before
a server can answer. Here the walk only records where each value lies (strings in arrays are skipped
by their length prefix) and a value is decoded when a caller asks for its key; tensors are memory-mapped
views in the shapes GGUFReader gives them, so the dequantising code is the same for both.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import KeysView
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.BF16: np.uint16, GGMLQuantizationType.F64: np.float64,
          GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (fastest-varying dimension first), `data` a read-only view:
    elements for plain types, shape reversed(shape); bytes for quantized ones, (rows..., bytes per row)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """A GGUF file (version 2 or later, little-endian). `keys()` lists its metadata, `get(key)` decodes
    one value (arrays as lists), `tensors` holds every tensor in file order."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._buf
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] < 2:
            raise ValueError(f"{self.path} is not a GGUF file of version 2 or later")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._at: dict[str, tuple[int, int]] = {}  # key -> (value type, offset of the value)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            self._at[key] = (kind, pos + 4)
            pos = self._value(kind, pos + 4, keep=False)[1]
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, GGMLQuantizationType(kind), tuple(int(d) for d in dims), offset))
        align = self.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-pos // align) * align
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors = [GGUFTensor(name, kind, dims, _view(whole, start + offset, kind, dims))
                        for name, kind, dims, offset in infos]

    def keys(self) -> KeysView[str]:
        return self._at.keys()

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._at:
            return default
        kind, pos = self._at[key]
        return self._value(kind, pos)[0]

    def array_len(self, key: str) -> int | None:
        """The element count of an array value, without decoding it."""
        kind, pos = self._at.get(key, (None, 0))
        return struct.unpack_from("<Q", self._buf, pos + 4)[0] if kind == _ARRAY else None

    # ---- the walk ---------------------------------------------------------------------------------

    def _string(self, pos: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", self._buf, pos)
        return self._buf[pos + 8:pos + 8 + size].decode("utf-8", "replace"), pos + 8 + size

    def _value(self, kind: int, pos: int, keep: bool = True) -> tuple[Any, int]:
        """The value of type `kind` at `pos` (None unless `keep`: the walk only skips it) and where it ends."""
        if kind == _STRING:
            return self._string(pos) if keep else (None, pos + 8 + struct.unpack_from("<Q", self._buf, pos)[0])
        if kind != _ARRAY:
            fmt = _SCALARS[kind]
            return (struct.unpack_from(fmt, self._buf, pos)[0] if keep else None), pos + struct.calcsize(fmt)
        item, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if item in _SCALARS:
            fmt = _SCALARS[item]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._buf, pos)) if keep else None
            return values, pos + count * struct.calcsize(fmt)
        items = []
        for _ in range(count):  # strings (a vocabulary) or nested arrays: walked one by one
            one, pos = self._value(item, pos, keep)
            if keep:
                items.append(one)
        return (items if keep else None), pos


def _view(whole: np.ndarray, at: int, kind: GGMLQuantizationType, dims: tuple[int, ...]) -> np.ndarray:
    rows = tuple(reversed(dims))
    if kind in _PLAIN:
        dtype = np.dtype(_PLAIN[kind])
        n = int(np.prod(rows)) if rows else 1
        return whole[at:at + n * dtype.itemsize].view(dtype).reshape(rows)
    block, size = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise ValueError(f"a {kind.name} tensor's rows must be a multiple of {block} elements, not {dims[0]}")
    row_bytes = dims[0] // block * size
    n = int(np.prod(rows[:-1])) * row_bytes
    return whole[at:at + n].reshape(*rows[:-1], row_bytes)
