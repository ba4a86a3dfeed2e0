"""Sizes as users write them on the command line and in serve.yaml."""

from __future__ import annotations

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `2g` or a byte count; ValueError saying what is expected otherwise."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(s[:-1]) * _UNITS[s[-1]]) if s and s[-1] in _UNITS else int(s)
    except (ValueError, IndexError):
        raise ValueError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or a byte count") from None
