"""The launches of a PD plan: each role's engine launch (as `plan --emit` prints it, over its nodes) with the KV
transfer settings of engines.yaml `pd`, and the router in front. Only data is read here: an engine's connector
config, environment, role flags and router command are engines.yaml entries with their sources.

    launches = role_launches(pd_plan, "prefill")      # one per node of the prefill instance, node 0 first
    router = router_launch(pd_plan)                   # the router's command, its URLs shell variables by default
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from flagdeploy.chips import get_chip

from .emit import SHELL_VARIABLES, Launch, _context, _render, emit, emit_nodes, emit_worker, shell_word
from .pd import PDPlan, pd_data
from .profile import Profile

__all__ = ["PD_SHELL_VARIABLES", "add_pd", "role_launches", "role_worker_launch", "router_launch", "script"]

PD_SHELL_VARIABLES = {
    "PREFILL_IP": "the address of the prefill instance's node 0, as the router reaches it",
    "DECODE_IP": "the address of the decode instance's node 0, as the router reaches it",
    "VLLM_ASCEND_DIR": "a vllm-ascend checkout (its examples/ folder holds the proxy)",
}
_SHELL_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def _engine(p: PDPlan) -> dict[str, Any]:
    return pd_data()["engines"][p.engine]


def _names(p: PDPlan, role: str) -> dict[str, Any]:
    """The PD names templates see besides the launch's own (engines.yaml `pd` header)."""
    eng = _engine(p)
    conn = eng["connectors"][p.connector]
    chip = get_chip(p.request.base.chip)
    port = conn.get("kv_port")
    kv_port = port["base"] + port["per_device"] * chip.devices_per_node if port else None
    ports = pd_data()["ports"]
    names = {"role": role, "connector": p.connector, "kv_port": kv_port, "kv_port_text": str(kv_port),
             "bootstrap_port": conn.get("bootstrap_port"),
             "prefill_tp": p.prefill.layout.tp, "prefill_dp": p.prefill.layout.dp,
             "decode_tp": p.decode.layout.tp, "decode_dp": p.decode.layout.dp,
             "router_port": ports["router"], "prefill_port": ports["prefill"], "decode_port": ports["decode"]}
    names |= (eng.get("roles") or {}).get(role, {})  # kv_role
    return names


def add_pd(launch: Launch, p: PDPlan, role: str, profile: Profile, node: dict[str, Any]) -> Launch:
    """`launch` (a role's engine launch on one node) with the PD settings added: the connector's config flag and
    environment, the role's flags, and, when both roles share one node, the devices the role takes."""
    eng = _engine(p)
    conn = eng["connectors"][p.connector]
    chip = get_chip(profile.chip)
    ctx = _context(profile, p.engine, chip, node) | _names(p, role)
    if ctx["node_ip"] is None:  # the connector's side channel must be reachable from the other role's hosts
        ctx["node_ip"] = "$NODE_IP"
    if "kv_transfer_config" in conn:
        ctx["kv_transfer_config"] = json.dumps(_render(conn["kv_transfer_config"], ctx, None), separators=(",", ":"))
    argv = list(launch.argv)
    flags = {**(eng.get("flags") or {}), **((eng.get("roles") or {}).get(role, {}).get("flags") or {})}
    for flag, template in flags.items():
        value = _render(template, ctx, None)
        argv += [flag] if value is True else [flag, str(value)]
    env = dict(launch.env)
    drops = set(conn.get("direct_roce_drops") or []) if node.get("npu_direct_roce") else set()
    for k, v in (conn.get("env") or {}).items():
        value = _render(v, ctx, None)
        if value is not None and k not in drops:
            env[k] = str(value)
    shared = _shared_offset(p, role)
    if shared is not None:
        var = pd_data()["visible_devices_env"].get(chip.backend)
        if var:
            env[var] = ",".join(str(shared + i) for i in range(profile.devices))
    setup = list(launch.setup) + [str(_render(s, ctx, None)) for s in conn.get("setup") or []]
    words = [w for w in (*env.values(), *argv) if shell_word(w).startswith('"')]
    known = [line for line in setup if line.startswith(': "${')]
    for name in dict.fromkeys(m.group(1) for w in words for m in _SHELL_REF.finditer(w)):
        check = f': "${{{name}:?set {name} to {SHELL_VARIABLES.get(name, "its value on this node")}}}"'
        if name in SHELL_VARIABLES and check not in known:
            setup.insert(0, check)
    note = f"PD {role} ({p.connector} connector): {conn['source']}"
    return dataclasses.replace(launch, argv=argv, env=env, setup=setup, warnings=[*launch.warnings, note])


def _shared_offset(p: PDPlan, role: str) -> int | None:
    """The first device of `role` when both roles share one node (decode after prefill), else None."""
    r = p.request
    if r.prefill_nodes is None and r.decode_nodes is None and r.base.nodes == 1:
        return 0 if role == "prefill" else p.prefill.devices
    return None


def role_launches(p: PDPlan, role: str, head_addr: str = "$HEAD_IP", nic: str | None = "$NIC",
                  npu_direct_roce: bool = False) -> list[Launch]:
    """One launch per node of the role's instance, node 0 (its head, which serves the API) first."""
    profile = p.profiles()[role]
    if profile.nodes > 1:
        launches = emit_nodes(profile, p.engine, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce)
    else:
        launches = [emit(profile, p.engine)]
    out = []
    for rank, launch in enumerate(launches):
        node = {"node_rank": rank, "node_ip": "$NODE_IP" if profile.nodes > 1 else None, "head_addr": head_addr,
                "nic": nic, "npu_direct_roce": npu_direct_roce}
        out.append(add_pd(launch, p, role, profile, node))
    return out


def role_worker_launch(p: PDPlan, role: str, rank_var: str, head_addr: str, nic: str | None,
                       npu_direct_roce: bool = True) -> Launch:
    """The launch of every worker node (rank >= 1) of a role over several nodes, its rank from `rank_var`."""
    profile = p.profiles()[role]
    launch = emit_worker(profile, p.engine, rank_var, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce)
    node = {"node_rank": 1, "node_ip": "$NODE_IP", "head_addr": head_addr, "nic": nic,
            "npu_direct_roce": npu_direct_roce}
    return add_pd(launch, p, role, profile, node)


def router_launch(p: PDPlan, prefill_host: str = "$PREFILL_IP", decode_host: str = "$DECODE_IP") -> Launch:
    """The router's command: requests to the prefill instance's head and the decode instance's head."""
    router = _engine(p)["router"]
    names = _names(p, "router")
    conn = _engine(p)["connectors"][p.connector]
    names |= {"prefill_host": prefill_host, "decode_host": decode_host,
              "prefill_url": f"http://{prefill_host}:{names['prefill_port']}",
              "decode_url": f"http://{decode_host}:{names['decode_port']}"}
    names["router_prefill_port"] = _render(conn.get("router_prefill_port"), names, None)
    argv = []
    for a in router["program"]:
        value = _render(a, names, None)
        if value is not None:
            argv.append(str(value))
    setup = []
    for name in dict.fromkeys(m.group(1) for w in argv for m in _SHELL_REF.finditer(w)):
        setup.append(f': "${{{name}:?set {name} to {PD_SHELL_VARIABLES.get(name, "its value")}}}"')
    return Launch(engine=f"{p.engine}-router", argv=argv, setup=setup,
                  warnings=[f"router: install with `{router['install']}` [{router['source']}]"])


def script(p: PDPlan, head_addr: str = "$HEAD_IP", nic: str | None = "$NIC", npu_direct_roce: bool = False) -> str:
    """`plan --pd --emit ENGINE`: every role's node scripts under headings, then the router's."""
    out = []
    for role in ("prefill", "decode"):
        launches = role_launches(p, role, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce)
        for rank, launch in enumerate(launches):
            where = (f"node {rank} of {len(launches)}; HEAD_IP is the {role} instance's node 0"
                     if len(launches) > 1 else "one node")
            out.append(f"# {role} ({where})\n{launch.shell()}")
    out.append(f"# router (any host that reaches both instances)\n{router_launch(p).shell()}")
    if not p.verdict.pays:
        out.insert(0, "".join(f"# warning: PD does not pay here: {why}\n" for why in p.verdict.reasons))
    return "\n".join(out)

