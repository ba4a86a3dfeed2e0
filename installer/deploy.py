"""`flagdeploy deploy docker|compose|k8s`: a planner profile rendered as files that run it in a container.

The per-vendor needs (Ascend device nodes and driver mounts, NVIDIA GPU requests, nothing for CPU) live in
containers.yaml next to this file, so the three renderers share one source of truth and a new driver path is a
data change. Every renderer ships the profile itself (a bind-mounted file, or a ConfigMap on Kubernetes) and runs
`flagdeploy serve --profile`, so the container serves exactly what the planner chose.

A profile over several nodes (`nodes: N`) runs one `flagdeploy serve --nnodes N --node-rank R --master-addr ADDR`
per host, on the host's network: compose writes one file per host (node 0 serves HTTP, the others join headless),
Kubernetes gets a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of N pods that is recreated as a group when one
fails, and a Service on the leader. docker (one `docker run` on one host) refuses such a profile.

With an external engine (`engine="vllm"|"vllm-ascend"|"sglang"`) the containers run that engine's own launch
instead, from flagdeploy.planner.emit (the commands `plan --emit ENGINE` prints, one source of the flags): over
several nodes its own multi-node mode, node 0 (the LWS leader) the head that serves HTTP, the others its workers.
Which layouts each engine runs is engines.yaml `layouts`; which engine `deploy` takes without --engine is its
`deploy` section (`deploy_engines`). The image of an external engine defaults to the compatibility matrix's
(installer/matrix.yaml) for the chip's family and that engine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flagdeploy.chips import get_chip
from flagdeploy.planner.profile import Profile

from .atomic import write_set

__all__ = ["DEPLOY_ENGINES", "KINDS", "PLACEHOLDER_IMAGE", "STARTUP_BUDGET_S", "ContainerNeeds", "container_needs",
           "deploy_engines", "engine_image", "engine_problem", "image_for", "notes", "plan_deploy", "render",
           "render_pd", "write", "write_pd"]

KINDS = ("docker", "compose", "k8s")
# The engines deploy renders: flagdeploy's own and the external ones with a multi-node mode (MindIE is driven by a
# config file merged into its image's, which these renderers do not write).
DEPLOY_ENGINES = ("builtin", "vllm", "vllm-ascend", "sglang")
# A tag can move under a running deployment; a digest cannot. The placeholder fails loudly until replaced.
PLACEHOLDER_IMAGE = "REPLACE-ME@sha256:<digest>"
# Reading a large checkpoint from network storage and compiling graphs can take tens of minutes: the startup
# probe must not restart a pod that is still loading.
STARTUP_BUDGET_S = 45 * 60
_PROBE_PERIOD_S = 10
DATA = Path(__file__).with_name("containers.yaml")
# The host directory mounted on the container's model cache (containers.yaml common.container_cache), kept across
# restarts. The images of `deploy image` run as a non-root uid (common.user): it must be writable by that uid.
HOST_CACHE = "/var/cache/flagdeploy"
# LeaderWorkerSet (kubernetes-sigs/lws): its API, the labels it puts on every pod and the variables it injects
# into every container (api/leaderworkerset/v1/leaderworkerset_types.go).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# LWS creates a headless Service named after the set (the pods' DNS subdomain, LWS_LEADER_ADDRESS resolves
# through it) and names a worker StatefulSet `<name>-<group>`, whose pods carry a `<statefulset>-<hash>` label of
# at most 63 characters: the set's name is kept short, and the HTTP Service gets a name of its own.
_LWS_NAME_MAX = 45
_NETWORKS = ("host", "rdma")
# A network interface name (or NCCL/HCCL's list syntax: eth0,eth1 / ^docker / =eth0) and a host name or address.
_NIC_RE = re.compile(r"[A-Za-z0-9_.:@=^,-]+")
_ADDR_RE = re.compile(r"[A-Za-z0-9_.:\[\]-]+")


class _Dumper(yaml.SafeDumper):
    """Plain YAML for humans to review: no &anchors for shared dicts, multi-line strings (the profile) as blocks."""

    def ignore_aliases(self, data):
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def _dump(docs: list) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


@functools.cache
def _data() -> dict[str, Any]:
    return yaml.safe_load(DATA.read_text())


@dataclass(frozen=True)
class ContainerNeeds:
    """What one container must be given to reach the devices a profile uses (empty lists for CPU)."""

    count: int  # devices used on this node (tp*dp*pp); 0 for CPU
    devices: list[str] = field(default_factory=list)  # host device nodes, passed through as-is
    mounts: list[str] = field(default_factory=list)  # host driver paths, mounted read-only at the same path
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 0  # NVIDIA: docker --gpus / compose device reservation
    k8s_resource: str | None = None  # device-plugin resource name
    # Several nodes (the fields below matter only when nodes > 1); `count` and the rest are per node.
    nodes: int = 1
    ifname_env: list[str] = field(default_factory=list)  # variables set to `--nic` on every node
    network: str = "host"  # host: host network; rdma: the vendor's rdma block (device plugin, annotations)
    rdma: dict[str, Any] = field(default_factory=dict)  # that block when network == "rdma"
    group_add: list[str] = field(default_factory=list)  # supplementary groups (docker --group-add): Hygon's video
    unconfirmed: list[str] = field(default_factory=list)  # fields of the vendor's block no stored source confirms


def container_needs(profile: Profile) -> ContainerNeeds:
    """The vendor recipe from containers.yaml, instantiated for the devices this profile uses on each node."""
    nodes = profile.nodes
    if nodes < 1:
        raise ValueError(f"profile has nodes={nodes}; a deployment needs at least one node")
    chip = get_chip(profile.chip)
    vendors = _data()["vendors"]
    if chip.vendor not in vendors:
        raise ValueError(f"no container recipe for {chip.id} (vendor {chip.vendor}) in {DATA.name}; "
                         f"known vendors: {sorted(vendors)}")
    v = vendors[chip.vendor]
    mn = v.get("multinode") or {}
    network = (mn.get("network_by_chip") or {}).get(chip.id, mn.get("network", "host"))
    if network not in _NETWORKS:
        raise ValueError(f"{DATA.name}: vendor {chip.vendor} has multinode network {network!r}; "
                         f"use one of {', '.join(_NETWORKS)}")
    rdma = dict(mn.get("rdma") or {}) if network == "rdma" else {}
    if network == "rdma" and not rdma:
        raise ValueError(f"{DATA.name}: vendor {chip.vendor} asks for the rdma network but has no `rdma` block "
                         "(device-plugin resources, network annotations, capabilities)")
    multi = dict(nodes=nodes, ifname_env=[*_data()["common"]["ifname_env"], *mn.get("ifname_env", [])],
                 network=network, rdma=rdma, unconfirmed=list(v.get("unconfirmed") or []))
    if not (v["devices_per_index"] or v["devices"] or v.get("gpus")):  # CPU: nothing to pass through
        return ContainerNeeds(count=0, **multi)
    total = profile.tp * profile.dp * profile.pp
    if total % nodes:
        raise ValueError(f"profile uses {total} devices (tp*dp*pp), which do not split evenly over {nodes} nodes")
    n = total // nodes
    if n > chip.devices_per_node:
        per = " per node (tp*dp*pp / nodes)" if nodes > 1 else ""
        raise ValueError(f"profile uses {n} devices (tp*dp*pp){per} but a {chip.id} node has {chip.devices_per_node}")
    env = {v["visible_devices_env"]: ",".join(map(str, range(n)))} if v["visible_devices_env"] else {}
    return ContainerNeeds(
        count=n,
        devices=[p.format(i=i) for i in range(n) for p in v["devices_per_index"]] + list(v["devices"]),
        mounts=list(v["mounts"]),
        env=env,
        gpus=n if v.get("gpus") else 0,
        k8s_resource=v["k8s_resource_by_chip"].get(chip.id, v["k8s_resource"]),
        group_add=list(v.get("group_add") or []),
        **multi,
    )


def _name(profile: Profile) -> str:
    """A DNS-1123 label from the served name or model (Kubernetes and docker both accept it)."""
    base = re.sub(r"[^a-z0-9]+", "-", (profile.served_model_name or profile.model).lower()).strip("-")
    return f"flagdeploy-{base}"[:63].rstrip("-")


def _env(needs: ContainerNeeds) -> dict[str, str]:
    return {"FLAGDEPLOY_CACHE": _data()["common"]["container_cache"], **needs.env}


def _check_multinode(kind: str, profile: Profile, nic: str | None, master_addr: str | None) -> None:
    """The node options against the profile and the kind, each refusal saying what to run instead."""
    if nic is not None and not _NIC_RE.fullmatch(nic):
        raise ValueError(f"--nic {nic!r} is not a network interface name (e.g. eth0, bond0, enp65s0f0)")
    if master_addr is not None and not _ADDR_RE.fullmatch(master_addr):
        raise ValueError(f"--master-addr {master_addr!r} is not a host name or IP address")
    n = profile.nodes
    if n <= 1:
        if nic or master_addr:
            raise ValueError("--nic and --master-addr are for a deployment over several nodes (--nodes N, or a "
                             "profile with nodes: N); this one runs on one node")
        return
    if kind == "docker":
        raise ValueError(f"the profile spans {n} nodes and `deploy docker` writes one host's `docker run`: use "
                         f"`flagdeploy deploy compose --nodes {n} --master-addr NODE0_IP` (one compose file per host) "
                         f"or `flagdeploy deploy k8s --nodes {n}` (a LeaderWorkerSet)")
    if kind == "compose" and not master_addr:
        raise ValueError(f"a compose deployment over {n} nodes needs --master-addr: the address of the host that "
                         "will run node 0 (it serves HTTP and hosts the rendezvous), as the other hosts reach it, "
                         "e.g. --master-addr 10.0.0.11")
    if kind == "k8s" and master_addr:
        raise ValueError("--master-addr is for compose: on Kubernetes every pod gets its leader's address from the "
                         "LeaderWorkerSet (LWS_LEADER_ADDRESS); drop the option")


def deploy_engines(chip: str) -> list[str]:
    """The engines `deploy` tries without --engine, in order (engines.yaml `deploy`, per chip backend), less those
    that do not run on the chip at all."""
    from flagdeploy.planner.emit import _spec, chip_engines

    data = _spec()["deploy"]
    order = data["engines_by_backend"].get(get_chip(chip).backend, data["engines"])
    here = chip_engines(chip)
    return [e for e in order if e in here and e in DEPLOY_ENGINES]


def engine_problem(profile: Profile, engine: str) -> str | None:
    """Why `engine`'s containers could not run `profile` (an engine deploy does not render, a layout the engine
    does not run, a launch its rules refuse), in one message that says what to do; None when they can. It is
    checked before any file is written, so that deploy never writes pods that could only crash."""
    from flagdeploy.planner.emit import EmitError, emit, emit_nodes, layout_refusal

    if engine not in DEPLOY_ENGINES:
        return f"deploy runs one of {', '.join(DEPLOY_ENGINES)}, not {engine!r}"
    layout = f"tp={profile.tp},dp={profile.dp},ep={profile.ep},pp={profile.pp}"
    why = layout_refusal(profile, engine)
    if why is None and engine != "builtin":
        try:
            emit_nodes(profile, engine, nic=None) if profile.nodes > 1 else emit(profile, engine)
        except EmitError as exc:
            why = str(exc)
    if why is None:
        return None
    others = [e for e in deploy_engines(profile.chip) if e != engine and layout_refusal(profile, e) is None]
    hint = f" {', '.join(others)} run(s) this layout: --engine {others[0]}." if others else ""
    return (f"{engine} does not run the profile's layout {layout} on {profile.nodes} node(s) of {profile.devices} "
            f"{profile.chip}: {why}.{hint}")


def engine_image(chip: str, engine: str) -> str | None:
    """The image of the compatibility matrix's row for the chip's family and `engine` (installer/matrix.yaml),
    e.g. quay.io/ascend/vllm-ascend:v0.23.0-a3 for vllm-ascend on an A3; None where it names none."""
    from .detect import chip_family
    from .matrix import UnsupportedStackError, resolve

    family = chip_family(chip)
    try:
        return resolve(family, engine).image if family else None
    except UnsupportedStackError:
        return None


def notes(kind: str, profile: Profile, *, nic: str | None = None) -> list[str]:
    """Warnings about what was rendered, for the command to print (they are also comments in the files)."""
    out = [_unconfirmed_note(profile)] if container_needs(profile).unconfirmed else []
    if profile.nodes <= 1 or kind == "docker" or nic:
        return out
    names = ", ".join(container_needs(profile).ifname_env)
    return out + [f"no --nic given: {names} are left unset, so each process picks a network interface itself; on hosts "
            "with several NICs it may take one the other nodes cannot reach (gloo 'connectFullMesh failed', a "
            "collective init timeout). Re-render with --nic IFACE: the interface that carries the nodes' traffic "
            "(the same name on every node)."]


def _unconfirmed_note(profile: Profile) -> str:
    """What of the vendor's container block no stored source confirms: the files may need those lines changed."""
    chip = get_chip(profile.chip)
    v = _data()["vendors"][chip.vendor]
    return (f"{chip.vendor}'s container needs in {DATA.name} are not confirmed by a stored source "
            f"({', '.join(v['unconfirmed'])}) and no {chip.id} container was run: check the device nodes, mounts and "
            f"device-plugin resource against the vendor's container docs before deploying. Source: "
            f"{' '.join(str(v['source']).split())}")


def _with_note(text: str, note: str) -> str:
    """The note as a comment at the top of a rendered file (after a shebang line)."""
    comment = _comment([f"WARNING: {note}"])
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{comment}{rest}"
    return comment + text


def plan_deploy(spec, model: str, devices: int | None, nodes: int, layout: str | None, engine: str | None,
                max_model_len: int, memory_utilization: float) -> tuple[Profile, str]:
    """deploy's profile and engine: the planner's best layout for `engine`, or without one for the first engine of
    the chip's (engines.yaml `deploy`) that runs a layout that fits and renders. Nothing fitting is one ValueError
    naming why (memory, or the layouts the engines run) and the `plan` command that shows every layout."""
    from flagdeploy.planner import PlanRequest, make_plan
    from flagdeploy.planner.emit import chip_engines
    from flagdeploy.planner.report import parse_layout
    from flagdeploy.planner.search import ENGINE_REFUSES

    per_node = devices or spec.devices_per_node
    if engine and engine not in chip_engines(spec.id):
        raise ValueError(f"{engine} does not run on {spec.id} (profiles/engines.yaml rules); engines for it: "
                         f"{', '.join(e for e in chip_engines(spec.id) if e in DEPLOY_ENGINES)}")
    order = [engine] if engine else (deploy_engines(spec.id) or ["builtin"])
    tried = []
    for name in order:
        plan = make_plan(PlanRequest(model, spec.id, per_node, nodes=nodes, max_model_len=max_model_len,
                                     memory_utilization=memory_utilization, engine=name,
                                     layout=parse_layout(layout) if layout is not None else None))
        if plan.chosen is not None:
            profile = plan.profile()
            why = engine_problem(profile, name)
            if why is None:
                return profile, name
            tried.append((name, [why]))
        else:
            first = [r.reason for r in plan.rejected[:1] if layout and ENGINE_REFUSES not in r.reason]
            tried.append((name, first + plan.suggestions))
    where = f"{model} on {nodes} node(s) x {per_node} {spec.id}" + (f" with --layout {layout}" if layout else "")
    engines = " or ".join(name for name, _ in tried)
    lines = [f"nothing that {engines} runs fits {where}"]
    for name, reasons in tried:
        lines += [f"  {name}: {r}" for r in reasons or ["no layout was found either"]]
    plan_cmd = (f"flagdeploy plan --model {model} --chip {spec.id} --devices {per_node} --nodes {nodes} "
                f"--engine {tried[0][0]}")
    raise ValueError("\n".join(lines) + f"\n`{plan_cmd}` shows every layout and why it is refused.")


def image_for(profile: Profile, engine: str, image: str | None = None) -> str:
    """The image the files run: the one given, else for an external engine the matrix's image of that engine,
    else the placeholder (builtin: an image of `flagdeploy deploy image`, built by the user, has no fixed name)."""
    return image or (engine_image(profile.chip, engine) if engine != "builtin" else None) or PLACEHOLDER_IMAGE


def render(kind: str, profile: Profile, *, image: str | None = None, cache_dir: str = HOST_CACHE,
           nic: str | None = None, master_addr: str | None = None, engine: str | None = None) -> dict[str, str]:
    """File name -> content for `kind`; `cache_dir` is the host directory holding downloaded models, shared
    across restarts so a redeploy does not download the checkpoint again. Always includes profile.yaml.

    A profile with nodes > 1: `nic` names the interface the nodes talk over (GLOO_SOCKET_IFNAME and the vendor's
    HCCL/NCCL variable; unset without it), `master_addr` is node 0's address (compose only).
    `engine`: what the containers run (DEPLOY_ENGINES; default the profile's engine, else builtin)."""
    if kind not in KINDS:
        raise ValueError(f"unknown deployment kind {kind!r}; choose one of {', '.join(KINDS)}")
    engine = engine or profile.engine or "builtin"
    if why := engine_problem(profile, engine):
        raise ValueError(why)
    _check_multinode(kind, profile, nic, master_addr)
    needs = container_needs(profile)
    files = {"profile.yaml": profile.to_yaml()}
    if engine != "builtin":
        files["profile.yaml"] = dataclasses.replace(profile, engine=engine).to_yaml()
        files.update(_external(kind, profile, engine, needs, image_for(profile, engine, image), cache_dir, nic,
                               master_addr))
    else:
        image = image_for(profile, engine, image)
        if needs.nodes > 1:
            files.update(_compose_nodes(profile, needs, image, cache_dir, nic, master_addr) if kind == "compose"
                         else _lws(profile, needs, image, cache_dir, nic))
        else:
            files.update(_RENDERERS[kind](profile, needs, image, cache_dir))
    if needs.unconfirmed:
        note = _unconfirmed_note(profile)
        files = {name: text if name == "profile.yaml" else _with_note(text, note) for name, text in files.items()}
    return files


def _node_args(needs: ContainerNeeds, rank: str, master_addr: str) -> list[str]:
    """serve's multi-node flags for one node."""
    return ["--nnodes", str(needs.nodes), "--node-rank", rank, "--master-addr", master_addr,
            "--master-port", str(_data()["common"]["master_port"])]


def _nic_env(needs: ContainerNeeds, nic: str | None) -> dict[str, str]:
    return {k: nic for k in needs.ifname_env} if nic else {}


def _comment(lines: list[str]) -> str:
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


def _layout(profile: Profile) -> str:
    return (f"{profile.model} on {profile.nodes} node(s) x {profile.devices} {profile.chip}: tp={profile.tp} "
            f"dp={profile.dp} ep={profile.ep} pp={profile.pp}")


def _docker_args(profile: Profile, needs: ContainerNeeds, env: dict[str, str], cache_dir: str) -> list[list[str]]:
    """`docker run`'s options for one container of `profile`: name, shm, port, environment, the devices and driver
    mounts of `needs`, and the host's model cache on the container's."""
    c = _data()["common"]
    args = [["--name", _name(profile)], ["--shm-size", c["shm_size"]], ["-p", f"{profile.port}:{profile.port}"]]
    args += [["-e", f"{k}={v}"] for k, v in env.items()]
    args += [["--gpus", str(needs.gpus)]] if needs.gpus else []
    args += [["--device", d] for d in needs.devices]
    args += [["--group-add", g] for g in needs.group_add]
    args += [["-v", f"{m}:{m}:ro"] for m in needs.mounts]
    args += [["-v", f"{cache_dir}:{c['container_cache']}"]]
    return args


def _docker(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
    c = _data()["common"]
    q = shlex.quote
    lines = [" ".join(map(q, a)) for a in _docker_args(profile, needs, _env(needs), cache_dir)]
    # The profile sits next to run.sh; $HERE must expand, so this one argument is double-quoted, not shlex-quoted.
    lines.append(f'-v "$HERE/profile.yaml:{c["profile_path"]}:ro"')
    lines.append(" ".join(map(q, [image, *c["serve"]])))
    body = " \\\n  ".join(["exec docker run -d", *lines])
    script = ("#!/bin/sh\n"
              f"# {_layout(profile)}, port {profile.port}.\n"
              "# The server answers /health once alive and /ready once the weights are loaded.\n"
              f"# Images from `flagdeploy deploy image` run as uid {c['user']['uid']}: {cache_dir} must be writable by it "
              f"(sudo install -d -o {c['user']['uid']} -g {c['user']['gid']} {cache_dir}).\n"
              "set -eu\n"
              'HERE=$(cd "$(dirname "$0")" && pwd)\n'
              f"{body}\n")
    return {"run.sh": script}


def _compose_service(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, Any]:
    c = _data()["common"]
    svc: dict[str, Any] = {
        "image": image,
        "command": list(c["serve"]),
        "shm_size": c["shm_size"],
        "ports": [f"{profile.port}:{profile.port}"],
        "environment": _env(needs),
        "volumes": [f"{m}:{m}:ro" for m in needs.mounts]
                   + [f"{cache_dir}:{c['container_cache']}", f"./profile.yaml:{c['profile_path']}:ro"],
    }
    if needs.devices:
        svc["devices"] = [f"{d}:{d}" for d in needs.devices]
    if needs.group_add:
        svc["group_add"] = list(needs.group_add)
    if needs.gpus:
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": needs.gpus, "capabilities": ["gpu"]}]}}}
    return svc


def _compose(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
    doc = {"services": {_name(profile): _compose_service(profile, needs, image, cache_dir)}}
    return {"compose.yaml": _dump([doc])}


def _compose_nodes(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str, nic: str | None,
                   master_addr: str) -> dict[str, str]:
    """One compose file per host, all on the host network: node 0 serves HTTP on the host's port (a `ports`
    mapping has no meaning with network_mode host, and Compose refuses or drops it) and hosts the rendezvous;
    the other nodes join it headless."""
    port, rdv = profile.port, _data()["common"]["master_port"]
    files = {}
    for rank in range(needs.nodes):
        svc = _compose_service(profile, needs, image, cache_dir)
        del svc["ports"]
        svc["network_mode"] = "host"
        svc["command"] = svc["command"] + _node_args(needs, str(rank), master_addr)
        svc["environment"].update(_nic_env(needs, nic))
        if needs.rdma:
            devices = [f"{d}:{d}" for d in needs.rdma.get("devices", [])]
            svc["devices"] = svc.get("devices", []) + devices
            if needs.rdma.get("capabilities"):
                svc["cap_add"] = list(needs.rdma["capabilities"])
        role = (f"node 0 serves http://{master_addr}:{port}/v1 (/ready answers once every node has loaded)" if rank == 0
                else f"node {rank} joins node 0 ({master_addr}:{rdv}) headless: no HTTP port")
        head = [f"Node {rank} of {needs.nodes}: {_layout(profile)}, {needs.count or 'no'} device(s) per node.",
                f"On host {rank}: put this file and profile.yaml in one directory, then "
                f"`docker compose -f compose.node{rank}.yaml up -d`.",
                f"Host network: {role}; port {rdv} on {master_addr} must be reachable from every node."]
        head += [f"WARNING: {n}" for n in notes("compose", profile, nic=nic)]
        doc = {"services": {f"{_name(profile)}-node{rank}": svc}}
        files[f"compose.node{rank}.yaml"] = _comment(head) + _dump([doc])
    return files


def _k8s_volumes(name: str, needs: ContainerNeeds, cache_dir: str,
                 profile: bool = True) -> tuple[list[dict], list[dict]]:
    """A pod's volumes and the server container's mounts: the profile's ConfigMap (unless `profile` is false: an
    external engine takes its flags on the command line), the model cache, /dev/shm and the driver files."""
    c = _data()["common"]
    volumes = [{"name": "profile", "configMap": {"name": f"{name}-profile"}},
               {"name": "cache", "hostPath": {"path": cache_dir, "type": "DirectoryOrCreate"}},
               # docker's --shm-size has no pod field: a memory-backed emptyDir on /dev/shm is the equivalent.
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c["shm_size"].upper().replace("G", "Gi")}}]
    mounts = [{"name": "profile", "mountPath": os.path.dirname(c["profile_path"]), "readOnly": True},
              {"name": "cache", "mountPath": c["container_cache"]},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if not profile:
        volumes, mounts = volumes[1:], mounts[1:]
    for i, m in enumerate(needs.mounts):
        volumes.append({"name": f"driver-{i}", "hostPath": {"path": m}})
        mounts.append({"name": f"driver-{i}", "mountPath": m, "readOnly": True})
    return volumes, mounts


def _k8s_probes(ready: str = "/ready") -> dict[str, Any]:
    """Loading may take many minutes: /ready gates traffic and startup; the liveness probe only asks whether
    the process answers (/health), so a pod that is still loading is never killed for it. An external engine
    answers only its health path (`ready`: /health), once its model is loaded."""
    http = {"port": "http"}
    return {
        "startupProbe": {"httpGet": {"path": ready, **http}, "periodSeconds": _PROBE_PERIOD_S,
                         "failureThreshold": STARTUP_BUDGET_S // _PROBE_PERIOD_S},
        "readinessProbe": {"httpGet": {"path": ready, **http}, "periodSeconds": _PROBE_PERIOD_S,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", **http}, "initialDelaySeconds": 60, "periodSeconds": 20,
                          "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _k8s_profile(name: str, labels: dict[str, str], profile: Profile) -> dict[str, Any]:
    c = _data()["common"]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-profile", "labels": labels},
            "data": {os.path.basename(c["profile_path"]): profile.to_yaml()}}


def _k8s(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
    """ConfigMap (the profile), Deployment and Service. On Kubernetes the device plugin picks the dies and
    passes their nodes in, so only the driver files are hostPath mounts and no visible-devices variable is set."""
    c = _data()["common"]
    name, labels = _name(profile), {"app": _name(profile)}
    volumes, mounts = _k8s_volumes(name, needs, cache_dir)
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "command": list(c["serve"]),
        "ports": [{"name": "http", "containerPort": profile.port}],
        "env": [{"name": "FLAGDEPLOY_CACHE", "value": c["container_cache"]}],
        **_k8s_probes(),
        "volumeMounts": mounts,
    }
    if needs.k8s_resource:
        container["resources"] = {"limits": {needs.k8s_resource: needs.count}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            # Rolling updates would start the new pod while the old one still holds the devices.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container], "volumes": volumes}},
        },
    }
    config = _k8s_profile(name, labels, profile)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": profile.port, "targetPort": "http"}]}}
    return {"deployment.yaml": _dump([config, deployment, service])}


@dataclass(frozen=True)
class _Run:
    """What an external engine's containers run: the leader's and the workers' commands, the environment (the
    launch's, on top of the vendor's), the path the probes ask, and notes for the files' header."""

    engine: str
    leader: list[str]
    worker: list[str]
    env: dict[str, str]
    health: str
    notes: list[str]


def _lws(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str, nic: str | None,
         run: _Run | None = None, name: str | None = None) -> dict[str, str]:
    """ConfigMap (the profile), LeaderWorkerSet and a Service on the leader, for a profile over several nodes.

    One group of `nodes` pods: the leader (LWS worker index 0) is node 0, serves HTTP and carries the probes;
    the workers join it headless. Each pod asks the device plugin for its node's share of the devices. LWS
    injects LWS_LEADER_ADDRESS (the leader's DNS name under the set's headless Service) and LWS_WORKER_INDEX
    into every container, and Kubernetes expands $(VAR) in the command from the container's environment."""
    c = _data()["common"]
    name = (name or _name(profile))[:_LWS_NAME_MAX].rstrip("-")
    labels = {"app": name}
    volumes, mounts = _k8s_volumes(name, needs, cache_dir, profile=run is None)
    if run is None:
        env = [{"name": "FLAGDEPLOY_CACHE", "value": c["container_cache"]}]
        env += [{"name": k, "value": v} for k, v in _nic_env(needs, nic).items()]
    else:  # the launch's own environment (it sets the interface variables from --nic itself)
        env = [{"name": k, "value": v} for k, v in run.env.items()]
    # Quantities as strings, the form the API server returns them in (an integer is accepted too).
    limits = {needs.k8s_resource: str(needs.count)} if needs.k8s_resource else {}
    limits.update({k: str(v) for k, v in needs.rdma.get("k8s_resources", {}).items()})
    # One pod per host: with the host's network two pods of the set on one node would share its ports.
    spread = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchExpressions": [{"key": LWS_NAME_LABEL, "operator": "In", "values": [name]}]},
        "topologyKey": "kubernetes.io/hostname"}]}}

    def template(role: str, rank: str) -> dict[str, Any]:
        command = ([*c["serve"], *_node_args(needs, rank, "$(LWS_LEADER_ADDRESS)")] if run is None
                   else run.leader if role == "leader" else run.worker)
        container: dict[str, Any] = {
            "name": "server" if role == "leader" else "worker",
            "image": image,
            "command": command,
            "env": env,
        }
        if role == "leader":
            container["ports"] = [{"name": "http", "containerPort": profile.port}]
            if run is None:
                container["ports"].append({"name": "rendezvous", "containerPort": c["master_port"]})
            container.update(_k8s_probes() if run is None else _k8s_probes(run.health))
        container["volumeMounts"] = mounts
        if limits:
            container["resources"] = {"limits": limits}
        if needs.rdma.get("capabilities"):
            container["securityContext"] = {"capabilities": {"add": list(needs.rdma["capabilities"])}}
        spec: dict[str, Any] = {"containers": [container], "volumes": volumes, "affinity": spread}
        if needs.network == "host":
            # The host's interfaces (the NIC that --nic names); the pod still resolves cluster names such as
            # LWS_LEADER_ADDRESS only with this DNS policy.
            spec["hostNetwork"] = True
            spec["dnsPolicy"] = "ClusterFirstWithHostNet"
        meta: dict[str, Any] = {"labels": {**labels, "role": role}}
        if needs.rdma.get("k8s_annotations"):
            meta["annotations"] = {k: str(v) for k, v in needs.rdma["k8s_annotations"].items()}
        return {"metadata": meta, "spec": spec}

    lws = {
        "apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            # Workers start with the leader, not once it is ready: it becomes ready only after they joined.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": needs.nodes,
                # A rank that dies leaves the others blocked in a collective: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader", "0"),
                "workerTemplate": template("worker", "$(LWS_WORKER_INDEX)"),
            },
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-leader", "labels": labels},
               "spec": {"selector": {LWS_NAME_LABEL: name, "role": "leader"},
                        "ports": [{"name": "http", "port": profile.port, "targetPort": "http"}]}}
    net = ("host network (hostNetwork, one pod per node)" if needs.network == "host"
           else f"the rdma network of {DATA.name} (device-plugin resources and annotations)")
    what = "flagdeploy serve" if run is None else f"{run.engine}'s own multi-node mode"
    head = [f"{_layout(profile)}: a LeaderWorkerSet of {needs.nodes} pods running {what}, {needs.count or 'no'} "
            f"device(s) each, on the {net}.",
            f"Needs the LeaderWorkerSet controller (kubernetes-sigs/lws) in the cluster. The leader serves HTTP behind "
            f"Service {name}-leader, port {profile.port}; the workers join it headless.",
            "Apply with: kubectl apply -f leaderworkerset.yaml"]
    head += [f"WARNING: {n}" for n in notes("k8s", profile, nic=nic)]
    head += run.notes if run else []
    docs = [_k8s_profile(name, labels, profile)] if run is None else []
    return {"leaderworkerset.yaml": _comment(head) + _dump([*docs, lws, service])}


def _engine_command(argv: list[str], setup: list[str], kind: str) -> list[str]:
    """A container's command for an external launch: its argv, or `/bin/bash -c` with the setup lines first
    (sourcing the CANN scripts, a worker's rank) when it has any or a word needs the shell. Kubernetes expands
    $(VAR) in a command itself (LWS_LEADER_ADDRESS), so a shell arithmetic $(( )) is escaped there; compose
    interpolates every $, so each is doubled."""
    from flagdeploy.planner.emit import shell_word

    words = [shell_word(a) for a in argv]
    if not setup and not any(w.startswith('"') for w in words):
        command = list(argv)
    else:
        command = ["/bin/bash", "-c", "\n".join([*setup, "exec " + " ".join(words)])]
    if kind == "k8s":
        return [w.replace("$((", "$$((") for w in command]
    if kind == "compose":
        return [w.replace("$", "$$") for w in command]
    return command


def _external(kind: str, profile: Profile, engine: str, needs: ContainerNeeds, image: str, cache_dir: str,
              nic: str | None, master_addr: str | None) -> dict[str, str]:
    """The files of `kind` that run `engine`'s own launch (flagdeploy.planner.emit: the commands `plan --emit`
    prints) in the vendor's containers: one node as docker/compose/a Deployment, several nodes as one compose file
    per host or a LeaderWorkerSet whose leader is the engine's head and whose workers its headless nodes. HCCL_IF_IP
    is left out on Ascend, as in the builtin files (HCCL_SOCKET_IFNAME from --nic selects the interface)."""
    from flagdeploy.planner.emit import emit, emit_nodes, emit_worker, engine_data

    c = _data()["common"]
    spec = engine_data(engine)
    extra = [str(x) for kv in (spec.get("container_flags") or {}).items() for x in kv]
    health = spec.get("health", "/health")
    visible = _data()["vendors"][get_chip(profile.chip).vendor]["visible_devices_env"]
    source = (f"{engine}'s launch as `flagdeploy plan --emit {engine}` prints it (flagdeploy/planner/emit.py, "
              "profiles/engines.yaml)")

    def env(launch, k8s: bool = False) -> dict[str, str]:
        out = {**{k: v.format(**c) for k, v in c["engine_env"].items()}, **needs.env, **launch.env}
        if k8s and visible:  # the device plugin picks the devices and passes them in
            out.pop(visible, None)
        return {k: v.replace("$", "$$") for k, v in out.items()} if kind == "compose" else out

    def notes_of(*launches) -> list[str]:
        return [f"{engine}: {w}" for w in dict.fromkeys(w for la in launches for w in la.warnings)]

    if profile.nodes <= 1:
        launch = emit(profile, engine)
        command = _engine_command([*launch.argv, *extra], launch.setup, kind)
        head = [f"{_layout(profile)}, port {profile.port}: {source}.",
                f"{engine} answers {health} once the model is loaded."] + notes_of(launch)
        if kind == "docker":
            q = shlex.quote
            args = _docker_args(profile, needs, env(launch), cache_dir)
            body = " \\\n  ".join(["exec docker run -d", *(" ".join(map(q, a)) for a in args),
                                     " ".join(map(q, [image, *command]))])
            return {"run.sh": "#!/bin/sh\n" + _comment(head) + "set -eu\n" + body + "\n"}
        if kind == "compose":
            svc = _compose_service(profile, needs, image, cache_dir)
            svc["command"], svc["environment"] = command, env(launch)
            svc["volumes"] = [v for v in svc["volumes"] if not v.endswith(f"{c['profile_path']}:ro")]
            return {"compose.yaml": _comment(head) + _dump([{"services": {_name(profile): svc}}])}
        name, labels = _name(profile), {"app": _name(profile)}
        volumes, mounts = _k8s_volumes(name, needs, cache_dir, profile=False)
        container: dict[str, Any] = {"name": "server", "image": image, "command": command,
                                     "ports": [{"name": "http", "containerPort": profile.port}],
                                     "env": [{"name": k, "value": v} for k, v in env(launch, k8s=True).items()],
                                     **_k8s_probes(health), "volumeMounts": mounts}
        if needs.k8s_resource:  # a quantity as a string, the form the API server returns
            container["resources"] = {"limits": {needs.k8s_resource: str(needs.count)}}
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
                      "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                               "template": {"metadata": {"labels": labels},
                                            "spec": {"containers": [container], "volumes": volumes}}}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
                   "spec": {"selector": labels,
                            "ports": [{"name": "http", "port": profile.port, "targetPort": "http"}]}}
        return {"deployment.yaml": _comment(head) + _dump([deployment, service])}

    if kind == "k8s":
        leader_addr = "$(LWS_LEADER_ADDRESS)"
        leader = emit_nodes(profile, engine, head_addr=leader_addr, nic=nic, npu_direct_roce=True)[0]
        worker = emit_worker(profile, engine, "LWS_WORKER_INDEX", head_addr=leader_addr, nic=nic, npu_direct_roce=True)
        if env(leader) != env(worker):  # the pods share one environment list
            raise ValueError(f"{engine}'s head and worker launches set different environments; not rendered")
        run = _Run(engine, _engine_command([*leader.argv, *extra], leader.setup, kind),
                   _engine_command([*worker.argv, *extra], worker.setup, kind), env(leader, k8s=True), health,
                   [f"The leader runs node 0 of {source}; the workers node $(LWS_WORKER_INDEX)."]
                   + notes_of(leader, worker))
        return _lws(profile, needs, image, cache_dir, nic, run)

    files = {}
    launches = emit_nodes(profile, engine, head_addr=master_addr, nic=nic, npu_direct_roce=True)
    for rank, launch in enumerate(launches):
        svc = _compose_service(profile, needs, image, cache_dir)
        del svc["ports"]
        svc["network_mode"] = "host"
        svc["command"], svc["environment"] = _engine_command([*launch.argv, *extra], launch.setup, kind), env(launch)
        svc["volumes"] = [v for v in svc["volumes"] if not v.endswith(f"{c['profile_path']}:ro")]
        if needs.rdma:
            svc["devices"] = svc.get("devices", []) + [f"{d}:{d}" for d in needs.rdma.get("devices", [])]
            if needs.rdma.get("capabilities"):
                svc["cap_add"] = list(needs.rdma["capabilities"])
        role = (f"node 0, {engine}'s head, serves http://{master_addr}:{profile.port}/v1 ({health} answers once "
                "every node has joined and the model is loaded)" if rank == 0
                else f"node {rank} joins {engine}'s head on {master_addr} headless: no HTTP port")
        head = [f"Node {rank} of {needs.nodes}: {_layout(profile)}, {needs.count or 'no'} device(s) per node.",
                f"On host {rank}: put this file in a directory, then "
                f"`docker compose -f compose.node{rank}.yaml up -d`.",
                f"Host network: {role}. It runs {source}."]
        head += [f"WARNING: {n}" for n in notes("compose", profile, nic=nic)] + notes_of(launch)
        doc = {"services": {f"{_name(profile)}-node{rank}": svc}}
        files[f"compose.node{rank}.yaml"] = _comment(head) + _dump([doc])
    return files


_RENDERERS = {"docker": _docker, "compose": _compose, "k8s": _k8s}


def write(kind: str, profile: Profile, out_dir: str | Path, *, overwrite: bool = False, **kw) -> list[Path]:
    """Write render()'s files into out_dir as one set (atomic.write_set): a failed write (a full disk) leaves the
    old set untouched and a reader never sees half a manifest; existing files are refused unless overwrite."""
    return write_set(out_dir, render(kind, profile, **kw), overwrite=overwrite)


# ---- prefill-decode disaggregation (`deploy k8s|compose --pd`) --------------------------------------------------

PD_GROUP_LABEL = "flagdeploy.io/pd-group"  # on both roles' pods: one host runs one pod of the group


def render_pd(kind: str, pd, *, image: str | None = None, cache_dir: str = HOST_CACHE, nic: str | None = None
              ) -> dict[str, str]:
    """File name -> content running a PD plan (flagdeploy.planner.pd.PDPlan): each role's engine instance as
    `plan --pd --emit` launches it, plus the router. k8s: a LeaderWorkerSet per role (size = the role's nodes; the
    leader is the instance's head and serves its port behind a Service) and the router as a Deployment with its
    Service; compose: one file per host of each role (host network) and one for the router. Profiles of both
    roles go along (profile.prefill.yaml, profile.decode.yaml)."""
    from flagdeploy.planner.pd_emit import role_launches, role_worker_launch, router_launch

    if kind not in ("k8s", "compose"):
        raise ValueError(f"a PD deployment runs a prefill instance, a decode instance and a router: use `deploy k8s "
                         f"--pd` (LeaderWorkerSets) or `deploy compose --pd` (a file per host), not {kind}")
    if pd.prefill.plan.chosen is None or pd.decode.plan.chosen is None:
        raise ValueError("a role has no layout that fits; `flagdeploy plan --pd ...` shows why and what would fit")
    r = pd.request
    if r.prefill_nodes is None and r.decode_nodes is None and r.base.nodes == 1:
        raise ValueError("the plan puts both roles on one node, which deploy does not render (each role's containers "
                         "would claim the same devices); give --prefill-nodes and --decode-nodes, or a larger --nodes "
                         "(`flagdeploy plan --pd --emit ENGINE` prints one-node launches)")
    if nic is not None and not _NIC_RE.fullmatch(nic):
        raise ValueError(f"--nic {nic!r} is not a network interface name (e.g. eth0, bond0, enp65s0f0)")
    profiles = pd.profiles()
    files = {f"profile.{role}.yaml": prof.to_yaml() for role, prof in profiles.items()}
    base = _name(profiles["prefill"])[:_LWS_NAME_MAX - len("-prefill")].rstrip("-")
    names = {role: f"{base}-{role}" for role in profiles}
    engine = pd.engine
    spec = _engine_spec(engine)
    router = _pd_router_spec(pd)
    img = image_for(profiles["prefill"], engine, image)
    head = [f"prefill-decode disaggregation of {profiles['prefill'].model} on {profiles['prefill'].chip} with "
            f"{engine} ({pd.connector} connector), as `flagdeploy plan --pd --emit {engine}` launches it:",
            *(f"  {role}: {p.nodes} node(s) x {p.devices}, tp={p.tp} dp={p.dp} ep={p.ep}, port {p.port}"
              for role, p in profiles.items()),
            f"  router: port {router['port']}, P:D ratio {pd.ratio_text()} (flagdeploy/planner/pd.py)"]
    head += [f"WARNING: PD does not pay here: {why}" for why in pd.verdict.reasons]
    if router.get("install"):
        head.append(f"The router runs in {img}; it needs {router['install']} there ({router['source']}).")
    if kind == "k8s":
        docs = []
        for role, prof in profiles.items():
            needs = container_needs(prof)
            addr = "$(LWS_LEADER_ADDRESS)"
            leader = role_launches(pd, role, head_addr=addr, nic=nic, npu_direct_roce=True)[0]
            worker = (role_worker_launch(pd, role, "LWS_WORKER_INDEX", addr, nic) if prof.nodes > 1 else leader)
            env = _pd_env(leader, needs, prof, "k8s")
            extra = [str(x) for kv in (spec.get("container_flags") or {}).items() for x in kv]
            run = _Run(engine, _engine_command([*leader.argv, *extra], leader.setup, "k8s"),
                       _engine_command([*worker.argv, *extra], worker.setup, "k8s"), env, spec.get("health", "/health"),
                       [])
            text = _lws(prof, needs, img, cache_dir, nic, run, name=names[role])["leaderworkerset.yaml"]
            for doc in yaml.safe_load_all(text):
                if doc["kind"] == "LeaderWorkerSet":
                    _pd_pods(doc, base, role)
                docs.append(doc)
        docs += _pd_router_k8s(pd, base, names, router, img)
        files["pd.yaml"] = _comment(head + ["Needs the LeaderWorkerSet controller (kubernetes-sigs/lws).",
                                            "Apply with: kubectl apply -f pd.yaml"]) + _dump(docs)
        return files
    for role, prof in profiles.items():
        needs = container_needs(prof)
        var = f"{role.upper()}_IP"
        launches = role_launches(pd, role, head_addr=f"${var}", nic=nic, npu_direct_roce=True)
        extra = [str(x) for kv in (spec.get("container_flags") or {}).items() for x in kv]
        for rank, launch in enumerate(launches):
            svc = _compose_service(prof, needs, img, cache_dir)
            del svc["ports"]
            svc["network_mode"] = "host"
            svc["command"] = _engine_command([*launch.argv, *extra], launch.setup, "compose")
            svc["environment"] = {**_pd_env(launch, needs, prof, "compose"),
                                  var: f"${{{var}:?set {var} to the {role} instance's node 0 address}}",
                                  "NODE_IP": "${NODE_IP:?set NODE_IP to this host's address}"}
            svc["volumes"] = [v for v in svc["volumes"] if not v.endswith(f"{_data()['common']['profile_path']}:ro")]
            what = [f"{role} node {rank} of {prof.nodes}: on that host, with {var} (the {role} instance's node 0) "
                    f"and NODE_IP (this host) set in the shell or a .env file beside this file: "
                    f"`docker compose -f compose.{role}.node{rank}.yaml up -d`"]
            files[f"compose.{role}.node{rank}.yaml"] = _comment(head + what) + _dump(
                [{"services": {f"{names[role]}-node{rank}": svc}}])
    files["compose.router.yaml"] = _comment(head + [
        "The router: on any host that reaches both instances, with PREFILL_IP and DECODE_IP set: "
        "`docker compose -f compose.router.yaml up -d`"]) + _dump([{"services": {f"{base}-router": _pd_router_compose(
            pd, router, img)}}])
    return files


def write_pd(kind: str, pd, out_dir: str | Path, *, overwrite: bool = False, **kw) -> list[Path]:
    """render_pd's files written as one set (atomic.write_set), as write() does."""
    return write_set(out_dir, render_pd(kind, pd, **kw), overwrite=overwrite)


def _engine_spec(engine: str) -> dict[str, Any]:
    from flagdeploy.planner.emit import engine_data

    return engine_data(engine)


def _pd_router_spec(pd) -> dict[str, Any]:
    from flagdeploy.planner.pd import pd_data

    router = dict(pd_data()["engines"][pd.engine]["router"])
    router["port"] = pd_data()["ports"]["router"]
    return router


def _pd_env(launch, needs: ContainerNeeds, profile: Profile, kind: str) -> dict[str, str]:
    """A role container's environment: the engines' common env, the vendor's, the launch's. Kubernetes: the device
    plugin picks the devices (no visible-devices variable) and $NODE_IP is the pod's $(NODE_IP); compose: each $ of
    the launch filled by compose from the host's environment (`${NODE_IP}`), the one place an environment value is
    expanded."""
    c = _data()["common"]
    out = {**{k: v.format(**c) for k, v in c["engine_env"].items()}, **needs.env, **launch.env}
    visible = _data()["vendors"][get_chip(profile.chip).vendor]["visible_devices_env"]
    if kind == "k8s":
        if visible:
            out.pop(visible, None)
        return {k: re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: f"$({m.group(1) or m.group(2)})", v) for k, v in out.items()}
    # compose fills ${NAME} from the host's shell or .env (NODE_IP, the role's head address): each is listed there
    return {k: re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: f"${{{m.group(1) or m.group(2)}}}", v)
            for k, v in out.items()}


def _pd_pods(lws: dict, group: str, role: str) -> None:
    """Both roles' pods carry the group label, and no host runs two pods of the group (with the host's network two
    instances on one host would share its ports); NODE_IP is each pod's own address (with hostNetwork, the host's)."""
    for key in ("leaderTemplate", "workerTemplate"):
        t = lws["spec"]["leaderWorkerTemplate"][key]
        t["metadata"]["labels"] |= {PD_GROUP_LABEL: group, "flagdeploy.io/pd-role": role}
        (term,) = t["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        term["labelSelector"] = {"matchExpressions": [{"key": PD_GROUP_LABEL, "operator": "In", "values": [group]}]}
        for container in t["spec"]["containers"]:
            container["env"] = [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                *container["env"]]


def _router_probes(health: str | None) -> dict[str, Any]:
    check = {"httpGet": {"path": health, "port": "http"}} if health else {"tcpSocket": {"port": "http"}}
    return {"readinessProbe": {**check, "periodSeconds": _PROBE_PERIOD_S, "failureThreshold": 3},
            "livenessProbe": {**check, "initialDelaySeconds": 10, "periodSeconds": 20, "timeoutSeconds": 5,
                              "failureThreshold": 6}}


def _pd_router_k8s(pd, base: str, names: dict[str, str], router: dict[str, Any], image: str) -> list[dict]:
    """The router as a Deployment and its Service; it reaches each role's leader through that role's Service."""
    from flagdeploy.planner.pd_emit import router_launch

    launch = router_launch(pd, f"{names['prefill']}-leader", f"{names['decode']}-leader")
    name, labels = f"{base}-router", {"app": f"{base}-router"}
    env = []
    if "VLLM_ASCEND_DIR" in " ".join(launch.argv):
        env.append({"name": "VLLM_ASCEND_DIR", "value": router["repo_dir"]})
    container: dict[str, Any] = {"name": "router", "image": image,
                                 "command": _engine_command(launch.argv, launch.setup, "k8s"),
                                 "ports": [{"name": "http", "containerPort": router["port"]}],
                                 **({"env": env} if env else {}), **_router_probes(router.get("health"))}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": router["port"], "targetPort": "http"}]}}
    return [deployment, service]


def _pd_router_compose(pd, router: dict[str, Any], image: str) -> dict[str, Any]:
    from flagdeploy.planner.pd_emit import router_launch

    launch = router_launch(pd)
    env = {"PREFILL_IP": "${PREFILL_IP:?set PREFILL_IP to the prefill instance's node 0 address}",
           "DECODE_IP": "${DECODE_IP:?set DECODE_IP to the decode instance's node 0 address}"}
    if "VLLM_ASCEND_DIR" in " ".join(launch.argv):
        env["VLLM_ASCEND_DIR"] = router["repo_dir"]
    return {"image": image, "command": _engine_command(launch.argv, launch.setup, "compose"),
            "ports": [f"{router['port']}:{router['port']}"], "environment": env}
