"""The chip catalog: per-device memory, bandwidth, throughput, matmul dtypes and links, as typed data.

The figures live in profiles/chips.yaml so that correcting a datasheet number is a data change, not a code
change, and each figure carries its source and a confidence so that a plan can say how much to trust it.
This module only loads and checks that file: the planner, `plan --chip` and the backends read chips from here
so that they all agree on one id per chip.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import yaml

from flagdeploy.errors import UnknownChipError
from flagdeploy.profiles import PROFILES_DIR

__all__ = ["Chip", "Interconnect", "Source", "all_chips", "get_chip"]

CATALOG = PROFILES_DIR / "chips.yaml"
MATMUL_DTYPES = frozenset({"fp8", "int8", "int4", "bf16", "fp16", "fp32"})
TFLOPS_DTYPES = frozenset({"bf16", "fp16", "int8", "fp8"})
INTERCONNECT_KINDS = frozenset({"hccs", "nvlink", "pcie", "roce"})
CONFIDENCES = frozenset({"high", "medium", "low"})
# Every figure group must say where it comes from: an unsourced number cannot be judged or corrected.
SOURCE_GROUPS = ("memory", "memory_bandwidth", "tflops", "matmul_dtypes", "interconnect")
_REQUIRED = ("name", "vendor", "backend", "memory_gib", "memory_bandwidth_gbs", "tflops", "matmul_dtypes",
             "devices_per_node", "interconnect", "sources")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True)
class Source:
    """Where a group of figures comes from and how far to trust it (high, medium or low)."""

    source: str
    confidence: str


@dataclass(frozen=True)
class Interconnect:
    """How a device reaches the other devices of its node; bandwidth is per device, one direction, GB/s.

    Unidirectional because collective cost models (ring all-reduce, all-to-all) count bytes sent one way.
    """

    kind: str
    bandwidth_gbs: float


@dataclass(frozen=True)
class Chip:
    """One device as the framework sees it (a 910C die, not the two-die package), with its sourced specs.

    Frozen so a chip taken from the cached catalog cannot be changed by one caller under another.
    """

    id: str
    name: str
    vendor: str
    backend: str
    memory_gib: float
    memory_bandwidth_gbs: float
    tflops: dict[str, float]
    matmul_dtypes: tuple[str, ...]
    devices_per_node: int
    interconnect: Interconnect
    sources: dict[str, Source]

    def supports(self, dtype: str) -> bool:
        """Whether the matrix unit runs `dtype` natively (e.g. fp8 on H100 and Ascend 950, not on 910B/910C)."""
        return dtype in self.matmul_dtypes


def get_chip(chip_id: str) -> Chip:
    """The chip with this id (case-insensitive); an unknown id raises UnknownChipError listing the known ids."""
    chips = _catalog()
    chip = chips.get(chip_id.strip().lower())
    if chip is None:
        raise UnknownChipError(
            f"Unknown chip {chip_id!r}. Known chips: {', '.join(chips)}. Pass one of them to --chip."
        )
    return chip


def all_chips() -> list[Chip]:
    """Every chip in the catalog, in file order."""
    return list(_catalog().values())


@functools.lru_cache(maxsize=None)
def _catalog() -> dict[str, Chip]:
    """Parse and check chips.yaml once; a bad entry fails loudly here rather than as a wrong plan later."""
    data = yaml.safe_load(CATALOG.read_text())
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{CATALOG}: expected a mapping of chip id to chip spec")
    return {str(chip_id): _parse(str(chip_id), spec) for chip_id, spec in data.items()}


def _parse(chip_id: str, spec: Any) -> Chip:
    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{CATALOG.name}: chip {chip_id!r}, field {field!r}: {why}")

    if not _ID.match(chip_id):
        raise bad("id", "ids are short lower-case names (a-z, 0-9, '-')")
    if not isinstance(spec, dict):
        raise bad("(entry)", "expected a mapping")
    for field in _REQUIRED:
        if field not in spec or spec[field] is None:
            raise bad(field, "missing")

    matmul = tuple(spec["matmul_dtypes"])
    unknown = sorted(set(matmul) - MATMUL_DTYPES)
    if unknown:
        raise bad("matmul_dtypes", f"unknown dtypes {unknown}; allowed: {sorted(MATMUL_DTYPES)}")

    tflops = {str(k): float(v) for k, v in dict(spec["tflops"]).items()}
    for dtype in tflops:
        if dtype not in TFLOPS_DTYPES or dtype not in matmul:
            raise bad("tflops", f"{dtype!r} must be one of {sorted(TFLOPS_DTYPES)} and listed in matmul_dtypes")

    link = spec["interconnect"]
    if not isinstance(link, dict) or "kind" not in link or "bandwidth_gbs" not in link:
        raise bad("interconnect", "expected {kind, bandwidth_gbs}")
    if link["kind"] not in INTERCONNECT_KINDS:
        raise bad("interconnect", f"kind {link['kind']!r} not in {sorted(INTERCONNECT_KINDS)}")

    sources: dict[str, Source] = {}
    for group, src in dict(spec["sources"]).items():
        if not isinstance(src, dict) or not src.get("source") or src.get("confidence") not in CONFIDENCES:
            raise bad(f"sources.{group}", f"expected {{source, confidence}} with confidence in {sorted(CONFIDENCES)}")
        sources[str(group)] = Source(source=str(src["source"]), confidence=str(src["confidence"]))
    missing = [g for g in SOURCE_GROUPS if g not in sources]
    if missing:
        raise bad("sources", f"no source for {missing}")

    return Chip(
        id=chip_id,
        name=str(spec["name"]),
        vendor=str(spec["vendor"]),
        backend=str(spec["backend"]),
        memory_gib=float(spec["memory_gib"]),
        memory_bandwidth_gbs=float(spec["memory_bandwidth_gbs"]),
        tflops=tflops,
        matmul_dtypes=matmul,
        devices_per_node=int(spec["devices_per_node"]),
        interconnect=Interconnect(kind=str(link["kind"]), bandwidth_gbs=float(link["bandwidth_gbs"])),
        sources=sources,
    )
