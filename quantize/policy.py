"""Quantization policies: ordered rules from tensor-name patterns to schemes, as YAML data.

The first rule whose glob matches a tensor's name decides its scheme (a policy should end with a
catch-all `"*"`). Shipped policies live in `policies/`; `--policy` takes one of their names or a path.
A policy is checked against a chip before anything is written: a rule whose scheme needs a matmul
dtype the chip lacks (fp8 on ascend910c) is an error, not a silent fallback.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import yaml

from flagdeploy.chips import Chip
from flagdeploy.errors import FlagdeployError

from .schemes import SCHEMES

POLICIES_DIR = Path(__file__).with_name("policies")


class PolicyError(FlagdeployError, ValueError):
    """A policy file is malformed, names an unknown scheme, or needs what the chip does not have."""


@dataclass(frozen=True)
class Rule:
    match: str  # fnmatch glob on the tensor name ("*" crosses dots)
    scheme: str
    group_size: int = 0  # w8a16 only: input channels per scale (0 = one scale per output channel)


@dataclass(frozen=True)
class Policy:
    name: str
    description: str
    rules: tuple[Rule, ...]

    def rule_for(self, tensor_name: str) -> Rule:
        for rule in self.rules:
            if fnmatch.fnmatchcase(tensor_name, rule.match):
                return rule
        raise PolicyError(f"policy {self.name!r} has no rule for tensor {tensor_name!r}; end its rules with a "
                          f"catch-all such as {{match: '*', scheme: bf16}}.")

    def check_chip(self, chip: Chip) -> None:
        for rule in self.rules:
            need = SCHEMES[rule.scheme].requires
            if need and not chip.supports(need):
                raise PolicyError(
                    f"policy {self.name!r} puts {rule.match!r} in scheme {rule.scheme!r}, which needs {need} matmuls, "
                    f"but {chip.id} ({chip.name}) runs only {', '.join(chip.matmul_dtypes)}. Use a policy for this "
                    f"chip (default: {default_policy_name(chip)!r}) or change that rule.")


def shipped_policies() -> list[str]:
    return sorted(p.stem for p in POLICIES_DIR.glob("*.yaml"))


def default_policy_name(chip: Chip) -> str:
    """FP8 chips keep the FP8 checkpoint; chips with int8 matmuls get the BF16/INT8 mix; others BF16."""
    if chip.supports("fp8"):
        return "fp8"
    return "no-fp8" if chip.supports("int8") else "bf16"


def load_policy(name_or_path: str | Path) -> Policy:
    path = Path(name_or_path)
    if not path.suffix and (POLICIES_DIR / f"{name_or_path}.yaml").exists():
        path = POLICIES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise PolicyError(f"no policy {str(name_or_path)!r}: pass a shipped policy ({', '.join(shipped_policies())}) "
                          f"or the path of a policy YAML file.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list) or not data["rules"]:
        raise PolicyError(f"{path}: a policy is a mapping with a non-empty `rules:` list of {{match, scheme}} entries.")
    rules = []
    for i, r in enumerate(data["rules"]):
        if not isinstance(r, dict) or set(r) - {"match", "scheme", "group_size"} or not {"match", "scheme"} <= set(r):
            raise PolicyError(f"{path}: rule {i} is {r!r}; each rule needs `match` and `scheme` (and optionally "
                              f"`group_size` for w8a16).")
        if r["scheme"] not in SCHEMES:
            raise PolicyError(f"{path}: rule {i} ({r['match']!r}) names the unknown scheme {r['scheme']!r}; known "
                              f"schemes: {', '.join(SCHEMES)}.")
        group = int(r.get("group_size", 0))
        if group and (r["scheme"] != "w8a16" or group < 0):
            raise PolicyError(f"{path}: rule {i} sets group_size {group}; only w8a16 takes a (positive) group size.")
        rules.append(Rule(str(r["match"]), r["scheme"], group))
    return Policy(str(data.get("name", path.stem)), str(data.get("description", "")), tuple(rules))
