"""A GGUF file's key-value header, read without loading the file (for callers that need a few keys fast)."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: Path, keys: set[str]) -> dict[str, Any]:
    """`keys` of a GGUF file's key-value header (v2/v3, little-endian; arrays as lists). gguf's
    GGUFReader parses every field and tensor up front, a numpy view per vocabulary entry: seconds
    of Python holding the GIL that the gateway's event loop shares. This walks the header once,
    skipping numeric arrays by their size, and keeps only the keys asked for."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")

        def string(pos: int, keep: bool) -> tuple[str | None, int]:
            (size,) = struct.unpack_from("<Q", buf, pos)
            return (buf[pos + 8:pos + 8 + size].decode("utf-8", "replace") if keep else None), pos + 8 + size

        def value(kind: int, pos: int, keep: bool) -> tuple[Any, int]:
            if kind == _GGUF_STRING:
                return string(pos, keep)
            if kind != _GGUF_ARRAY:
                return struct.unpack_from(_GGUF_SCALARS[kind], buf, pos)[0], pos + struct.calcsize(_GGUF_SCALARS[kind])
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _GGUF_SCALARS and not keep:
                return None, pos + count * struct.calcsize(_GGUF_SCALARS[item])
            items = []
            for _ in range(count):
                one, pos = value(item, pos, keep)
                items.append(one)
            return (items if keep else None), pos

        found: dict[str, Any] = {}
        pos = 24  # magic, version, tensor count, key-value count
        for _ in range(struct.unpack_from("<Q", buf, 16)[0]):
            key, pos = string(pos, True)
            (kind,) = struct.unpack_from("<I", buf, pos)
            one, pos = value(kind, pos + 4, key in keys)
            if key in keys:
                found[key] = one
            if keys <= found.keys():
                break
        return found
