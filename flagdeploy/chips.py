"""The chip catalog: per-device memory, bandwidth, throughput, matmul dtypes and links, as typed data.

The figures live in profiles/chips.yaml so that correcting a datasheet number is a data change, not a code
change, and each figure carries its source and a confidence so that a plan can say how much to trust it.
This module only loads and checks that file: the planner, `plan --chip` and the backends read chips from here
so that they all agree on one id per chip. It is also the one place a `--chip` value is resolved
(`resolve_chip`): every command takes the same values (catalog ids, and the backend names the catalog
uses, such as cpu, cuda, ascend) and answers an unknown one with the same error.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from flagdeploy.errors import UnknownChipError
from flagdeploy.profiles import PROFILES_DIR

__all__ = ["Chip", "ChipChoice", "Interconnect", "Source", "all_chips", "backend_names", "get_chip", "resolve_chip"]

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
    product_names: tuple[str, ...] = ()  # exact names nvidia-smi & co. report, where the id alone is ambiguous

    def supports(self, dtype: str) -> bool:
        """Whether the matrix unit runs `dtype` natively (e.g. fp8 on H100 and Ascend 950, not on 910B/910C)."""
        return dtype in self.matmul_dtypes


@dataclass(frozen=True)
class ChipChoice:
    """What a `--chip` value names: a chip of the catalog (and so its backend), or, for the backend names
    kept for compatibility (cpu, cuda, ascend, ...), only a backend that several chips may share.

    `value` is the canonical spelling to pass on (the catalog id, else the backend name).
    """

    value: str
    backend: str
    chip: Chip | None

    def require_chip(self) -> Chip:
        """The chip itself, for commands that need its specs (plan, deploy, quantize): a backend name
        resolves only where the catalog has exactly one chip on that backend, since figures such as memory
        size differ between the chips of one backend."""
        if self.chip is not None:
            return self.chip
        mine = [c.id for c in all_chips() if c.backend == self.backend]
        if len(mine) == 1:
            return get_chip(mine[0])
        raise UnknownChipError(
            f"--chip {self.value} names the {self.backend} backend, which runs several chips of the catalog: "
            f"{', '.join(mine) or 'none'}. This command needs the chip's own figures (memory, bandwidth): pass "
            f"its id, e.g. --chip {mine[0] if mine else 'cpu'}.")


def resolve_chip(value: str, plugin_backends: Iterable[str] = ()) -> ChipChoice:
    """A `--chip` value as a ChipChoice: a catalog id (case-insensitive), else a backend name that the
    catalog uses (cpu, cuda, ascend, cambricon, ...) or that an installed plugin provides
    (`plugin_backends`). An unknown value raises UnknownChipError naming the valid values, with the
    closest ones first."""
    key = value.strip().lower()
    chips = _catalog()
    if key in chips:
        return ChipChoice(key, chips[key].backend, chips[key])
    backends = [*backend_names(), *(b for b in plugin_backends if b not in backend_names())]
    if key in backends:
        return ChipChoice(key, key, None)
    raise UnknownChipError(_unknown_message(value, list(chips), backends))


def backend_names() -> list[str]:
    """The backends the catalog's chips run on, in file order (cpu, cuda, ascend, ...)."""
    return list(dict.fromkeys(c.backend for c in _catalog().values()))


def _unknown_message(value: str, ids: list[str], backends: list[str]) -> str:
    close = difflib.get_close_matches(value.strip().lower(), ids + backends, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"Unknown chip {value!r}.{hint} Known chips: {', '.join(ids)}; or a backend name: {', '.join(backends)}. "
            f"Pass one of them to --chip (profiles/chips.yaml lists each chip's figures).")


def get_chip(chip_id: str) -> Chip:
    """The chip with this id (case-insensitive), or the one chip of a backend named alone; otherwise
    UnknownChipError naming the valid values (see `resolve_chip`, `ChipChoice.require_chip`)."""
    return resolve_chip(chip_id).require_chip()


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
        product_names=tuple(str(n) for n in spec.get("product_names") or ()),
    )
