"""`flagdeploy deploy docker|compose|k8s`: a planner profile rendered as files that run it in a container.

The per-vendor needs (Ascend device nodes and driver mounts, NVIDIA GPU requests, nothing for CPU) live in
containers.yaml next to this file, so the three renderers share one source of truth and a new driver path is a
data change. Every renderer ships the profile itself (a bind-mounted file, or a ConfigMap on Kubernetes) and runs
`flagdeploy serve --profile`, so the container serves exactly what the planner chose.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flagdeploy.chips import get_chip
from flagdeploy.planner.profile import Profile

__all__ = ["KINDS", "PLACEHOLDER_IMAGE", "STARTUP_BUDGET_S", "ContainerNeeds", "container_needs", "render", "write"]

KINDS = ("docker", "compose", "k8s")
# A tag can move under a running deployment; a digest cannot. The placeholder fails loudly until replaced.
PLACEHOLDER_IMAGE = "REPLACE-ME@sha256:<digest>"
# Reading a large checkpoint from network storage and compiling graphs can take tens of minutes: the startup
# probe must not restart a pod that is still loading.
STARTUP_BUDGET_S = 45 * 60
_PROBE_PERIOD_S = 10
DATA = Path(__file__).with_name("containers.yaml")


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


def container_needs(profile: Profile) -> ContainerNeeds:
    """The vendor recipe from containers.yaml, instantiated for the devices this profile uses."""
    if profile.nodes > 1:
        raise ValueError(f"profile spans {profile.nodes} nodes; multi-node deployments (host network, HCCL/NCCL "
                         "rank wiring) are not rendered yet: deploy one node at a time")
    chip = get_chip(profile.chip)
    vendors = _data()["vendors"]
    if chip.vendor not in vendors:
        raise ValueError(f"no container recipe for {chip.id} (vendor {chip.vendor}) in {DATA.name}; "
                         f"known vendors: {sorted(vendors)}")
    v = vendors[chip.vendor]
    if not (v["devices_per_index"] or v.get("gpus")):  # CPU: nothing to pass through
        return ContainerNeeds(count=0)
    n = profile.tp * profile.dp * profile.pp
    if n > chip.devices_per_node:
        raise ValueError(f"profile uses {n} devices (tp*dp*pp) but a {chip.id} node has {chip.devices_per_node}")
    env = {v["visible_devices_env"]: ",".join(map(str, range(n)))} if v["visible_devices_env"] else {}
    return ContainerNeeds(
        count=n,
        devices=[p.format(i=i) for i in range(n) for p in v["devices_per_index"]] + list(v["devices"]),
        mounts=list(v["mounts"]),
        env=env,
        gpus=n if v.get("gpus") else 0,
        k8s_resource=v["k8s_resource_by_chip"].get(chip.id, v["k8s_resource"]),
    )


def _name(profile: Profile) -> str:
    """A DNS-1123 label from the served name or model (Kubernetes and docker both accept it)."""
    base = re.sub(r"[^a-z0-9]+", "-", (profile.served_model_name or profile.model).lower()).strip("-")
    return f"flagdeploy-{base}"[:63].rstrip("-")


def _env(needs: ContainerNeeds) -> dict[str, str]:
    return {"FLAGDEPLOY_CACHE": _data()["common"]["container_cache"], **needs.env}


def render(kind: str, profile: Profile, *, image: str | None = None,
           cache_dir: str = "/root/.cache/flagdeploy") -> dict[str, str]:
    """File name -> content for `kind`; `cache_dir` is the host directory holding downloaded models, shared
    across restarts so a redeploy does not download the checkpoint again. Always includes profile.yaml."""
    if kind not in KINDS:
        raise ValueError(f"unknown deployment kind {kind!r}; choose one of {', '.join(KINDS)}")
    needs = container_needs(profile)
    files = {"profile.yaml": profile.to_yaml()}
    files.update(_RENDERERS[kind](profile, needs, image or PLACEHOLDER_IMAGE, cache_dir))
    return files


def _docker(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
    c = _data()["common"]
    q = shlex.quote
    args = [["--name", _name(profile)], ["--shm-size", c["shm_size"]], ["-p", f"{profile.port}:{profile.port}"]]
    args += [["-e", f"{k}={v}"] for k, v in _env(needs).items()]
    args += [["--gpus", str(needs.gpus)]] if needs.gpus else []
    args += [["--device", d] for d in needs.devices]
    args += [["-v", f"{m}:{m}:ro"] for m in needs.mounts]
    args += [["-v", f"{cache_dir}:{c['container_cache']}"]]
    lines = [" ".join(map(q, a)) for a in args]
    # The profile sits next to run.sh; $HERE must expand, so this one argument is double-quoted, not shlex-quoted.
    lines.append(f'-v "$HERE/profile.yaml:{c["profile_path"]}:ro"')
    lines.append(" ".join(map(q, [image, *c["serve"]])))
    body = " \\\n  ".join(["exec docker run -d", *lines])
    script = ("#!/bin/sh\n"
              f"# {profile.model} on {profile.chip}: tp={profile.tp} dp={profile.dp} pp={profile.pp}, port {profile.port}.\n"
              "# The server answers /health once alive and /ready once the weights are loaded.\n"
              "set -eu\n"
              'HERE=$(cd "$(dirname "$0")" && pwd)\n'
              f"{body}\n")
    return {"run.sh": script}


def _compose(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
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
    if needs.gpus:
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": needs.gpus, "capabilities": ["gpu"]}]}}}
    doc = {"services": {_name(profile): svc}}
    return {"compose.yaml": _dump([doc])}


def _k8s(profile: Profile, needs: ContainerNeeds, image: str, cache_dir: str) -> dict[str, str]:
    """ConfigMap (the profile), Deployment and Service. On Kubernetes the device plugin picks the dies and
    passes their nodes in, so only the driver files are hostPath mounts and no visible-devices variable is set."""
    c = _data()["common"]
    name, labels = _name(profile), {"app": _name(profile)}
    http = {"port": "http"}
    volumes = [{"name": "profile", "configMap": {"name": f"{name}-profile"}},
               {"name": "cache", "hostPath": {"path": cache_dir, "type": "DirectoryOrCreate"}},
               # docker's --shm-size has no pod field: a memory-backed emptyDir on /dev/shm is the equivalent.
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c["shm_size"].upper().replace("G", "Gi")}}]
    mounts = [{"name": "profile", "mountPath": os.path.dirname(c["profile_path"]), "readOnly": True},
              {"name": "cache", "mountPath": c["container_cache"]},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    for i, m in enumerate(needs.mounts):
        volumes.append({"name": f"driver-{i}", "hostPath": {"path": m}})
        mounts.append({"name": f"driver-{i}", "mountPath": m, "readOnly": True})
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "command": list(c["serve"]),
        "ports": [{"name": "http", "containerPort": profile.port}],
        "env": [{"name": "FLAGDEPLOY_CACHE", "value": c["container_cache"]}],
        # Loading may take many minutes: /ready gates traffic and startup; the liveness probe only asks whether
        # the process answers (/health), so a pod that is still loading is never killed for it.
        "startupProbe": {"httpGet": {"path": "/ready", **http}, "periodSeconds": _PROBE_PERIOD_S,
                         "failureThreshold": STARTUP_BUDGET_S // _PROBE_PERIOD_S},
        "readinessProbe": {"httpGet": {"path": "/ready", **http}, "periodSeconds": _PROBE_PERIOD_S,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", **http}, "initialDelaySeconds": 60, "periodSeconds": 20,
                          "timeoutSeconds": 5, "failureThreshold": 6},
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
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-profile", "labels": labels},
              "data": {os.path.basename(c["profile_path"]): profile.to_yaml()}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": profile.port, "targetPort": "http"}]}}
    return {"deployment.yaml": _dump([config, deployment, service])}


_RENDERERS = {"docker": _docker, "compose": _compose, "k8s": _k8s}


def write(kind: str, profile: Profile, out_dir: str | Path, *, overwrite: bool = False, **kw) -> list[Path]:
    """Write render()'s files into out_dir. Each file goes to a temporary name and is then renamed, so a reader
    never sees half a manifest; existing files are refused (all checked before any is written) unless overwrite."""
    files = render(kind, profile, **kw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = {out / name: text for name, text in files.items()}
    existing = [str(p) for p in targets if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)} (pass --overwrite to replace them)")
    for path, text in targets.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=out)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o755 if path.suffix == ".sh" else 0o644)
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if the file appeared since the check: never clobbers
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return list(targets)
