"""Which Ascend HDK (NPU driver and firmware) versions go with a CANN toolkit (hdk.yaml, one sourced row
per CANN line): the pairing users get wrong first, because pip cannot see either half of it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["Pairing", "cann_for", "drivers_for", "pairing"]

TABLE = Path(__file__).with_name("hdk.yaml")


@dataclass(frozen=True)
class _Row:
    cann: str
    hdk: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Pairing:
    """supported: True / False, or None when no row covers this CANN (then nothing is known)."""

    supported: bool | None
    drivers: tuple[str, ...]  # the HDK versions the rows list for this CANN
    sources: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def _rows() -> tuple[_Row, ...]:
    data = yaml.safe_load(TABLE.read_text())
    return tuple(_Row(str(r["cann"]), tuple(str(v) for v in r["hdk"]), r["source"]) for r in data["rows"])


def _covers(pattern: str, version: str) -> bool:
    """'25.0.X' covers 25.0.anything; '25.2.0' covers itself and its patch builds (25.2.0.1). Case-blind:
    version files say 25.0.rc1 where the tables say 25.0.RC1."""
    p, v = pattern.upper(), version.strip().upper()
    if p.endswith(".X"):
        return v.startswith(p[:-1])
    return v == p or v.startswith(p + ".")


def _rows_for(cann: str) -> list[_Row]:
    return [r for r in _rows() if _covers(r.cann, cann)]


def drivers_for(cann: str) -> tuple[str, ...]:
    """The HDK versions listed for `cann` (empty: no row covers it)."""
    return tuple(dict.fromkeys(d for r in _rows_for(cann) for d in r.hdk))


def pairing(cann: str, driver: str) -> Pairing:
    """Whether the installed driver is one the tables list for the installed CANN."""
    rows = _rows_for(cann)
    if not rows:
        return Pairing(None, (), ())
    drivers = tuple(dict.fromkeys(d for r in rows for d in r.hdk))
    return Pairing(any(_covers(d, driver) for d in drivers), drivers, tuple(dict.fromkeys(r.source for r in rows)))


def cann_for(driver: str) -> tuple[str, ...]:
    """The CANN lines whose rows list this driver (for the fix of a mismatch)."""
    return tuple(dict.fromkeys(r.cann for r in _rows() if any(_covers(d, driver) for d in r.hdk)))
