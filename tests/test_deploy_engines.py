"""Issue 50 part 3: `deploy` ranks only the layouts the chosen engine runs, picks an engine that runs one by default
(vLLM-Ascend first on Ascend), and renders the external engines' own multi-node modes (vLLM, vLLM-Ascend, SGLang)
as LeaderWorkerSets and one compose file per host, from the launches `plan --emit` prints (flagdeploy/planner/emit.py).

The sweep runs `deploy k8s` and `deploy compose` for the glm-5.3-flash preset on every catalog chip with at least 8
devices per node, at 1, 2 and 4 nodes: each writes files that pass the schemas, or says that nothing fits and why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.chips import all_chips, get_chip
from flagdeploy.cli import main
from flagdeploy.planner import PlanRequest, Profile, make_plan
from flagdeploy.planner.emit import EmitError, emit, emit_nodes, engine_data, layout_refusal
from installer.deploy import DATA, PLACEHOLDER_IMAGE, deploy_engines, engine_image, engine_problem, render

from test_deploy_multinode import check_k8s_model, crd_errors, env_of, templates

pytest.importorskip("kubernetes", minversion="37")
pytest.importorskip("jsonschema")

BIG_CHIPS = [c.id for c in all_chips() if c.devices_per_node >= 8]
RECIPES = set(yaml.safe_load(DATA.read_text())["vendors"])  # installer/containers.yaml: vendors with a container recipe
LEADER = "$(LWS_LEADER_ADDRESS)"


def deploy_cli(*args: str):
    return CliRunner().invoke(main, ["deploy", *args], catch_exceptions=False)


def docs_of(text: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


def check_k8s_files(out: Path, nodes: int) -> None:
    """The Kubernetes objects against the client's models, and a LeaderWorkerSet against the CRD schema."""
    if nodes == 1:
        docs = docs_of((out / "deployment.yaml").read_text())
        # the builtin Deployment writes its device count as an integer, which the API server takes and the client's
        # models do not (tests/test_deploy_multinode.py check_k8s_model): compared as the string the server returns
        for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"]:
            limits = c.get("resources", {}).get("limits", {})
            limits.update({k: str(v) for k, v in limits.items()})
        check_k8s_model(docs["Deployment"], "V1Deployment")
    else:
        docs = docs_of((out / "leaderworkerset.yaml").read_text())
        lws = docs["LeaderWorkerSet"]
        assert crd_errors(lws) == []
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == nodes
        for t in templates(lws):
            check_k8s_model(t, "V1PodTemplateSpec")
    check_k8s_model(docs["Service"], "V1Service")
    if "ConfigMap" in docs:
        check_k8s_model(docs["ConfigMap"], "V1ConfigMap")


# ---- the sweep ---------------------------------------------------------------------------------------------------


def test_the_sweep_covers_the_big_chips():
    assert {"ascend910b", "ascend910c", "ascend950", "h200", "h20"} <= set(BIG_CHIPS)
    assert {c.vendor for c in all_chips()} <= RECIPES  # every vendor of the catalog has a container recipe
    assert "cpu" not in BIG_CHIPS and "ascend310b" not in BIG_CHIPS


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("chip", BIG_CHIPS)
def test_default_deploy_of_the_flagship_succeeds_or_says_nothing_fits(chip, nodes, tmp_path):
    for kind in ("k8s", "compose"):
        out = tmp_path / kind
        args = [kind, "--chip", chip, "--model", "glm-5.3-flash", "--nodes", str(nodes), "-o", str(out)]
        if nodes > 1:
            args += ["--nic", "eth0"] + (["--master-addr", "10.0.0.11"] if kind == "compose" else [])
        r = deploy_cli(*args)
        if r.exit_code:
            assert r.exit_code == 1, r.output
            # one line that says nothing fits, the reasons under it, and the command that shows every layout
            first, *rest = r.output.strip().splitlines()
            assert first.startswith("error: nothing that ") and " fits glm-5.3-flash on " in first, r.output
            assert rest and rest[-1].startswith("`flagdeploy plan --model glm-5.3-flash")
            assert "shows every layout" in rest[-1]
            assert not out.exists() or not any(out.iterdir())
            continue
        profile = Profile.load(out / "profile.yaml")
        assert profile.nodes == nodes and profile.engine in deploy_engines(chip)
        assert layout_refusal(profile, profile.engine) is None and engine_problem(profile, profile.engine) is None
        if kind == "k8s":
            check_k8s_files(out, nodes)
        else:
            names = ["compose.yaml"] if nodes == 1 else [f"compose.node{i}.yaml" for i in range(nodes)]
            assert sorted(p.name for p in out.iterdir()) == sorted(["profile.yaml", *names])
            for name in names:
                (svc,) = yaml.safe_load((out / name).read_text())["services"].values()
                assert svc["command"] and svc["image"]


def test_the_flagship_on_two_a3_nodes_deploys_by_default_with_vllm_ascend(tmp_path):
    """The issue's command: it used to stop at the planner's pp=2 layout, which the builtin engine does not run."""
    r = deploy_cli("k8s", "--chip", "ascend910c", "--model", "glm-5.3-flash", "--nodes", "2", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "engine: vllm-ascend" in r.output
    lws = docs_of((tmp_path / "leaderworkerset.yaml").read_text())["LeaderWorkerSet"]
    leader, worker = templates(lws)
    for t in (leader, worker):
        assert t["spec"]["containers"][0]["image"] == "quay.io/ascend/vllm-ascend:v0.23.0-a3"  # the matrix's A3 row
    assert "vllm serve zai-org/GLM-5.3-Flash" in leader["spec"]["containers"][0]["command"][-1]
    # and the builtin engine still deploys where a layout it runs fits
    r = deploy_cli("k8s", "--chip", "ascend910c", "--model", "glm-5.3-flash", "--nodes", "2", "--engine", "builtin",
                   "-o", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    profile = Profile.load(tmp_path / "b" / "profile.yaml")
    assert profile.engine == "builtin" and profile.pp == 1 and profile.ep == profile.tp * profile.dp


def test_default_falls_back_to_an_engine_that_runs_a_fitting_layout(tmp_path):
    """A dense model over two NVIDIA nodes: the builtin engine runs no layout of it (no TP across nodes from the
    planner, no pipeline stages, no plain DP replicas over nodes); the next engine of the chip's order does."""
    assert deploy_engines("h200")[0] == "builtin"
    r = deploy_cli("k8s", "--chip", "h200", "--model", "smollm2-135m-instruct", "--nodes", "2", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "engine: vllm" in r.output
    r = deploy_cli("k8s", "--chip", "h200", "--model", "smollm2-135m-instruct", "--nodes", "2", "--engine", "builtin",
                   "-o", str(tmp_path / "b"))
    assert r.exit_code == 1
    first = r.output.splitlines()[0]
    assert first.startswith("error: nothing that builtin runs fits smollm2-135m-instruct on 2 node(s) x 8 h200")
    assert "--engine vllm" in r.output and "--engine builtin` shows every layout" in r.output
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


# ---- plan and deploy rank the same layouts ---------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "chip", "devices", "nodes"), [("builtin", "ascend910c", 16, 2),
                                                                 ("vllm-ascend", "ascend910b", 8, 4),
                                                                 ("sglang", "ascend910c", 16, 2)])
def test_plan_for_an_engine_ranks_only_layouts_it_runs(engine, chip, devices, nodes):
    plan = make_plan(PlanRequest("glm-5.3-flash", chip, devices, nodes=nodes, engine=engine))
    assert plan.chosen is not None
    for e in [plan.chosen, *plan.alternatives]:
        profile = plan.profile(e)
        assert profile.engine == engine and layout_refusal(profile, engine) is None
        if engine != "builtin":
            emit_nodes(profile, engine)  # renders: no rule refuses it
    refused = [r for r in plan.rejected if "does not run this layout" in r.reason]
    assert refused and all(r.reason.startswith(f"{engine} does not run this layout: ") for r in refused)
    everything = make_plan(PlanRequest("glm-5.3-flash", chip, devices, nodes=nodes))
    assert not any("does not run this layout" in r.reason for r in everything.rejected)


def test_plan_emit_uses_the_engine_filter_and_the_profile_records_the_engine():
    base = ["plan", "--model", "glm-5.3-flash", "--chip", "ascend910b", "--nodes", "2"]
    r = CliRunner().invoke(main, [*base, "--emit", "profile", "--engine", "builtin"])
    assert r.exit_code == 0, r.output
    profile = Profile(**yaml.safe_load(r.output)["profile"])
    assert profile.engine == "builtin" and profile.pp == 1 and layout_refusal(profile, "builtin") is None
    r = CliRunner().invoke(main, [*base, "--emit", "vllm-ascend"])
    assert r.exit_code == 0, r.output and r.output.startswith("# node 0 of 2\n")
    r = CliRunner().invoke(main, [*base, "--emit", "vllm", "--engine", "sglang"])
    assert r.exit_code == 2 and "--engine" in r.output


def test_the_layouts_data_is_what_emit_refuses():
    """One list: a layout engines.yaml `layouts` refuses for an engine is one emit refuses, with the same text."""
    cross = Profile(model="/m", chip="h200", devices=8, nodes=4, tp=8, pp=2, dp=2)
    why = layout_refusal(cross, "vllm")
    assert why and "vllm-multinode-replica-crosses-nodes" in why
    with pytest.raises(EmitError) as exc:
        emit_nodes(cross, "vllm")
    assert why in str(exc.value)
    pp = Profile(model="/m", chip="h200", devices=8, tp=4, pp=2)
    assert "builtin-no-pipeline-stages" in layout_refusal(pp, "builtin") and layout_refusal(pp, "vllm") is None
    with pytest.raises(ValueError, match="pipeline stages"):
        render("k8s", pp, engine="builtin")  # serve refuses pp on one node too: deploy says so before writing
    with pytest.raises(ValueError, match="deploy runs one of"):
        render("k8s", pp, engine="mindie")


# ---- the external engines' multi-node files ---------------------------------------------------------------------

A3_DP = Profile(model="zai-org/GLM-5.3-Flash", served_model_name="glm-5.3-flash", model_type="glm5_next",
                chip="ascend910c", devices=16, nodes=2, tp=16, dp=2, ep=32, quantization="w8a8")
H200_PP = Profile(model="zai-org/GLM-5.3-Flash", model_type="glm5_next", chip="h200", devices=8, nodes=4, tp=8, pp=4)
H200_DPA = Profile(model="zai-org/GLM-5.3-Flash", model_type="glm5_next", chip="h200", devices=8, nodes=4, tp=8, dp=4,
                   ep=32)
A2_DP4 = Profile(model="zai-org/GLM-5.3-Flash", model_type="glm5_next", chip="ascend910b", devices=8, nodes=4, tp=4,
                 dp=8, ep=32, quantization="w8a8")
CASES = [(A3_DP, "vllm-ascend"), (A2_DP4, "vllm-ascend"), (H200_PP, "vllm"), (H200_DPA, "vllm"), (H200_DPA, "sglang")]


def extra(engine: str) -> list[str]:
    return [str(x) for kv in engine_data(engine)["container_flags"].items() for x in kv]


def run_script(command: list[str], **env: str) -> list[str]:
    """What a container's command runs, as argv: `bash -c SCRIPT` with its `exec` printed instead, after Kubernetes'
    (or compose's) own expansion ($(LWS_LEADER_ADDRESS) filled, $$ to $); the CANN `source` lines are skipped."""
    if command[:2] != ["/bin/bash", "-c"]:
        return [w.replace(LEADER, env.get("LWS_LEADER_ADDRESS", LEADER)) for w in command]
    script = command[2].replace(LEADER, env.get("LWS_LEADER_ADDRESS", LEADER)).replace("$$", "$")
    script = "\n".join(line for line in script.splitlines() if not line.startswith("source "))
    script = script.replace("exec ", "printf '%s\\n' ", 1)
    out = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                         check=True).stdout
    return out.splitlines()


@pytest.mark.parametrize(("profile", "engine"), CASES, ids=[f"{p.chip}-{e}-{p.nodes}" for p, e in CASES])
def test_leaderworkerset_runs_the_engines_own_multinode_mode(profile, engine):
    text = render("k8s", profile, engine=engine, nic="eth0")["leaderworkerset.yaml"]
    docs = docs_of(text)
    lws = docs["LeaderWorkerSet"]
    assert crd_errors(lws) == [] and "ConfigMap" not in docs
    leader, worker = templates(lws)
    for t in (leader, worker):
        check_k8s_model(t, "V1PodTemplateSpec")
        assert t["spec"]["hostNetwork"] is True and t["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    check_k8s_model(docs["Service"], "V1Service")
    (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
    # the launches `plan --emit` prints for node 0 and for every worker node, filled as LWS fills them
    addr = "leader.flagdeploy.default.svc"
    expected = emit_nodes(profile, engine, head_addr=addr, nic="eth0", npu_direct_roce=True)
    assert run_script(lc["command"], LWS_LEADER_ADDRESS=addr) == [*expected[0].argv, *extra(engine)]
    for rank in range(1, profile.nodes):
        got = run_script(wc["command"], LWS_LEADER_ADDRESS=addr, LWS_WORKER_INDEX=str(rank))
        assert got == [*expected[rank].argv, *extra(engine)], rank
    # one environment for all pods: the launch's, less the visible-devices variable the device plugin replaces
    env = env_of(lc)
    assert env == env_of(wc)
    assert {k: v for k, v in expected[0].env.items() if not k.endswith("VISIBLE_DEVICES")}.items() <= env.items()
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and "HCCL_IF_IP" not in env
    assert not any(k.endswith("VISIBLE_DEVICES") for k in env)
    # the leader serves HTTP and carries the probes on the engine's health path; the workers neither
    assert lc["ports"] == [{"name": "http", "containerPort": profile.port}] and "ports" not in wc
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert lc[probe]["httpGet"] == {"path": engine_data(engine)["health"], "port": "http"}
        assert probe not in wc
    assert lc["startupProbe"]["failureThreshold"] * lc["startupProbe"]["periodSeconds"] >= 30 * 60
    assert lc["image"] == (engine_image(profile.chip, engine) or PLACEHOLDER_IMAGE)
    assert lc["resources"]["limits"] == wc["resources"]["limits"]


def test_images_come_from_the_matrix_unless_given():
    assert engine_image("ascend910c", "vllm-ascend") == "quay.io/ascend/vllm-ascend:v0.23.0-a3"
    assert engine_image("ascend910b", "vllm-ascend") == "quay.io/ascend/vllm-ascend:v0.23.0"
    assert engine_image("h200", "vllm") == "vllm/vllm-openai:v0.29.0"
    assert engine_image("h200", "sglang") is None  # the matrix names none: the placeholder to pin
    lws = docs_of(render("k8s", H200_DPA, engine="sglang")["leaderworkerset.yaml"])["LeaderWorkerSet"]
    assert {t["spec"]["containers"][0]["image"] for t in templates(lws)} == {PLACEHOLDER_IMAGE}
    lws = docs_of(render("k8s", A3_DP, engine="vllm-ascend", image="reg.example/va@sha256:1")["leaderworkerset.yaml"])
    images = {t["spec"]["containers"][0]["image"] for t in templates(lws["LeaderWorkerSet"])}
    assert images == {"reg.example/va@sha256:1"}


@pytest.mark.parametrize(("profile", "engine"), CASES, ids=[f"{p.chip}-{e}-{p.nodes}" for p, e in CASES])
def test_compose_writes_each_hosts_launch(profile, engine):
    files = render("compose", profile, engine=engine, master_addr="10.0.0.11", nic="eth1")
    expected = emit_nodes(profile, engine, head_addr="10.0.0.11", nic="eth1", npu_direct_roce=True)
    assert sorted(files) == sorted(["profile.yaml", *(f"compose.node{r}.yaml" for r in range(profile.nodes))])
    assert Profile(**yaml.safe_load(files["profile.yaml"])["profile"]).engine == engine
    for rank, launch in enumerate(expected):
        text = files[f"compose.node{rank}.yaml"]
        (svc,) = yaml.safe_load(text)["services"].values()
        assert svc["network_mode"] == "host" and "ports" not in svc
        assert run_script(svc["command"]) == [*launch.argv, *extra(engine)]
        assert launch.env.items() <= svc["environment"].items() and "HCCL_IF_IP" not in svc["environment"]
        assert ("serves http://10.0.0.11:" in text) == (rank == 0)


def test_one_node_external_engine_files(tmp_path):
    one = Profile(model="zai-org/GLM-5.3-Flash", model_type="glm5_next", chip="h200", devices=8, tp=8, port=8001)
    launch = emit(one, "vllm")
    files = render("k8s", one, engine="vllm")
    docs = docs_of(files["deployment.yaml"])
    check_k8s_model(docs["Deployment"], "V1Deployment")
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == [*launch.argv, *extra("vllm")] and c["image"] == "vllm/vllm-openai:v0.29.0"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    # the engine downloads the checkpoint into the mounted cache (kept across restarts), wherever that is mounted
    (cache,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "cache"]
    hf_home = {e["name"]: e["value"] for e in c["env"]}["HF_HOME"]
    assert hf_home.startswith(cache + "/")
    (svc,) = yaml.safe_load(render("compose", one, engine="vllm")["compose.yaml"])["services"].values()
    assert svc["command"] == c["command"] and svc["ports"] == ["8001:8001"]
    script = render("docker", one, engine="vllm")["run.sh"]
    assert "vllm/vllm-openai:v0.29.0 vllm serve zai-org/GLM-5.3-Flash" in script and "--gpus 8" in script
    # a refusal names what to run instead, before anything is written
    with pytest.raises(ValueError, match="vllm-ascend runs only on Ascend"):
        render("k8s", one, engine="vllm-ascend")
    r = deploy_cli("docker", "--chip", "h200", "--model", "glm-5.3-flash", "--engine", "vllm", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert Profile.load(tmp_path / "profile.yaml").engine == "vllm" and "engine: vllm" in r.output


def test_deploy_a_profile_takes_its_engine_or_the_first_that_runs_it(tmp_path):
    plan = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=2, layout=None))
    plain = plan.profile()
    assert plain.engine is None and plain.pp > 1  # planned for no engine in particular: pipeline stages
    plain.save(tmp_path / "p.yaml")
    r = deploy_cli("k8s", "--profile", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert "engine: vllm-ascend" in r.output and Profile.load(tmp_path / "a" / "profile.yaml").engine == "vllm-ascend"
    r = deploy_cli("k8s", "--profile", str(tmp_path / "p.yaml"), "--engine", "builtin", "-o", str(tmp_path / "b"))
    assert r.exit_code == 1 and "pipeline stages" in r.output and "--engine vllm-ascend" in r.output
    builtin = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=2, engine="builtin")).profile()
    builtin.save(tmp_path / "b.yaml")
    r = deploy_cli("k8s", "--profile", str(tmp_path / "b.yaml"), "-o", str(tmp_path / "c"))
    assert r.exit_code == 0 and "engine: builtin" in r.output, r.output
    lws = docs_of((tmp_path / "c" / "leaderworkerset.yaml").read_text())["LeaderWorkerSet"]
    assert templates(lws)[0]["spec"]["containers"][0]["command"][:2] == ["flagdeploy", "serve"]


def test_an_engine_that_does_not_run_on_the_chip_is_refused_up_front(tmp_path):
    r = deploy_cli("k8s", "--chip", "h200", "--model", "glm-5.3-flash", "--nodes", "2", "--engine", "vllm-ascend",
                   "-o", str(tmp_path))
    assert r.exit_code == 1 and "vllm-ascend does not run on h200" in r.output and "builtin, vllm, sglang" in r.output
