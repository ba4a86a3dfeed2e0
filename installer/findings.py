"""What a check found (`Finding`): the one result type of `flagdeploy doctor`'s single-host checks
(installer/doctor.py) and of its multi-node preflight (installer/peers.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    level: str  # ok, warn, fail
    what: str
    why: str = ""
    fix: str = ""
