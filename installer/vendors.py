"""The vendors that run the generic backend (vendors.yaml): their tool, device nodes, host prerequisites, runtime
environment and where their packages come from.

Detection, `install` and `doctor` read these instead of branching per vendor, so a new vendor, a renamed device
node or a corrected SDK path is a data change; every entry carries its source and the fields it is not sure of,
which the plan and the findings repeat to the user.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = ["HostNeed", "Vendor", "get", "vendors"]

DATA = Path(__file__).with_name("vendors.yaml")
_FIELDS = ("tool", "device_nodes", "host", "env")


@dataclass(frozen=True)
class HostNeed:
    """A prerequisite pip cannot install. `present`: "tool" (the vendor's tool answered) or a path relative to
    the root that exists once it is installed."""

    key: str
    what: str
    present: str
    how: str


@dataclass(frozen=True)
class Vendor:
    family: str  # = chips.yaml `backend:`, the generic backend's family and the matrix's family
    name: str
    tool: str | None
    per_device: tuple[str, ...]  # alternative globs under /dev, one match per device
    shared: tuple[str, ...]  # nodes under /dev every process needs besides
    host: tuple[HostNeed, ...]
    env_source: tuple[str, ...]
    env_vars: dict[str, str] = field(default_factory=dict)
    packages_from: str = ""
    source: str = ""
    unconfirmed: tuple[str, ...] = ()

    def device_node_paths(self) -> list[str]:
        """The node patterns as /dev paths, for messages."""
        return [f"/dev/{p}" for p in (*self.per_device, *self.shared)]


@functools.lru_cache(maxsize=None)
def vendors() -> dict[str, Vendor]:
    """Load and check vendors.yaml once: a malformed entry fails here, not as a silent miss in detection."""
    out = {}
    for family, raw in yaml.safe_load(DATA.read_text())["vendors"].items():
        where = f"{DATA.name} vendor {family}"
        missing = [k for k in ("name", "device_nodes", "host", "env", "packages_from", "source") if k not in raw]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        unconfirmed = tuple(raw.get("unconfirmed") or ())
        if set(unconfirmed) - set(_FIELDS):
            raise ValueError(f"{where}: unconfirmed may only name {_FIELDS}")
        needs = []
        for need in raw["host"]:
            if not all(need.get(k) for k in ("key", "what", "present", "how")):
                raise ValueError(f"{where}: a host entry needs key, what, present and how")
            if need["present"] == "tool" and not raw.get("tool"):
                raise ValueError(f"{where}: host {need['key']} is present by the tool, but the vendor names none")
            needs.append(HostNeed(str(need["key"]), str(need["what"]), str(need["present"]), str(need["how"])))
        nodes = raw["device_nodes"]
        out[str(family)] = Vendor(
            family=str(family), name=str(raw["name"]), tool=raw.get("tool"),
            per_device=tuple(nodes.get("per_device") or ()), shared=tuple(nodes.get("shared") or ()),
            host=tuple(needs), env_source=tuple(raw["env"].get("source") or ()),
            env_vars={str(k): str(v) for k, v in (raw["env"].get("vars") or {}).items()},
            packages_from=" ".join(str(raw["packages_from"]).split()), source=" ".join(str(raw["source"]).split()),
            unconfirmed=unconfirmed)
    return out


def get(family: str | None) -> Vendor | None:
    """The vendor of a family (a chip's `backend:`), or None for the families with their own backend."""
    return vendors().get(family or "")
