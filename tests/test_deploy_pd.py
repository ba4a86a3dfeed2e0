"""`flagdeploy deploy k8s|compose --pd` (issue 53): a LeaderWorkerSet per role (size = the role's nodes) and the router
as a Deployment with its Service, validated offline as tests/test_deploy_multinode.py does (the kubernetes client's
models and the LeaderWorkerSet CRD's schema); compose: a file per host of each role and one for the router."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.cli import main
from flagdeploy.planner import PlanRequest
from flagdeploy.planner.pd import PDRequest, make_pd_plan
from installer.deploy import PD_GROUP_LABEL, render_pd, write_pd

pytest.importorskip("kubernetes", minversion="37")
pytest.importorskip("jsonschema")
from tests.test_deploy_multinode import check_k8s_model, crd_errors  # noqa: E402


@pytest.fixture(scope="module")
def a3():
    return make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "ascend910c", 16, concurrency=64),
                                  prefill_nodes=2, decode_nodes=4))


@pytest.fixture(scope="module")
def h200():
    return make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, concurrency=64, engine="vllm"),
                                  prefill_nodes=1, decode_nodes=2, input_len=10000, output_len=1000))


@pytest.fixture(scope="module")
def sglang():
    return make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, concurrency=64, engine="sglang"),
                                  prefill_nodes=2, decode_nodes=2))


def k8s(plan, **kw) -> list[dict]:
    files = render_pd("k8s", plan, **kw)
    assert sorted(files) == ["pd.yaml", "profile.decode.yaml", "profile.prefill.yaml"]
    return list(yaml.safe_load_all(files["pd.yaml"]))


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def command_text(container) -> str:
    return " ".join(container["command"])


@pytest.mark.parametrize("nic", [None, "eth0"])
@pytest.mark.parametrize("which", ["a3", "h200", "sglang"])
def test_k8s_objects_pass_the_crd_and_the_kubernetes_models(which, nic, request):
    plan = request.getfixturevalue(which)
    docs = k8s(plan, nic=nic)
    sets = by_kind(docs, "LeaderWorkerSet")
    assert [s["metadata"]["name"].rsplit("-", 1)[1] for s in sets] == ["prefill", "decode"]
    for lws, role in zip(sets, (plan.prefill, plan.decode)):
        assert crd_errors(lws) == []
        t = lws["spec"]["leaderWorkerTemplate"]
        assert t["size"] == role.nodes and lws["spec"]["replicas"] == 1
        for key in ("leaderTemplate", "workerTemplate"):
            check_k8s_model(t[key], "V1PodTemplateSpec")
    for svc in by_kind(docs, "Service"):
        check_k8s_model(svc, "V1Service")
    (router,) = by_kind(docs, "Deployment")
    check_k8s_model(router, "V1Deployment")
    assert len(by_kind(docs, "Service")) == 3  # each role's leader and the router


def test_k8s_roles_carry_their_kv_settings_probes_and_host_network(a3):
    docs = k8s(a3, nic="eth0")
    for lws, role, kv_role in zip(by_kind(docs, "LeaderWorkerSet"), ("prefill", "decode"),
                                  ("kv_producer", "kv_consumer")):
        t = lws["spec"]["leaderWorkerTemplate"]
        leader, worker = t["leaderTemplate"], t["workerTemplate"]
        (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
        for pod, c in ((leader, lc), (worker, wc)):
            spec = pod["spec"]
            assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            assert pod["metadata"]["labels"][PD_GROUP_LABEL] == "flagdeploy-glm-5-3-flash"
            (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["labelSelector"]["matchExpressions"][0]["key"] == PD_GROUP_LABEL  # one pod of PD a host
            assert c["resources"]["limits"] == {"huawei.com/Ascend910": "16"}
            env = {e["name"]: e for e in c["env"]}
            assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["HCCL_SOCKET_IFNAME"]["value"] == "eth0"
            assert "HCCL_IF_IP" not in env  # left out in containers, as the multi-node sets do
            words = shlex.split(c["command"][-1].splitlines()[-1])
            cfg = json.loads(words[words.index("--kv-transfer-config") + 1])
            assert cfg["kv_role"] == kv_role and cfg["kv_port"] == "36000"
            assert cfg["kv_connector_extra_config"]["prefill"] == {"dp_size": 2, "tp_size": 16}
            assert cfg["kv_connector_extra_config"]["decode"] == {"dp_size": 16, "tp_size": 4}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert lc[probe]["httpGet"]["path"] == "/health" and probe not in wc
        assert {"name": "http", "containerPort": 8100 if role == "prefill" else 8200} in lc["ports"]
    (router,) = by_kind(docs, "Deployment")
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    text = command_text(rc)
    assert "--prefiller-hosts flagdeploy-glm-5-3-flash-prefill-leader --prefiller-ports 8100" in text
    assert "--decoder-hosts flagdeploy-glm-5-3-flash-decode-leader --decoder-ports 8200" in text
    assert rc["readinessProbe"]["tcpSocket"] == {"port": "http"}  # the example proxy has no health path


def test_k8s_vllm_router_reaches_the_role_services(h200):
    docs = k8s(h200)
    (router,) = by_kind(docs, "Deployment")
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["command"][:2] == ["vllm-router", "--vllm-pd-disaggregation"]
    i = rc["command"].index("--prefill")
    assert rc["command"][i + 1:i + 3] == ["http://flagdeploy-glm-5-3-flash-prefill-leader:8100", "none"]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health"
    for lws in by_kind(docs, "LeaderWorkerSet"):
        (c,) = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(NODE_IP)"  # Kubernetes fills it from NODE_IP above
        assert [e["name"] for e in c["env"]].index("NODE_IP") == 0


def test_k8s_sglang_roles_and_router(sglang):
    docs = k8s(sglang)
    for lws, role in zip(by_kind(docs, "LeaderWorkerSet"), ("prefill", "decode")):
        for key in ("leaderTemplate", "workerTemplate"):
            (c,) = lws["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"]
            text = command_text(c)
            assert f"--disaggregation-mode {role}" in text and "--disaggregation-transfer-backend mooncake" in text
            assert "--dist-init-addr" in text  # the role's own multi-node launch
    (router,) = by_kind(docs, "Deployment")
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["command"][:4] == ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert "http://flagdeploy-glm-5-3-flash-prefill-leader:8100" in rc["command"]


def test_compose_a_file_per_host_of_each_role_and_the_router(h200):
    files = render_pd("compose", h200)
    assert sorted(files) == ["compose.decode.node0.yaml", "compose.decode.node1.yaml", "compose.prefill.node0.yaml",
                             "compose.router.yaml", "profile.decode.yaml", "profile.prefill.yaml"]
    for name in ("compose.prefill.node0.yaml", "compose.decode.node1.yaml"):
        (svc,) = yaml.safe_load(files[name])["services"].values()
        assert svc["network_mode"] == "host" and "ports" not in svc
        env = svc["environment"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "${NODE_IP}" and env["NODE_IP"].startswith("${NODE_IP:?")
        assert "--kv-transfer-config" in command_text(svc)
    (router,) = yaml.safe_load(files["compose.router.yaml"])["services"].values()
    assert router["ports"] == ["8000:8000"] and "vllm-router --vllm-pd-disaggregation" in command_text(router)
    assert router["environment"]["PREFILL_IP"].startswith("${PREFILL_IP:?")


def test_refusals_say_what_to_do(h200):
    with pytest.raises(ValueError, match="deploy k8s --pd"):
        render_pd("docker", h200)
    one = make_pd_plan(PDRequest(PlanRequest("smollm2-135m-instruct", "h200", 8, engine="vllm"), input_len=128,
                                 output_len=128))
    with pytest.raises(ValueError, match="--prefill-nodes and --decode-nodes"):
        render_pd("k8s", one)


def test_cli_deploy_k8s_pd_writes_the_set(tmp_path):
    r = CliRunner().invoke(main, ["deploy", "k8s", "--pd", "--chip", "ascend910c", "--model", "glm-5.3-flash",
                                  "--prefill-nodes", "2", "--decode-nodes", "4", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "pd.yaml").exists() and "recipe vllm-ascend-glm5-a3" in r.output
    r = CliRunner().invoke(main, ["deploy", "k8s", "--chip", "h200", "--model", "glm-5.3-flash", "--prefill-nodes", "1",
                                  "-o", str(tmp_path)])
    assert r.exit_code != 0 and "add --pd" in r.output
    r = CliRunner().invoke(main, ["deploy", "docker", "--pd", "--chip", "h200", "--model", "glm-5.3-flash",
                                  "--prefill-nodes", "1", "--decode-nodes", "1", "-o", str(tmp_path / "d")])
    assert r.exit_code != 0 and "compose" in r.output


def test_write_pd_is_one_set(h200, tmp_path):
    paths = write_pd("compose", h200, tmp_path)
    assert {p.name for p in paths} >= {"compose.router.yaml"}
    with pytest.raises(FileExistsError):
        write_pd("compose", h200, tmp_path)
