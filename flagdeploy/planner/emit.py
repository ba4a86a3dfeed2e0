"""Translate a neutral deployment profile into an external engine's launch: argv, environment and files.

The engine vocabularies and their chip/model quirks live in profiles/engines.yaml, each rule with its
source, so that this module only interprets data: a new engine flag or a new "on chip X, model Y needs Z"
is a YAML edit that a reviewer can check against the cited document, not a new if-branch here.

    launch = emit(profile, "vllm-ascend")
    print(launch.shell())          # copy-pasteable: files, setup lines, then ENV=... argv

A profile over several nodes has one launch per node (node 0, the head that serves the API, first); the
multi-node flags and the per-node network environment are rules in engines.yaml too:

    for rank, launch in enumerate(emit_nodes(profile, "vllm-ascend", head_addr="10.0.0.1", nic="eth0")):
        print(f"# node {rank} of {profile.nodes}", launch.shell(), sep="\n")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flagdeploy.chips import get_chip
from flagdeploy.errors import FlagdeployError
from flagdeploy.planner.profile import Profile
from flagdeploy.profiles import PROFILES_DIR

__all__ = ["ENGINES", "LAYOUT_ENGINES", "EmitError", "Launch", "chip_engines", "emit", "emit_nodes", "emit_worker",
           "engine_data", "engine_form", "layout_refusal", "shell_word", "uneven_expert_engines"]

ENGINES_FILE = PROFILES_DIR / "engines.yaml"
# Names usable in `when` and templates besides the Profile fields (see the engines.yaml header).
DERIVED = ("engine", "backend", "vendor", "tp_dp", "dp_attention", "served_name", "visible_devices", "device_ids",
           "num_verify_tokens", "replica_devices", "replica_in_node", "dp_local", "dp_start_rank",
           "ep_spans_dp", "all_devices", "dp_all",  # the layout names of the `layouts` section
           # per node (emit_nodes); one node: rank 0, the addresses None
           "node_rank", "node_ip", "head_addr", "nic", "npu_direct_roce")
_ONE_NODE: dict[str, Any] = {"node_rank": 0, "node_ip": None, "head_addr": None, "nic": None, "npu_direct_roce": False}
# The shell variables a node's script reads unless emit_nodes is given the values; the script stops with this
# text when one is unset (no apostrophes: the text sits inside double quotes).
SHELL_VARIABLES = {
    "HEAD_IP": "the address of node 0 (the head), reachable from every node",
    "NODE_IP": "the address of this node, on the interface NIC",
    "NIC": "the network interface that carries the traffic between the nodes (ip -o -4 addr)",
}
# Fields that describe where/what runs rather than how: never reported as "not mapped".
_CONTEXT_ONLY = {"model", "chip", "model_type", "devices", "nodes", "engine"}
_OPS = {"gt": lambda a, b: a is not None and a > b, "ge": lambda a, b: a is not None and a >= b,
        "lt": lambda a, b: a is not None and a < b, "ne": lambda a, b: a != b,
        "in": lambda a, b: a in b, "not_in": lambda a, b: a not in b}
_RULE_ACTIONS = {"reject", "set", "flags", "drop", "env", "warn"}
_SOLE_PLACEHOLDER = re.compile(r"^\{(\w+)\}$")
_SHELL_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
_EXPANDABLE = re.compile(r"^[\w$.:,/@%+={}-]*$")  # shell variables and characters safe inside double quotes


class EmitError(FlagdeployError, ValueError):
    """The profile cannot be emitted for that engine (unknown engine, a rule rejects it, a value it lacks)."""


@dataclass
class Launch:
    """One engine launch: what to write, what to set, what to run, and what the user should know.

    `setup` holds shell lines to run before the command (sourcing CANN scripts, cd into an install dir);
    they are kept apart from `argv` so that argv stays an exact exec() vector. A value that refers to a shell
    variable (`$HEAD_IP` in a node's launch from emit_nodes) is double-quoted in `shell()`, so the shell fills it.
    """

    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """A copy-pasteable script; its last line is `VAR=value ... argv` and re-parses with shlex."""
        lines = [f"# warning: {w}" for w in self.warnings]
        for path, content in self.files.items():
            lines += [f"cat > {shlex.quote(path)} <<'EOF'", content.rstrip("\n"), "EOF"]
        lines += self.setup
        lines.append(" ".join([f"{k}={shell_word(v)}" for k, v in self.env.items()]
                              + [shell_word(a) for a in self.argv]))
        return "\n".join(lines) + "\n"


def shell_word(text: str) -> str:
    """shlex.quote, except that a word made of shell variables and safe characters is double-quoted ("$NIC")."""
    if _SHELL_REF.search(text) and _EXPANDABLE.match(text):
        return f'"{text}"'
    return shlex.quote(text)


def _as_list(x: Any) -> list:
    return [] if x is None else x if isinstance(x, list) else [x]


@functools.lru_cache(maxsize=None)
def _spec() -> dict[str, Any]:
    """Load and check engines.yaml once: a typo in a rule should fail at load, not silently never match."""
    data = yaml.safe_load(ENGINES_FILE.read_text())
    engines, rules = data["engines"], data["rules"]
    names = {f.name for f in dataclasses.fields(Profile)} | set(DERIVED)
    for rule in rules:
        where = f"{ENGINES_FILE.name}: rule {rule.get('id')!r}"
        if not rule.get("source") or not isinstance(rule.get("when"), dict):
            raise ValueError(f"{where}: every rule needs a source and a `when` mapping")
        if not _RULE_ACTIONS & set(rule):
            raise ValueError(f"{where}: no action (one of {sorted(_RULE_ACTIONS)})")
        if unknown := set(rule["when"]) - names:
            raise ValueError(f"{where}: unknown condition keys {sorted(unknown)}")
        for eng in _as_list(rule["when"].get("engine")):
            if eng not in engines:
                raise ValueError(f"{where}: unknown engine {eng!r}")
    layouts = data["layouts"]
    for entry in layouts["refuse"]:
        where = f"{ENGINES_FILE.name}: layouts entry {entry.get('id')!r}"
        if not entry.get("source") or not entry.get("why") or not isinstance(entry.get("when"), dict):
            raise ValueError(f"{where}: every entry needs a source, a why and a `when` mapping")
        if unknown := set(entry["when"]) - names:
            raise ValueError(f"{where}: unknown condition keys {sorted(unknown)}")
        if unknown := set(_as_list(entry.get("engine"))) - {"builtin", *engines} or not entry.get("engine"):
            raise ValueError(f"{where}: unknown engine(s) {sorted(unknown) if unknown is not True else None}")
    for entry in layouts.get("uneven_experts", []):
        if entry.get("engine") not in engines or not entry.get("source"):
            raise ValueError(f"{ENGINES_FILE.name}: layouts.uneven_experts entry {entry!r} needs a known engine and a source")
    pd = data.get("pd") or {}
    for name, eng in (pd.get("engines") or {}).items():
        where = f"{ENGINES_FILE.name}: pd.engines.{name}"
        if name not in engines:
            raise ValueError(f"{where}: not an engine of this file")
        if not (eng.get("router") or {}).get("source") or not all(c.get("source") for c in eng["connectors"].values()):
            raise ValueError(f"{where}: its router and every connector need a source")
    for recipe in pd.get("recipes") or []:
        if recipe.get("engine") not in engines or not recipe.get("source"):
            raise ValueError(f"{ENGINES_FILE.name}: pd recipe {recipe.get('id')!r} needs a known engine and a source")
    if missing := {"builtin", *engines} - set(layouts["forms"]):
        raise ValueError(f"{ENGINES_FILE.name}: layouts.forms lacks {sorted(missing)}")
    for name, eng in engines.items():
        if unknown := set(eng["flags"]) - names:
            raise ValueError(f"{ENGINES_FILE.name}: engine {name!r} maps unknown fields {sorted(unknown)}")
        for field_name, fspec in eng["flags"].items():
            if "via" in fspec and fspec["via"] not in eng["flags"]:
                raise ValueError(f"{ENGINES_FILE.name}: engine {name!r}: {field_name} is passed via "
                                 f"{fspec['via']!r}, which it does not map")
    return data


ENGINES: tuple[str, ...] = tuple(_spec()["engines"])
# Every engine the `layouts` section speaks of: flagdeploy's own (`serve`) and the external ones.
LAYOUT_ENGINES: tuple[str, ...] = ("builtin", *ENGINES)


def layout_refusal(profile: Profile, engine: str) -> str | None:
    """Why `engine` does not run `profile`'s layout (tp/dp/ep/pp over its nodes), with the entry's id and source,
    or None when it runs it: the engines.yaml `layouts` section, which the planner filters by and emit obeys."""
    if engine not in LAYOUT_ENGINES:
        raise EmitError(f"Unknown engine {engine!r}. Known engines: {', '.join(LAYOUT_ENGINES)}")
    ctx = _context(profile, engine, get_chip(profile.chip), _ONE_NODE)
    for entry in _spec()["layouts"]["refuse"]:
        if engine in _as_list(entry["engine"]) and all(_match(ctx.get(k), c) for k, c in entry["when"].items()):
            return f"{_render(entry['why'], ctx, None)} [{entry['id']}; {entry['source']}]"
    return None


def uneven_expert_engines() -> list[str]:
    """The engines that run expert parallelism over a number of ranks that does not divide the experts (the first
    ranks take one more): engines.yaml `layouts.uneven_experts`."""
    return [e["engine"] for e in _spec()["layouts"].get("uneven_experts", [])]


def chip_engines(chip: str) -> list[str]:
    """The engines of LAYOUT_ENGINES that run on `chip` at all: those no reject rule that names only the engine
    and the chip (engine, backend, vendor, chip) refuses, e.g. vllm-ascend off Ascend; the chip's `deploy` order
    first."""
    c = get_chip(chip)
    deploy = _spec()["deploy"]
    first = deploy["engines_by_backend"].get(c.backend, deploy["engines"])  # deploy's order for the chip first
    out = []
    for engine in dict.fromkeys([*first, *LAYOUT_ENGINES]):
        ctx = {"engine": engine, "backend": c.backend, "vendor": c.vendor, "chip": c.id}
        if not any("reject" in r and set(r["when"]) <= set(ctx) and all(_match(ctx[k], v) for k, v in r["when"].items())
                   for r in _spec()["rules"]):
            out.append(engine)
    return out


def engine_form(engine: str) -> str:
    """What `engine` runs over several nodes, in one line (engines.yaml layouts.forms)."""
    return _spec()["layouts"]["forms"][engine]


def engine_data(engine: str) -> dict[str, Any]:
    """An external engine's engines.yaml entry (its health path, container flags, ...)."""
    _check_engine(engine)
    return _spec()["engines"][engine]


def emit(profile: Profile, engine: str) -> Launch:
    """The launch for `engine` (one of ENGINES) on one node; raises EmitError when the engine or a rule refuses
    it, or when the profile spans several nodes (each has its own launch: emit_nodes)."""
    _check_engine(engine)
    if profile.nodes > 1:
        raise EmitError(f"this profile spans {profile.nodes} nodes, and each node has its own launch: use emit_nodes() "
                        f"(`flagdeploy plan --nodes {profile.nodes} --emit {engine}` prints them) and start each "
                        f"node's command on that node")
    return _emit(profile, engine, _ONE_NODE)


def emit_nodes(profile: Profile, engine: str, head_addr: str = "$HEAD_IP", nic: str = "$NIC",
               npu_direct_roce: bool = False) -> list[Launch]:
    """One launch per node of `profile` (profile.nodes of them), node 0 first: the head, which serves the API.

    `head_addr` is node 0's address as the other nodes reach it and `nic` the interface between the nodes;
    each node's own address is the shell variable `$NODE_IP`. Left as shell variables (the defaults), they are
    filled by the shell that runs the script, which stops with a message when one is unset.
    `npu_direct_roce`: on Ascend, the NPUs' own RoCE ports are the inter-node network; HCCL_IF_IP is then left
    out (engines.yaml rule multinode-ascend-direct-roce). With one node this is [emit(profile, engine)].
    """
    _check_engine(engine)
    if profile.nodes <= 1:
        return [emit(profile, engine)]
    for name, value in (("head_addr", head_addr), ("nic", nic)):
        if name == "nic" and value is None:  # the interface variables are left unset
            continue
        if not value or any(c.isspace() for c in value):
            raise EmitError(f"{name} must be an address or interface name (or a shell variable such as $HEAD_IP), "
                            f"not {value!r}")
    used, total = profile.tp * profile.dp * profile.pp, profile.devices * profile.nodes
    if used != total:
        raise EmitError(f"the layout tp x dp x pp = {profile.tp} x {profile.dp} x {profile.pp} = {used} devices does "
                        f"not fill {profile.nodes} nodes x {profile.devices} devices = {total}; every node's engine "
                        f"expects its share of one layout over all of them (plan again with --nodes {profile.nodes})")
    return [_node_launch(profile, engine, rank, head_addr, nic, npu_direct_roce) for rank in range(profile.nodes)]


def emit_worker(profile: Profile, engine: str, rank_var: str, head_addr: str = "$HEAD_IP", nic: str | None = "$NIC",
                npu_direct_roce: bool = False) -> Launch:
    """One launch for every worker node (rank >= 1) of `profile`, its rank read from the shell variable `rank_var`
    (a LeaderWorkerSet's LWS_WORKER_INDEX): the rules run as for node 1, and the names that depend on the rank
    (node_rank, dp_start_rank) are the shell's, set by the launch's first setup lines."""
    workers = emit_nodes(profile, engine, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce)[1:]
    if not workers:
        raise EmitError("emit_worker needs a profile over several nodes")
    if not re.fullmatch(r"[A-Za-z_]\w*", rank_var):
        raise EmitError(f"rank_var must name a shell variable, not {rank_var!r}")
    ctx = _context(profile, engine, get_chip(profile.chip), _ONE_NODE)
    symbols = {"node_rank": "$NODE_RANK"}
    setup = [f'NODE_RANK="${rank_var}"']
    if ctx["dp_local"] is not None:
        symbols["dp_start_rank"] = "$DP_START_RANK"
        setup.append(f'DP_START_RANK=$(( NODE_RANK * {ctx["dp_local"]} ))')
    launch = _node_launch(profile, engine, 1, head_addr, nic, npu_direct_roce, symbols)
    launch.setup = setup + launch.setup
    return launch


def _node_launch(profile: Profile, engine: str, rank: int, head_addr: str, nic: str | None, npu_direct_roce: bool,
                 symbols: dict[str, str] | None = None) -> Launch:
    """Node `rank`'s launch; `symbols` replaces names in the rendered values (not in the rules' conditions)."""
    node = {"node_rank": rank, "node_ip": "$NODE_IP", "head_addr": head_addr, "nic": nic,
            "npu_direct_roce": npu_direct_roce}
    launch = _emit(profile, engine, node, symbols or {})
    words = [w for w in (*launch.env.values(), *launch.argv) if shell_word(w).startswith('"')]  # expanded
    names = dict.fromkeys(m.group(1) for w in words for m in _SHELL_REF.finditer(w))
    names = [n for n in names if n not in ("NODE_RANK", "DP_START_RANK") or not symbols]
    launch.setup = [f': "${{{n}:?set {n} to {SHELL_VARIABLES.get(n, "its value on this node")}}}"'
                    for n in names] + launch.setup
    return launch


def _check_engine(engine: str) -> None:
    if engine not in _spec()["engines"]:
        raise EmitError(f"Unknown engine {engine!r}. Known engines: {', '.join(ENGINES)} "
                        f"(or `profile` for the flagdeploy profile YAML).")


def _emit(profile: Profile, engine: str, node: dict[str, Any], symbols: dict[str, str] | None = None) -> Launch:
    """The launch of one node: the rules run with `node`'s names (node_rank, the addresses) in their context;
    `symbols` (emit_worker) replaces some of those names in what is rendered, not in what the rules match."""
    spec = _spec()
    eng = spec["engines"][engine]
    chip = get_chip(profile.chip)  # an unknown chip raises UnknownChipError listing the known ones
    prof = dataclasses.replace(profile)
    warnings: list[str] = []
    flag_ops: list[tuple[str, Any]] = []  # (flag, value or None to drop), applied after mapping
    env_extra: dict[str, str] = {}

    symbols = symbols or {}
    for rule in spec["rules"]:
        match_ctx = _context(prof, engine, chip, node)
        if not all(_match(match_ctx.get(k), cond) for k, cond in rule["when"].items()):
            continue
        ctx = match_ctx | symbols
        src = f"[{rule['id']}; {rule['source']}]"
        if "reject" in rule:
            raise EmitError(f"Cannot emit {engine} for chip {prof.chip}: {_render(rule['reject'], ctx, None)} {src}")
        for name, value in (rule.get("set") or {}).items():
            old, default = getattr(prof, name), _default(name)
            if old != value and old != default and "warn" not in rule:
                warnings.append(f"{name} changed from {old!r} to {value!r} for {engine} {src}")
            prof = dataclasses.replace(prof, **{name: value})
        flag_ops += [(f, v) for f, v in (rule.get("flags") or {}).items()] + [(f, None) for f in rule.get("drop", [])]
        for k, v in (rule.get("env") or {}).items():
            value = _render(v, ctx, None)
            if value is not None:  # "{nic}" with no interface given: the variable stays unset
                env_extra[k] = str(value)
        if "warn" in rule:
            warnings.append(f"{_render(rule['warn'], ctx, None)} {src}")

    if why := layout_refusal(profile, engine):  # engines.yaml `layouts`
        raise EmitError(f"Cannot emit {engine} for chip {prof.chip}: {why}")
    ctx = _context(prof, engine, chip, node) | symbols
    flags: dict[str, str | list[str] | None] = {}  # ordered: flag -> value (None: bare switch; a list: nargs)
    config = copy.deepcopy(eng.get("config", {}).get("base", {}))
    for name, fspec in eng["flags"].items():
        value = _field_value(fspec, ctx, name, engine)
        if value is _SKIP:
            continue
        for path in _as_list(fspec.get("json")):
            _set_path(config, path, value)
        for flag, fv in _flag_items(fspec).items():
            flags[flag] = _argval(_render(fv, ctx, value))
    for flag, fv in flag_ops:
        if fv is None:
            flags.pop(flag, None)
        else:
            flags[flag] = _argval(_render(fv, ctx, None))

    for name in sorted({f.name for f in dataclasses.fields(Profile)} - _CONTEXT_ONLY - set(eng["flags"])):
        if getattr(prof, name) != _default(name):
            warnings.append(f"{name}={getattr(prof, name)!r} has no {engine} equivalent here; not emitted")

    argv = [str(_render(a, ctx, None)) for a in eng["program"]]
    for flag, value in flags.items():
        argv += [flag] + ([] if value is None else value if isinstance(value, list) else [value])
    env = {k: str(_render(v, ctx, None)) for k, v in (eng.get("env") or {}).items()} | env_extra
    files = {}
    if "config" in eng:
        files[eng["config"]["file"]] = json.dumps(config, indent=2) + "\n"
        warnings.append(f"merge {eng['config']['file']} into {eng['config']['merge_into']} (the setup lines do it with jq)")
    setup = [str(_render(s, ctx, None)) for s in eng.get("setup", [])]
    return Launch(engine=engine, argv=argv, env=env, files=files, warnings=warnings, setup=setup)


_SKIP = object()


def _field_value(fspec: dict, ctx: dict, name: str, engine: str) -> Any:
    """The engine-side value of one mapped field, or _SKIP when nothing is passed for it."""
    if "via" in fspec:  # passed inside another field's mapping (its templates name this field)
        return _SKIP
    value = ctx[name]
    when = fspec.get("when")  # not "on": YAML 1.1 reads a bare `on` key as the boolean True
    if when is None:
        if value is None or value in fspec.get("omit", []):
            return _SKIP
    elif when != "always" and not _match(value, when):
        return _SKIP
    if "values" in fspec:
        table = fspec["values"]
        if value not in table:
            raise EmitError(f"{engine} has no {name} {value!r}; set {name} to one of: {', '.join(map(str, table))}")
        value = table[value]
        if value is None:
            return _SKIP
    if "value_json" in fspec:
        return json.dumps(_render(fspec["value_json"], ctx, value), separators=(",", ":"))
    if "value" in fspec:
        return _render(fspec["value"], ctx, value)
    return value


def _flag_items(fspec: dict) -> dict[str, Any]:
    if "flag" in fspec:
        return {fspec["flag"]: "{value}"}
    if "switch" in fspec:
        return {fspec["switch"]: True}
    return dict(fspec.get("flags", {}))


def _render(template: Any, ctx: dict, value: Any) -> Any:
    """Fill "{name}" from ctx (and "{value}"); a lone placeholder keeps its type (lists, ints for JSON).
    Mappings and lists are filled item by item (a JSON flag value such as --speculative-config's)."""
    if isinstance(template, dict):
        return {k: _render(v, ctx, value) for k, v in template.items()}
    if isinstance(template, list):
        return [_render(v, ctx, value) for v in template]
    if not isinstance(template, str):
        return template
    names = ctx | {"value": value}
    if m := _SOLE_PLACEHOLDER.match(template):
        return names[m.group(1)]
    return template.format(**names)


def _argval(value: Any) -> str | list[str] | None:
    """argv text for a flag value: True is a bare switch, mappings are JSON (e.g. --speculative-config),
    a list is one argument per item (argparse nargs, e.g. vLLM's --allowed-media-domains A B)."""
    if value is True:
        return None
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, list):
        return [str(v) for v in value]
    return str(value)


def _set_path(doc: dict, path: str, value: Any) -> None:
    """Set `A.B.0.C` in a JSON document, creating mappings on the way (numeric parts index lists)."""
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[last] = value


def _match(actual: Any, cond: Any) -> bool:
    if isinstance(cond, list):
        return actual in cond
    if isinstance(cond, dict):
        return all(_OPS[op](actual, ref) for op, ref in cond.items())
    return actual == cond


def _context(prof: Profile, engine: str, chip: Any, node: dict[str, Any]) -> dict[str, Any]:
    devices = max(prof.devices, 1)
    replica = prof.tp * prof.pp  # the devices of one DP replica
    dp_local = prof.dp // prof.nodes if prof.nodes >= 1 and prof.dp % prof.nodes == 0 else None
    return dataclasses.asdict(prof) | node | {
        "ep_spans_dp": prof.ep > 1 and prof.ep == prof.tp * prof.dp, "all_devices": prof.tp * prof.dp * prof.pp,
        "dp_all": prof.dp * prof.pp, "replica_devices": replica,
        "replica_in_node": replica <= devices and devices % replica == 0,
        "dp_local": dp_local, "dp_start_rank": None if dp_local is None else node["node_rank"] * dp_local,
        "engine": engine, "backend": chip.backend, "vendor": chip.vendor, "tp_dp": prof.tp * prof.dp,
        "dp_attention": prof.dp > 1 and prof.ep > 1,
        "served_name": prof.served_model_name or Path(prof.model).name or prof.model,
        "visible_devices": ",".join(map(str, range(devices))), "device_ids": [list(range(devices))],
        "num_verify_tokens": prof.num_speculative_tokens + 1,  # K drafts + the token they follow, per step
    }


def _default(name: str) -> Any:
    f = Profile.__dataclass_fields__[name]
    return f.default
