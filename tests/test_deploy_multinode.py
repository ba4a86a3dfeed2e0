"""Deployments over several nodes (issue 31): `deploy k8s --nodes N` renders a LeaderWorkerSet, `deploy compose
--nodes N` one compose file per host, `deploy docker` refuses. The Kubernetes objects are checked against two
schemas, offline: the `kubernetes` client's models (pod templates as V1PodTemplateSpec, the Service as V1Service)
and the LeaderWorkerSet CRD's published openAPIV3Schema (tests/fixtures/lws, see SOURCE.md there)."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.planner.profile import Profile
from installer import deploy as deploy_mod
from installer.deploy import notes, render, write

kubernetes = pytest.importorskip("kubernetes", minversion="37")
jsonschema = pytest.importorskip("jsonschema")

LWS_DIR = Path(__file__).parent / "fixtures" / "lws"
CRD = LWS_DIR / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
ASCEND_MOUNTS = ["/usr/local/Ascend/driver/lib64", "/usr/local/Ascend/driver/version.info", "/usr/local/bin/npu-smi",
                 "/etc/ascend_install.info", "/usr/local/dcmi"]
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


# Layouts the builtin engine runs across nodes: one replica, the planner's expert-parallel form (ep = tp x dp) or
# plain TP, no pipeline stages.
def ascend() -> Profile:  # A3: 16 dies per node, two nodes
    return Profile(model="glm-5.3-flash", chip="ascend910c", tp=16, dp=2, ep=32, devices=16, nodes=2, port=8100)


def h200() -> Profile:
    return Profile(model="glm-5.3-flash", chip="h200", tp=8, dp=2, ep=16, devices=8, nodes=2, port=8000)


def cpu() -> Profile:  # gloo only: no device requests, the same wiring
    return Profile(model="smollm2-135m-instruct", chip="cpu", tp=3, nodes=3, port=8000)


PROFILES = [ascend, h200, cpu]
# vendor -> (device-plugin resource, per-pod count, socket variables besides GLOO_SOCKET_IFNAME)
EXPECT = {"ascend910c": ("huawei.com/Ascend910", "16", ["HCCL_SOCKET_IFNAME"]),
          "h200": ("nvidia.com/gpu", "8", ["NCCL_SOCKET_IFNAME"]),
          "cpu": (None, None, [])}


def k8s_docs(profile: Profile, **kw) -> dict[str, dict]:
    files = render("k8s", profile, **kw)
    assert sorted(files) == ["leaderworkerset.yaml", "profile.yaml"]
    return {d["kind"]: d for d in yaml.safe_load_all(files["leaderworkerset.yaml"])}


def templates(lws: dict) -> tuple[dict, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---- schema 1: the kubernetes client's models ---------------------------------------------------------------


def _first_difference(a, b, path="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in b:
                return f"{path}.{k} (not a field of the model, or dropped)"
            if k not in a:
                return f"{path}.{k} (added)"
            if (d := _first_difference(a[k], b[k], f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{path}[{i}]"))), None)
    return None if a == b and type(a) is type(b) else f"{path}: {a!r} became {b!r}"


def check_k8s_model(data: dict, klass: str) -> None:
    """`data` as the API would take it, through the client's own deserializer: its models are strict about
    types (a string for an integer, a number for a string raise), and whatever comes back differently from what
    went in (an unknown or misspelt field is dropped by from_dict) is an error too. The models are stricter than
    the API server in one place: a quantity must be a string there (the server also takes `nvidia.com/gpu: 8`),
    which is why the LeaderWorkerSet writes its device counts as strings."""
    api = kubernetes.client.ApiClient()
    obj = api.deserialize(json.dumps(data), klass, None)
    assert type(obj).__name__ == klass
    diff = _first_difference(data, api.sanitize_for_serialization(obj))
    if diff is not None:
        raise ValueError(f"{klass}: {diff}")


# ---- schema 2: the LeaderWorkerSet CRD's openAPIV3Schema ------------------------------------------------------


def _strict(schema):
    """The API server refuses fields a structural schema does not declare (strict field validation, as
    `kubectl apply --validate=strict` asks); JSON Schema allows them unless additionalProperties is false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = _strict(out[key])
    return out


@functools.cache
def lws_validator():
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "LeaderWorkerSet"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    # OpenAPI 3.0's schema object is JSON Schema draft 4's vocabulary (boolean exclusiveMinimum, no const).
    jsonschema.Draft4Validator.check_schema(schema)
    return crd, jsonschema.Draft4Validator(schema)


def crd_errors(lws: dict) -> list[str]:
    crd, validator = lws_validator()
    assert lws["apiVersion"] == f"{crd['spec']['group']}/v1"
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(lws)]


# ---- the LeaderWorkerSet ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", PROFILES)
def test_lws_group_and_node_commands(make):
    profile = make()
    docs = k8s_docs(profile, image="registry.example/flagdeploy@sha256:abc")
    lws, cm = docs["LeaderWorkerSet"], docs["ConfigMap"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["size"] == profile.nodes
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = templates(lws)
    (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
    for c, rank in ((lc, "0"), (wc, "$(LWS_WORKER_INDEX)")):
        argv = c["command"]
        assert argv[:4] == ["flagdeploy", "serve", "--profile", "/etc/flagdeploy/profile.yaml"]
        assert flag(argv, "--nnodes") == str(profile.nodes) and flag(argv, "--node-rank") == rank
        assert flag(argv, "--master-addr") == "$(LWS_LEADER_ADDRESS)" and flag(argv, "--master-port") == "29500"
        assert c["image"] == "registry.example/flagdeploy@sha256:abc"
        assert env_of(c)["FLAGDEPLOY_CACHE"] == "/home/flagdeploy/.cache/flagdeploy"
        assert {"name": "profile", "mountPath": "/etc/flagdeploy", "readOnly": True} in c["volumeMounts"]
    # Both templates mount the ConfigMap that carries the profile, nodes included.
    assert Profile(**yaml.safe_load(cm["data"]["profile.yaml"])["profile"]) == profile
    for t in (leader, worker):
        assert {"name": "profile", "configMap": {"name": cm["metadata"]["name"]}} in t["spec"]["volumes"]


@pytest.mark.parametrize("make", PROFILES)
def test_only_the_leader_serves_http_with_the_single_node_probes(make):
    profile = make()
    leader, worker = templates(k8s_docs(profile)["LeaderWorkerSet"])
    (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
    # The same probes as the one-node Deployment: the long /ready startup budget, /health liveness.
    single = yaml.safe_load_all(render("k8s", Profile(model=profile.model, chip=profile.chip, port=profile.port))
                                ["deployment.yaml"])
    (sc,) = next(d for d in single if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert lc[probe] == sc[probe]
        assert probe not in wc
    assert lc["startupProbe"]["failureThreshold"] * lc["startupProbe"]["periodSeconds"] >= 30 * 60
    assert {"name": "http", "containerPort": profile.port} in lc["ports"]
    assert "ports" not in wc  # workers join headless


@pytest.mark.parametrize("make", PROFILES)
def test_devices_host_network_shm_and_leader_service(make):
    profile = make()
    docs = k8s_docs(profile)
    lws, svc = docs["LeaderWorkerSet"], docs["Service"]
    resource, count, _ = EXPECT[profile.chip]
    leader, worker = templates(lws)
    for t in (leader, worker):
        pod = t["spec"]
        (c,) = pod["containers"]
        limits = c.get("resources", {}).get("limits", {})
        assert limits == ({resource: count} if resource else {})  # each pod: its node's share
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        assert set(ASCEND_MOUNTS) <= paths if profile.chip == "ascend910c" else not set(ASCEND_MOUNTS) & paths
        # one pod per host
        (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchExpressions"] == [
            {"key": NAME_LABEL, "operator": "In", "values": [lws["metadata"]["name"]]}]
        assert not any(e["name"].endswith("VISIBLE_DEVICES") for e in c["env"])  # the device plugin picks them
    # The Service reaches the leader only; its name is not the set's, which LWS takes for its headless Service.
    sel = svc["spec"]["selector"]
    assert sel[NAME_LABEL] == lws["metadata"]["name"] and sel["role"] == "leader"
    assert leader["metadata"]["labels"]["role"] == "leader" and worker["metadata"]["labels"]["role"] != "leader"
    assert svc["metadata"]["name"] != lws["metadata"]["name"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": profile.port, "targetPort": "http"}]


def test_names_fit_kubernetes_limits():
    profile = Profile(model="org/" + "a-very-long-model-name" * 5, chip="h200", tp=8, dp=2, ep=16, devices=8, nodes=2)
    docs = k8s_docs(profile)
    name = docs["LeaderWorkerSet"]["metadata"]["name"]
    # LWS names the worker StatefulSet <name>-<group>; its pods carry a <statefulset>-<hash> label (63 at most).
    assert len(name) <= 45 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    assert len(docs["Service"]["metadata"]["name"]) <= 63 and len(docs["ConfigMap"]["metadata"]["name"]) <= 63


@pytest.mark.parametrize("make", PROFILES)
def test_nic_sets_the_socket_variables_and_its_absence_is_flagged(make):
    profile = make()
    _, _, vendor_vars = EXPECT[profile.chip]
    names = ["GLOO_SOCKET_IFNAME", *vendor_vars]
    for t in templates(k8s_docs(profile, nic="bond0")["LeaderWorkerSet"]):
        env = env_of(t["spec"]["containers"][0])
        assert {k: v for k, v in env.items() if k.endswith("SOCKET_IFNAME")} == dict.fromkeys(names, "bond0")
    assert notes("k8s", profile, nic="bond0") == []
    text = render("k8s", profile)["leaderworkerset.yaml"]
    for t in templates(next(d for d in yaml.safe_load_all(text) if d["kind"] == "LeaderWorkerSet")):
        assert not any(k.endswith("SOCKET_IFNAME") for k in env_of(t["spec"]["containers"][0]))
    (warning,) = notes("k8s", profile)
    assert all(n in warning for n in names) and "--nic" in warning
    assert "# WARNING: no --nic given" in text


def rdma_data(monkeypatch):
    """containers.yaml with the NVIDIA recipe switched to the rdma network, as a cluster with an RDMA device
    plugin would set it: the renderer takes it from the data, nothing in the code names RDMA resources."""
    data = copy.deepcopy(deploy_mod._data())
    data["vendors"]["nvidia"]["multinode"]["network"] = "rdma"
    monkeypatch.setattr(deploy_mod, "_data", lambda: data)
    return data["vendors"]["nvidia"]["multinode"]["rdma"]


def test_rdma_network_comes_from_the_data(monkeypatch):
    rdma = rdma_data(monkeypatch)
    docs = k8s_docs(h200(), nic="net1")
    lws = docs["LeaderWorkerSet"]
    for t in templates(lws):
        pod, (c,) = t["spec"], t["spec"]["containers"]
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
        assert t["metadata"]["annotations"] == {k: str(v) for k, v in rdma["k8s_annotations"].items()}
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", **{k: str(v) for k, v in rdma["k8s_resources"].items()}}
        assert c["securityContext"]["capabilities"]["add"] == rdma["capabilities"]
        check_k8s_model(t, "V1PodTemplateSpec")
    assert crd_errors(lws) == []
    # compose (always the host network) gets the HCAs' device nodes and the capability
    (svc,) = yaml.safe_load(render("compose", h200(), master_addr="10.0.0.11")["compose.node1.yaml"])["services"].values()
    assert [f"{d}:{d}" for d in rdma["devices"]] == svc["devices"][-len(rdma["devices"]):]
    assert svc["cap_add"] == rdma["capabilities"]


# ---- the schemas ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nic", [None, "eth0"])
@pytest.mark.parametrize("make", PROFILES)
def test_rendered_objects_pass_the_kubernetes_models(make, nic):
    docs = k8s_docs(make(), nic=nic)
    for t in templates(docs["LeaderWorkerSet"]):
        check_k8s_model(t, "V1PodTemplateSpec")
    check_k8s_model(docs["Service"], "V1Service")
    check_k8s_model(docs["ConfigMap"], "V1ConfigMap")


def test_the_model_check_rejects_broken_manifests():
    leader, _ = templates(k8s_docs(h200())["LeaderWorkerSet"])
    check_k8s_model(leader, "V1PodTemplateSpec")

    def broken(edit) -> dict:
        t = copy.deepcopy(leader)
        edit(t["spec"], t["spec"]["containers"][0])
        return t

    cases = {
        "misspelt field": broken(lambda pod, c: c.update(imagee=c.pop("image"))),
        "camelCase slip": broken(lambda pod, c: pod.update(host_network=pod.pop("hostNetwork"))),
        "string for an integer": broken(lambda pod, c: c["ports"][0].update(containerPort="8000")),
        "string for a boolean": broken(lambda pod, c: pod.update(hostNetwork="true")),
        "number for a string": broken(lambda pod, c: c.update(image=5)),
        "list for a map": broken(lambda pod, c: c["resources"].update(limits=["nvidia.com/gpu"])),
        "object for a list": broken(lambda pod, c: c.update(env={"A": "1"})),
        "missing required name": broken(lambda pod, c: c.pop("name")),
    }
    for what, t in cases.items():
        with pytest.raises((ValueError, TypeError)):  # pydantic's ValidationError is a ValueError
            check_k8s_model(t, "V1PodTemplateSpec")
            pytest.fail(f"{what} was accepted")
    svc = k8s_docs(h200())["Service"]
    svc["spec"]["ports"][0]["prot"] = 8000
    with pytest.raises(ValueError, match="prot"):
        check_k8s_model(svc, "V1Service")


@pytest.mark.parametrize("make", PROFILES)
def test_rendered_lws_matches_the_crd_schema(make):
    assert crd_errors(k8s_docs(make(), nic="eth0")["LeaderWorkerSet"]) == []


def test_the_crd_check_rejects_broken_sets():
    lws = k8s_docs(ascend())["LeaderWorkerSet"]
    assert crd_errors(lws) == []

    def broken(edit) -> dict:
        d = copy.deepcopy(lws)
        edit(d["spec"]["leaderWorkerTemplate"])
        return d

    cases = {
        "string size": broken(lambda t: t.update(size="2")),
        "unknown restart policy": broken(lambda t: t.update(restartPolicy="Always")),
        "misspelt field": broken(lambda t: t.update(sizee=t.pop("size"))),
        "no worker template": broken(lambda t: t.pop("workerTemplate")),
        "field unknown to the pod": broken(lambda t: t["workerTemplate"]["spec"].update(hostNetwrk=True)),
        "bad quantity": broken(lambda t: t["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"]
                               .update({"huawei.com/Ascend910": "sixteen"})),
    }
    for what, d in cases.items():
        assert crd_errors(d), f"{what} was accepted"


def test_crd_fixture_is_the_published_file():
    source = (LWS_DIR / "SOURCE.md").read_text()
    assert "https://github.com/kubernetes-sigs/lws" in source
    assert "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" in source
    assert re.search(r"commit: `[0-9a-f]{40}`", source)
    assert f"sha256: `{hashlib.sha256(CRD.read_bytes()).hexdigest()}`" in source


# ---- compose, docker, refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", PROFILES)
def test_compose_writes_one_file_per_host(make):
    profile = make()
    files = render("compose", profile, master_addr="10.0.0.11", nic="eth1", cache_dir="/data/models")
    names = [f"compose.node{i}.yaml" for i in range(profile.nodes)]
    assert sorted(files) == sorted(["profile.yaml", *names])
    _, count, vendor_vars = EXPECT[profile.chip]
    for rank, name in enumerate(names):
        text = files[name]
        (svc,) = yaml.safe_load(text)["services"].values()
        assert svc["network_mode"] == "host" and "ports" not in svc  # host network: no port mapping
        argv = svc["command"]
        assert argv[:4] == ["flagdeploy", "serve", "--profile", "/etc/flagdeploy/profile.yaml"]
        assert flag(argv, "--nnodes") == str(profile.nodes) and flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--master-addr") == "10.0.0.11" and flag(argv, "--master-port") == "29500"
        env = svc["environment"]
        assert all(env[k] == "eth1" for k in ["GLOO_SOCKET_IFNAME", *vendor_vars])
        assert "./profile.yaml:/etc/flagdeploy/profile.yaml:ro" in svc["volumes"]
        assert "/data/models:/home/flagdeploy/.cache/flagdeploy" in svc["volumes"]
        assert svc["shm_size"] == "16g"
        if profile.chip == "ascend910c":  # every die of this host, counted from 0 on each host
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, range(int(count))))
            assert sum(d.startswith("/dev/davinci") and d[12].isdigit() for d in svc["devices"]) == int(count)
        if profile.chip == "h200":
            assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == int(count)
        assert ("serves http://10.0.0.11:" in text) == (rank == 0)
        assert "WARNING" not in text
    assert Profile(**yaml.safe_load(files["profile.yaml"])["profile"]) == profile
    assert "WARNING: no --nic given" in render("compose", profile, master_addr="10.0.0.11")["compose.node0.yaml"]


def test_refusals_say_what_to_run_instead():
    with pytest.raises(ValueError, match=r"deploy compose --nodes 2 --master-addr .* deploy k8s --nodes 2"):
        render("docker", h200())
    with pytest.raises(ValueError, match="--master-addr"):
        render("compose", h200())
    with pytest.raises(ValueError, match="LWS_LEADER_ADDRESS"):
        render("k8s", h200(), master_addr="10.0.0.11")
    single = Profile(model="m", chip="h200", tp=8, devices=8)
    with pytest.raises(ValueError, match="several nodes"):
        render("k8s", single, nic="eth0")
    with pytest.raises(ValueError, match="interface"):
        render("k8s", h200(), nic="eth0; rm -rf /")
    with pytest.raises(ValueError, match="host name or IP"):
        render("compose", h200(), master_addr="10.0.0.1 evil")
    with pytest.raises(ValueError, match="split evenly over 2 nodes"):
        render("k8s", Profile(model="m", chip="h200", tp=3, nodes=2))
    with pytest.raises(ValueError, match=r"per node \(tp\*dp\*pp / nodes\)"):
        render("k8s", Profile(model="m", chip="h200", tp=8, dp=4, ep=32, nodes=2))


@pytest.mark.parametrize("kind", ["k8s", "compose"])
def test_layouts_the_builtin_engine_cannot_run_across_nodes_are_refused(kind):
    """serve refuses pipeline stages and separate data-parallel replicas across nodes: deploy says so before
    writing pods that could only crash, and names a layout to try."""
    kw = {"master_addr": "10.0.0.11"} if kind == "compose" else {}
    with pytest.raises(ValueError, match=r"2 pipeline stages.*--layout tp=4,dp=4,ep=16.*--emit vllm"):
        render(kind, Profile(model="m", chip="h200", tp=4, dp=2, ep=8, pp=2, devices=8, nodes=2), **kw)
    with pytest.raises(ValueError, match=r"2 data-parallel replicas.*--layout tp=8,dp=2,ep=16"):
        render(kind, Profile(model="m", chip="h200", tp=8, dp=2, ep=1, devices=8, nodes=2), **kw)


def test_write_leaves_nothing_when_refused(tmp_path):
    with pytest.raises(ValueError):
        write("compose", h200(), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    paths = write("compose", h200(), tmp_path / "out", master_addr="node0.example")
    assert sorted(p.name for p in paths) == ["compose.node0.yaml", "compose.node1.yaml", "profile.yaml"]


# ---- the command -----------------------------------------------------------------------------------------------


def run_cli(*args):
    from flagdeploy.cli import main

    return CliRunner().invoke(main, ["deploy", *args], catch_exceptions=False)


def test_cli_plans_over_nodes_and_writes_a_leaderworkerset(tmp_path):
    args = ["k8s", "--chip", "ascend910c", "--model", "glm-5.3-flash", "--nodes", "2", "-o", str(tmp_path)]
    # A layout with pipeline stages is one the builtin engine does not run: refused, naming one it runs and the
    # engines that run this one (the default on Ascend, vllm-ascend, does).
    r = run_cli(*args, "--layout", "tp=4,dp=4,ep=16,pp=2", "--engine", "builtin")
    assert r.exit_code == 1 and "pipeline stages" in r.output and "--layout tp=4,dp=8,ep=32" in r.output
    assert "--engine vllm-ascend" in r.output and "flagdeploy plan" in r.output
    assert not any(tmp_path.iterdir())
    r = run_cli(*args, "--layout", "tp=4,dp=8,ep=32", "--engine", "builtin")
    assert r.exit_code == 0, r.output
    assert "leaderworkerset.yaml" in r.output and "warning: no --nic given" in r.output
    profile = Profile.load(tmp_path / "profile.yaml")
    assert profile.nodes == 2 and profile.engine == "builtin"
    docs = {d["kind"]: d for d in yaml.safe_load_all((tmp_path / "leaderworkerset.yaml").read_text())}
    assert docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert crd_errors(docs["LeaderWorkerSet"]) == []


def test_cli_deploys_a_profile_file_and_refuses_clearly(tmp_path):
    h200().save(tmp_path / "p.yaml")
    p = str(tmp_path / "p.yaml")
    r = run_cli("compose", "--profile", p, "--master-addr", "10.0.0.11", "--nic", "eth0", "--image", "reg.example/fd:1.0.0",
                "-o", str(tmp_path / "c"))
    assert r.exit_code == 0, r.output
    assert sorted(x.name for x in (tmp_path / "c").iterdir()) == ["compose.node0.yaml", "compose.node1.yaml",
                                                                 "profile.yaml"]
    assert "warning" not in r.output
    r = run_cli("docker", "--profile", p, "-o", str(tmp_path / "d"))
    assert r.exit_code == 1 and "deploy compose --nodes 2" in r.output
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    r = run_cli("compose", "--profile", p, "-o", str(tmp_path / "e"))
    assert r.exit_code == 1 and "--master-addr" in r.output
    r = run_cli("k8s", "--profile", p, "--nodes", "3", "-o", str(tmp_path / "f"))
    assert r.exit_code == 1 and "not --nodes 3" in r.output
    r = run_cli("k8s", "--profile", p, "--chip", "h200", "-o", str(tmp_path / "g"))
    assert r.exit_code == 2 and "--profile" in r.output
    r = run_cli("k8s", "-o", str(tmp_path / "h"))
    assert r.exit_code == 2 and "--chip and --model" in r.output
