"""The choice table: which candidate runs each op, per dtype and shape bucket, chosen from measurements.

Format (YAML, one file per chip; `flagdeploy ops tune --chip X` writes it, backends/generic/tune.py):

    chip: c550            # the catalog id (or the family, for `--chip generic`)
    family: metax
    device: cuda
    torch: 2.8.0+metax...
    flag_gems: 5.0.2      # null where it could not be imported (its candidates then all failed)
    buckets: [1, 16, 64, 256] # rows: a call with m rows takes the first bucket >= m, else the last
    ops:
      rms_norm:
        bfloat16/m16:
          choice: flaggems
          candidates:
            flaggems: {error: 0.0039, time_us: 41.2, passed: true, capturable: true, replay_us: 3.1}
            torch: {error: 0.0039, time_us: 14.0, passed: true, capturable: true, replay_us: 6.0}
            reference: {error: 0.0, time_us: 30.5, passed: true, capturable: true, replay_us: 21.7}

The choice is the fastest candidate that passed its check against the float64 reference within the op's
tolerance; a failed candidate is never chosen, whatever it costs. Loading checks that again: an entry
whose choice did not pass, or names a candidate this backend does not have, runs the reference. Without
a table every op runs the reference (the safe default).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch
import yaml

from flagdeploy.ops.registry import OPS

from .candidates import candidates

log = logging.getLogger(__name__)

BUCKETS = (1, 16, 64, 256)
ENV_TABLE = "FLAGDEPLOY_GENERIC_CHOICES"  # a table file to load instead of the default path


def default_path(chip: str) -> Path:
    """Where `ops tune --chip X` writes X's table and the backend looks for it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flagdeploy" / "generic" / f"{chip}.yaml"


def bucket(rows: int, buckets=BUCKETS) -> int:
    for b in buckets:
        if rows <= b:
            return b
    return buckets[-1]


def key(dtype: torch.dtype | str, b: int) -> str:
    return f"{str(dtype).removeprefix('torch.')}/m{b}"


def rows_of(op: str, args) -> int:
    """The rows of a call: tokens for token-wise ops, sequences for decode attention."""
    x = args[0]
    if op == "embedding":
        return x.numel()
    if op == "linear":
        return x.numel() // x.shape[-1]
    return x.shape[0]


def choose(results: dict[str, dict]) -> str:
    """The fastest candidate that passed (ties: the first listed); the reference where none did. Where the
    engine captures decode steps as graphs (the tuner then records `capturable` and `replay_us` for
    decode-sized calls), the passing candidates that capture are compared by their time under graph replay,
    which is what a captured step pays, and one that cannot be captured is taken only if none can: it would
    break the capture."""
    ok = [(r["time_us"], i, name) for i, (name, r) in enumerate(results.items()) if r.get("passed")]
    captured = [(results[name]["replay_us"], i, name) for _, i, name in ok if results[name].get("capturable")
                and results[name].get("replay_us") is not None]
    ok = captured or [c for c in ok if results[c[2]].get("capturable", True)] or ok
    return min(ok)[2] if ok else "reference"


def write(table: dict, path: str | os.PathLike) -> Path:
    """Write atomically: a temporary file beside it, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"# measured by `flagdeploy ops tune --chip {table.get('chip')}`\n" + yaml.safe_dump(table, sort_keys=False))
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike) -> dict:
    return yaml.safe_load(Path(path).read_text()) or {}


class Choices:
    """A loaded table: (op, dtype/bucket) -> the implementation to call."""

    def __init__(self, table: dict | None = None, source: str = "none"):
        self.table = table or {}
        self.source = source
        self.buckets = tuple(self.table.get("buckets") or BUCKETS)
        self.picked: dict[str, dict[str, tuple[str, Callable]]] = {}
        for op, entries in (self.table.get("ops") or {}).items():
            if op not in OPS:
                log.warning("choice table %s names unknown op %s; ignored", source, op)
                continue
            cands = candidates(op)
            for k, entry in (entries or {}).items():
                name = entry.get("choice", "reference")
                result = (entry.get("candidates") or {}).get(name) or {}
                if name not in cands or not result.get("passed"):
                    log.warning("choice table %s: %s %s chooses %r, which %s; running the reference", source, op, k,
                                name, "this backend does not have" if name not in cands else "did not pass its check")
                    name = "reference"
                self.picked.setdefault(op, {})[k] = (name, cands[name])

    def lookup(self, op: str, dtype, rows: int) -> tuple[str, Callable]:
        per_op = self.picked.get(op)
        if per_op:
            hit = per_op.get(key(dtype, bucket(rows, self.buckets)))
            if hit:
                return hit
        return "reference", OPS[op].reference

    def describe(self, op: str) -> dict[str, str]:
        """bucket -> candidate, for `ops list`."""
        return {k: name for k, (name, _) in sorted(self.picked.get(op, {}).items())}


def load(path: str | os.PathLike | None) -> Choices:
    if path is None or not Path(path).exists():
        return Choices(None, "none")
    return Choices(read(path), str(path))
