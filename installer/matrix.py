"""The compatibility matrix (matrix.yaml): for a chip family and an engine, the one set of versions that
works together.

On Ascend the driver, CANN, torch, torch_npu, triton-ascend and the engine must match, and A3 needs other
builds than A2; keeping that as sourced data means a wrong pin is a one-line fix and every plan can say where
its versions come from and which of them are unconfirmed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flagdeploy.errors import FlagdeployError

__all__ = ["ENGINES", "StackRow", "UnsupportedStackError", "all_rows", "engines_for", "families", "resolve"]

MATRIX = Path(__file__).with_name("matrix.yaml")
ENGINES = ("builtin", "vllm-ascend", "vllm", "sglang", "mindie", "onnxruntime")
_FIELDS = ("python", "packages", "cann_min", "image")


class UnsupportedStackError(FlagdeployError, KeyError):
    """No matrix row for this family and engine; the message lists what the family does have."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass(frozen=True)
class StackRow:
    """One family x engine combination. `packages` maps PyPI names to pip specifiers ("" = unpinned);
    `unconfirmed` names the fields the source does not back, so the plan can warn about them."""

    family: str
    engine: str
    python: str
    packages: dict[str, str]
    cann_min: str | None
    image: str | None
    notes: str
    source: str
    unconfirmed: tuple[str, ...] = ()
    # vendor builds (not on PyPI; the plan says where from), the vendor's pip index where a source names one, and
    # the local-label prefix an installed build must carry where the pin cannot say it ({"torch": "das"})
    vendor_packages: tuple[str, ...] = ()
    vendor_index: str | None = None
    builds: dict[str, str] = field(default_factory=dict)
    packages_from: str = ""  # where this row's vendor builds come from, where not the vendor's (vendors.yaml) own

    @property
    def confirmed(self) -> bool:
        return not self.unconfirmed

    def requirements(self) -> list[str]:
        """pip arguments, e.g. ['torch==2.12.0', 'flagdeploy']."""
        return [f"{name}{spec}" for name, spec in self.packages.items()]


@functools.lru_cache(maxsize=None)
def all_rows() -> tuple[StackRow, ...]:
    """Load and check matrix.yaml once; a malformed row fails here, not as a wrong install later."""
    rows = []
    for i, raw in enumerate(yaml.safe_load(MATRIX.read_text())["rows"]):
        where = f"{MATRIX.name} row {i} ({raw.get('family')}/{raw.get('engine')})"
        missing = [k for k in ("family", "engine", "python", "source") if not raw.get(k)]
        if missing or not isinstance(raw.get("packages"), dict):  # packages may be {} (image-only engines)
            raise ValueError(f"{where}: missing {missing or ['packages']}")
        if raw["engine"] not in ENGINES:
            raise ValueError(f"{where}: engine must be one of {ENGINES}")
        unconfirmed = tuple(raw.get("unconfirmed") or ())
        if set(unconfirmed) - set(_FIELDS):
            raise ValueError(f"{where}: unconfirmed may only name {_FIELDS}")
        vendor_packages = tuple(raw.get("vendor_packages") or ())
        builds = {str(k): str(v) for k, v in (raw.get("builds") or {}).items()}
        if not set(vendor_packages) | set(builds) <= set(raw["packages"]):
            raise ValueError(f"{where}: vendor_packages and builds may only name its packages")
        rows.append(StackRow(
            family=str(raw["family"]), engine=raw["engine"], python=str(raw["python"]),
            packages={str(k): str(v or "") for k, v in raw["packages"].items()},
            cann_min=None if raw.get("cann_min") is None else str(raw["cann_min"]),
            image=raw.get("image"), notes=str(raw.get("notes") or ""), source=str(raw["source"]),
            unconfirmed=unconfirmed, vendor_packages=vendor_packages, vendor_index=raw.get("vendor_index"),
            builds=builds, packages_from=" ".join(str(raw.get("packages_from") or "").split())))
    keys = [(r.family, r.engine) for r in rows]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise ValueError(f"{MATRIX.name}: duplicate rows {sorted(dupes)}")
    return tuple(rows)


def families() -> list[str]:
    return list(dict.fromkeys(r.family for r in all_rows()))


def _family(family: str) -> str:
    """Case-insensitive match ('a3' -> 'A3'); unknown families raise with the known ones."""
    for known in families():
        if known.lower() == str(family).strip().lower():
            return known
    raise UnsupportedStackError(f"No stack for chip family {family!r}. Known families: {', '.join(families())}.")


def engines_for(family: str) -> list[str]:
    """Engines the matrix has a row for on this family, in ENGINES order (builtin first)."""
    family = _family(family)
    have = {r.engine for r in all_rows() if r.family == family}
    return [e for e in ENGINES if e in have]


def resolve(family: str, engine: str) -> StackRow:
    """The row for (family, engine); otherwise an error naming the engines this family does have."""
    family = _family(family)
    engine = engine.strip().lower()
    for row in all_rows():
        if row.family == family and row.engine == engine:
            return row
    raise UnsupportedStackError(
        f"No {engine!r} stack for {family}. Engines for {family}: {', '.join(engines_for(family))} "
        f"(pass one with --engine).")
