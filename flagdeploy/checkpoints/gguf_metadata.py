"""A GGUF file's key-value header, read without loading the file (for callers that need a few keys fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gguf_file import GGUFFile


def gguf_metadata(path: Path, keys: set[str]) -> dict[str, Any]:
    """`keys` of a GGUF file's key-value header (arrays as lists); keys the file lacks are left out.
    Only those values are decoded (gguf_file.py: the gateway's event loop shares the GIL with this)."""
    f = GGUFFile(path)
    return {k: f.get(k) for k in keys & f.keys()}
