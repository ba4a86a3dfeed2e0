"""The generic accelerator backend: the builtin engine on any torch device a vendor's build or plugin
provides (cuda builds of MetaX / Iluvatar / Hygon / Kunlunxin, mlu, musa, gcu, npu, ...).

The device type, collective library and graph API of each chip family are data (families.yaml). Each hot
op has up to three candidates (candidates.py: FlagGems' kernel, the vendor's torch op, the reference) and a
per-chip choice table, measured on the device by `flagdeploy ops tune --chip X` (tune.py), says which runs
per dtype and shape bucket (choices.py). Without a table every op runs the reference. See
docs/backends/generic.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch
import yaml

from flagdeploy.ops.registry import Backend

from . import choices
from .candidates import CANDIDATES

log = logging.getLogger(__name__)

ENV_FAMILY = "FLAGDEPLOY_GENERIC_FAMILY"


@lru_cache(maxsize=1)
def families() -> dict[str, dict]:
    return yaml.safe_load((Path(__file__).with_name("families.yaml")).read_text())["families"]


def family_present(name: str) -> bool:
    """Whether this host has a device of family `name`: its torch plugin module is installed (not imported:
    that is for the run), or torch's module for its device type says a device is there and the vendor's
    tool, where the family names one, is on PATH. Cheap, never raises."""
    fam = families()[name]
    try:
        if fam["device_type"] == "cpu":
            return False
        if fam.get("torch_module"):
            return importlib.util.find_spec(fam["torch_module"]) is not None
        mod = getattr(torch, fam["device_type"], None)
        if mod is None or not mod.is_available():
            return False
        return fam.get("tool") is None or shutil.which(fam["tool"]) is not None
    except Exception:  # noqa: BLE001 - detection must never raise
        return False


def device_available(name: str) -> bool:
    """Whether torch sees a device of family `name`'s type (its plugin module imported where installed): the
    backend's detect(). The vendor's tool is not asked: it only orders families sharing a type."""
    fam = families()[name]
    try:
        if fam["device_type"] == "cpu":
            return False
        module = fam.get("torch_module")
        if module:
            if importlib.util.find_spec(module) is None:
                return False
            importlib.import_module(module)
        mod = getattr(torch, fam["device_type"], None)
        return bool(mod is not None and mod.is_available())
    except Exception:  # noqa: BLE001 - detection must never raise
        return False


def default_family() -> str:
    """$FLAGDEPLOY_GENERIC_FAMILY, else the first family of families.yaml present here, else the first whose
    device type torch sees (a cuda build without the vendor's tool on PATH), else the host."""
    env = os.environ.get(ENV_FAMILY)
    if env:
        if env not in families():
            raise ValueError(f"{ENV_FAMILY}={env!r} is not a family of backends/generic/families.yaml "
                             f"({', '.join(families())})")
        return env
    for name in families():
        if family_present(name):
            return name
    for name, fam in families().items():
        mod = getattr(torch, fam["device_type"], None)
        if fam["device_type"] != "cpu" and mod is not None and getattr(mod, "is_available", lambda: False)():
            return name
    return "host"


class _State:
    """One backend instance's choice table, loaded on first use: $FLAGDEPLOY_GENERIC_CHOICES, else the
    chip's file under the cache directory (choices.default_path), else none (every op the reference)."""

    def __init__(self, chip: str, family: str):
        self.chip, self.family, self._choices = chip, family, None

    def choices(self) -> choices.Choices:
        if self._choices is None:
            vendor = families()[self.family].get("gems_vendor")
            if vendor:
                os.environ.setdefault("GEMS_VENDOR", vendor)  # FlagGems skips probing vendor tools
            self.load(os.environ.get(choices.ENV_TABLE) or choices.default_path(self.chip))
        return self._choices

    def load(self, path) -> choices.Choices:
        self._choices = choices.load(path)
        log.info("generic backend (%s): choice table %s", self.chip, self._choices.source)
        return self._choices


def _dispatcher(op: str, state: _State):
    dtype_arg = 1 if op == "embedding" else 0

    def call(*args, **kwargs):
        _, fn = state.choices().lookup(op, args[dtype_arg].dtype, choices.rows_of(op, args))
        return fn(*args, **kwargs)

    call.__name__ = f"generic_{op}"
    return call


def make_backend(family: str, chip: str | None = None) -> Backend:
    """The backend for one family (and chip: whose choice table it loads; the family's name by default)."""
    fam = families()[family]
    state = _State(chip or family, family)

    def explain(op: str) -> str:
        if op not in CANDIDATES:
            return "reference (no other candidate)"
        picked = state.choices().describe(op)
        return ", ".join(f"{k} {v}" for k, v in picked.items()) if picked else \
            f"reference (no choice table; candidates {', '.join(CANDIDATES[op])}, reference)"

    be = Backend(
        name="generic",
        vendor=family,
        device_type=fam["device_type"],
        dtypes=("float32", "bfloat16", "float16"),
        collective=fam["collective"],
        detect=lambda: device_available(family),
        overrides={op: _dispatcher(op, state) for op in CANDIDATES},
        priority=5,  # below a chip's own backend (cuda 20, ascend 10): chosen when named, or where none is
        description=(f"family {family}: torch device {fam['device_type']}, collectives {fam['collective']}, graphs "
                     f"{fam.get('graph') or 'none'}; per op FlagGems / the vendor's torch op / the reference, chosen "
                     f"per dtype and shape bucket by the choice table of {state.chip} (`flagdeploy ops tune --chip "
                     f"{chip or 'generic'}`)"),
        visible_devices_env="CUDA_VISIBLE_DEVICES" if fam["device_type"] == "cuda" else None,
        families=tuple(f for f in families() if f != "host"),
        specialize=_specialize,
        explain=explain,
    )
    be.state = state  # the loaded table: tests and `ops tune` reach it here
    be.graph = fam.get("graph")
    be.family = family
    return be


def _specialize(chip: str) -> Backend:
    """The backend for a chip of the catalog whose family this backend runs (or a family named directly)."""
    from flagdeploy.chips import get_chip

    family = chip if chip in families() else get_chip(chip).backend
    module = families()[family].get("torch_module")
    if module and importlib.util.find_spec(module) is not None:
        importlib.import_module(module)  # registers the device type (mlu, musa, gcu, npu) with torch
    return make_backend(family, chip)


backend = make_backend(default_family(), None)
