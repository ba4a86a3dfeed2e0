"""Safetensors files read and written one tensor at a time, with plain file I/O.

Memory-mapping a shard (what `safe_open` does) keeps every page it touched resident until the file is
closed, so converting a 5 GB shard would cost 5 GB of RSS. Here a tensor is read into its own buffer
and written out as soon as it is converted: the writer lays out the header from the planned outputs
first, then appends each tensor's bytes in that order. Peak memory is then a few copies of the largest
tensor, whatever the size of the shard or the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from flagdeploy.errors import FlagdeployError

# safetensors dtype names <-> torch dtypes (the FP8 ones only where this torch has them)
_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
DTYPES = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CorruptShardError(FlagdeployError):
    """A safetensors file whose header or size does not add up."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _corrupt(path: Path, what: str) -> CorruptShardError:
    return CorruptShardError(f"{path} is not a valid safetensors file ({what}). The download was probably cut short "
                             f"or the file was damaged: download that shard again.")


def read_header(path: Path) -> list[TensorEntry]:
    """Every tensor's name, dtype, shape and byte range, in file order; checks that the file holds them all."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, "shorter than a header")
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise _corrupt(path, f"header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _corrupt(path, f"header is not JSON: {exc}") from exc
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            a, b = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(path, f"entry {name!r} is malformed: {info!r}") from exc
        numel = 1
        for d in shape:
            numel *= d
        if b - a != numel * dtype.itemsize or a < 0:
            raise _corrupt(path, f"{name!r} spans {b - a} bytes, its shape and dtype need {numel * dtype.itemsize}")
        if base + b > size:
            raise _corrupt(path, f"{name!r} ends at byte {base + b}, the file has {size}")
        entries.append(TensorEntry(name, dtype, shape, base + a, base + b))
    return sorted(entries, key=lambda e: e.start)


def read_tensor(f: BinaryIO, entry: TensorEntry) -> torch.Tensor:
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
    f.seek(entry.start)
    if entry.nbytes and f.readinto(memoryview(buf.numpy())) != entry.nbytes:
        raise CorruptShardError(f"{getattr(f, 'name', 'a shard')}: {entry.name!r} is cut short; download that shard again.")
    return buf.view(entry.dtype).reshape(entry.shape)


class ShardWriter:
    """Writes a safetensors file whose tensors (name, dtype, shape) are known up front, one at a time,
    in the declared order. The bytes go out on a background thread while the caller converts the next
    tensor (file writes release the GIL), one tensor in flight at most. The file is complete only after
    `close()`; the caller renames it into place."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._order.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: Future | None = None

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self._order[self._next]
        if (name, t.dtype, tuple(t.shape)) != want:
            raise AssertionError(f"planned {want}, got {(name, t.dtype, tuple(t.shape))}")  # a planning bug, not input
        self._wait()
        if t.numel():
            self._pending = self._pool.submit(self._f.write, t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        if self._next != len(self._order):
            raise AssertionError(f"{len(self._order) - self._next} planned tensors were not written")
        self._wait()
        self._pool.shutdown()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        self._f.close()
