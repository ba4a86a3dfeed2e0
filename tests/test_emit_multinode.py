"""Launches over several nodes: each node's command for vLLM, vllm-ascend and SGLang, read from the engines.yaml
rules (flags and per-node environment), node 0 (the head) against the workers, and scripts that re-parse.

Nothing here runs an engine on two nodes; the flags are checked against the engines' argument names as the
multi-node sources spell them (shared/docs/speculative-multimodal-multinode.md section 3)."""

from __future__ import annotations

import dataclasses
import functools
import shlex

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.cli import main
from flagdeploy.planner import PlanRequest, make_plan
from flagdeploy.planner.cost import Layout
from flagdeploy.planner.emit import ENGINES_FILE, EmitError, Launch, emit, emit_nodes
from flagdeploy.planner.profile import Profile

SPEC = yaml.safe_load(ENGINES_FILE.read_text())
RULES = {rule["id"]: rule for rule in SPEC["rules"]}
# The multi-node argument names of the sources: vllm docs/serving/parallelism_scaling.md and
# data_parallel_deployment.md (vLLM), lws docs/examples/sglang/lws.yaml (SGLang), as quoted in section 3.1.
VLLM_NODE_FLAGS = {"--nnodes", "--node-rank", "--master-addr", "--headless", "--data-parallel-size",
                   "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
                   "--data-parallel-start-rank"}
SGLANG_NODE_FLAGS = {"--nnodes", "--node-rank", "--dist-init-addr"}
NODE_ENV_RULES = ("multinode-gloo-ifname", "multinode-cuda-nccl-ifname", "multinode-ascend-ifnames",
                  "multinode-ascend-hccl-if-ip")


@functools.lru_cache(maxsize=None)
def planned(chip: str, policy: str | None, layout: Layout | None) -> Profile:
    """The profile `flagdeploy plan --model glm-5.3-flash --chip CHIP --devices 8 --nodes 2` emits."""
    plan = make_plan(PlanRequest("glm-5.3-flash", chip, 8, nodes=2, policy=policy, layout=layout))
    assert plan.chosen is not None, plan.rejected
    return plan.profile()


BF16_A2 = ("ascend910b", "bf16", Layout(tp=8, pp=2))  # Atlas 800 A2: 8 dies of 64 GB per node
INT8_A2 = ("ascend910b", "no-fp8", Layout(tp=8, dp=2, ep=16))  # the INT8 mix, DP across the nodes
H200_PP = ("h200", None, Layout(tp=8, pp=2))
H200_DPA = ("h200", None, Layout(tp=8, dp=2, ep=16))


def node_flags(rule_id: str, **names) -> dict[str, str | None]:
    """A rule's flags filled as the emitter fills them (None: a bare switch)."""
    return {flag: None if value is True else str(value).format(**names)
            for flag, value in RULES[rule_id]["flags"].items()}


def rule_env(rule_id: str, **names) -> dict[str, str]:
    return {k: str(v).format(**names) for k, v in RULES[rule_id]["env"].items()}


def has_flags(argv: list[str], expected: dict[str, str | None]) -> bool:
    for flag, value in expected.items():
        if flag not in argv:
            return False
        if value is not None and argv[argv.index(flag) + 1] != value:
            return False
    return True


def without(argv: list[str], flags: set[str]) -> list[str]:
    """argv less the given flags and their values (a flag followed by another flag is a bare switch)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def added_flags(profile: Profile, engine: str, launch: Launch) -> set[str]:
    """The flags a node's launch has beyond the same layout's launch on one node of all the devices."""
    one = emit(dataclasses.replace(profile, nodes=1, devices=profile.devices * profile.nodes), engine)
    return {a for a in launch.argv if a.startswith("--")} - set(one.argv)


def reparsed(launch: Launch) -> None:
    """The script parses as shell words, and its command line is exactly the launch's env and argv."""
    script = launch.shell()
    shlex.split(script, comments=True)
    words = shlex.split(script.rstrip("\n").splitlines()[-1])
    assert words == [f"{k}={v}" for k, v in launch.env.items()] + launch.argv


def test_glm_bf16_on_two_a2_nodes_is_one_replica_over_both():
    profile = planned(*BF16_A2)
    assert (profile.chip, profile.nodes, profile.devices, profile.tp, profile.pp, profile.dp) == ("ascend910b", 2, 8, 8, 2, 1)
    assert profile.quantization is None  # BF16 weights: no --quantization ascend
    head, worker = emit_nodes(profile, "vllm-ascend")
    for rank, launch in enumerate((head, worker)):
        reparsed(launch)
        assert launch.argv[:3] == ["vllm", "serve", "zai-org/GLM-5.3-Flash"]  # the checkpoint the preset describes
        assert has_flags(launch.argv, node_flags("vllm-multinode-one-replica", nodes=2, node_rank=rank,
                                                 head_addr="$HEAD_IP"))
        assert not {"--data-parallel-size", "--data-parallel-address", "--quantization"} & set(launch.argv)
        # the per-node environment: the rules' variables, on top of the engine's own (HCCL_BUFFSIZE, AIV, ...)
        expected = (rule_env("multinode-gloo-ifname", nic="$NIC") | rule_env("multinode-ascend-ifnames", nic="$NIC")
                    | rule_env("multinode-ascend-hccl-if-ip", node_ip="$NODE_IP"))
        assert expected == {"GLOO_SOCKET_IFNAME": "$NIC", "TP_SOCKET_IFNAME": "$NIC", "HCCL_SOCKET_IFNAME": "$NIC",
                            "HCCL_IF_IP": "$NODE_IP"}
        assert launch.env.items() >= expected.items()
        for name, value in SPEC["engines"]["vllm-ascend"]["env"].items():  # as on one node
            assert launch.env[name] == str(value).format(visible_devices="0,1,2,3,4,5,6,7")
        assert launch.env["HCCL_BUFFSIZE"] == "200"
        assert added_flags(profile, "vllm-ascend", launch) <= VLLM_NODE_FLAGS
        assert "NCCL_SOCKET_IFNAME" not in launch.env
        # the shell fills the variables, and stops when one is unset
        script = launch.shell()
        assert 'GLOO_SOCKET_IFNAME="$NIC"' in script and '--master-addr "$HEAD_IP"' in script
        for var in ("HEAD_IP", "NIC", "NODE_IP"):
            assert f'"${{{var}:?set {var} ' in script
        assert any("vllm-multinode-without-ray" in w for w in launch.warnings)
    # node 0 serves the API; the worker is headless; otherwise the two commands are the same
    assert "--headless" not in head.argv and has_flags(worker.argv, node_flags("vllm-multinode-one-replica-workers"))
    assert without(head.argv, {"--node-rank"}) == without(worker.argv, {"--node-rank", "--headless"})
    assert head.env == worker.env
    assert any("multinode-ascend-preflight" in w for w in head.warnings)


def test_npu_direct_roce_leaves_hccl_if_ip_out():
    head, worker = emit_nodes(planned(*BF16_A2), "vllm-ascend", npu_direct_roce=True)
    for launch in (head, worker):
        assert "HCCL_IF_IP" not in launch.env and launch.env["HCCL_SOCKET_IFNAME"] == "$NIC"
        assert any("multinode-ascend-direct-roce" in w for w in launch.warnings)
        assert '"${NODE_IP:?' not in launch.shell()  # nothing reads it any more


def test_int8_mix_on_two_a2_nodes_runs_dp_across_the_nodes():
    profile = planned(*INT8_A2)
    assert (profile.tp, profile.dp, profile.ep, profile.pp, profile.quantization) == (8, 2, 16, 1, "w8a8")
    launches = emit_nodes(profile, "vllm-ascend", head_addr="10.0.0.1", nic="eth0")
    assert len(launches) == 2
    for rank, launch in enumerate(launches):
        reparsed(launch)
        argv = launch.argv
        # the vllm-ascend GLM-5 two-node shape: DP 2, one DP rank per node, TP inside the node, experts over all 16
        assert has_flags(argv, {"--tensor-parallel-size": "8", "--data-parallel-size": "2",
                                "--enable-expert-parallel": None, "--quantization": "ascend"})
        assert has_flags(argv, node_flags("vllm-multinode-dp", dp_local=1, head_addr="10.0.0.1"))
        assert "--nnodes" not in argv and "--master-addr" not in argv
        assert launch.env["GLOO_SOCKET_IFNAME"] == launch.env["HCCL_SOCKET_IFNAME"] == "eth0"
        assert launch.env["HCCL_IF_IP"] == "$NODE_IP"  # each node's own address stays a variable
        assert added_flags(profile, "vllm-ascend", launch) <= VLLM_NODE_FLAGS
        assert '"${NODE_IP:?' in launch.shell() and "HEAD_IP" not in launch.shell()
    head, worker = launches
    assert "--headless" not in head.argv and "--data-parallel-start-rank" not in head.argv
    assert has_flags(worker.argv, node_flags("vllm-multinode-dp-workers", dp_start_rank=1))
    assert without(head.argv, set()) == without(worker.argv, {"--headless", "--data-parallel-start-rank"})


def test_planned_dp_with_pipeline_stages_keeps_each_replica_inside_a_node():
    """The planner's own choice on 2x A2 (TP2 x DP4 x PP2, EP8): vLLM puts whole DP replicas on a node,
    two per node, and says that its experts then cross nodes where the estimate kept them inside one."""
    profile = planned("ascend910b", "bf16", None)
    if not (profile.dp > 1 and profile.pp > 1):
        pytest.skip(f"the planner now chooses tp={profile.tp} dp={profile.dp} pp={profile.pp}")
    local = 8 // (profile.tp * profile.pp)
    launches = emit_nodes(profile, "vllm-ascend")
    for rank, launch in enumerate(launches):
        assert has_flags(launch.argv, {"--data-parallel-size-local": str(local)})
        if rank:
            assert has_flags(launch.argv, node_flags("vllm-multinode-dp-workers", dp_start_rank=rank * local))
        assert any("vllm-multinode-pp-in-node" in w for w in launch.warnings) == (profile.ep > 1)


def test_two_h200_nodes_vllm_one_replica_and_sglang_dp_attention():
    head, worker = emit_nodes(planned(*H200_PP), "vllm")
    for rank, launch in enumerate((head, worker)):
        reparsed(launch)
        assert has_flags(launch.argv, node_flags("vllm-multinode-one-replica", nodes=2, node_rank=rank,
                                                 head_addr="$HEAD_IP"))
        env = rule_env("multinode-gloo-ifname", nic="$NIC") | rule_env("multinode-cuda-nccl-ifname", nic="$NIC")
        assert launch.env == env  # on CUDA: only the interface variables, no HCCL ones
        assert not any("multinode-ascend" in w for w in launch.warnings)
    assert "--headless" in worker.argv and "--headless" not in head.argv

    profile = planned(*H200_DPA)
    launches = emit_nodes(profile, "sglang", head_addr="10.0.0.1", nic="ens1f0")
    for rank, launch in enumerate(launches):
        reparsed(launch)
        argv = launch.argv
        assert has_flags(argv, node_flags("sglang-multinode", nodes=2, node_rank=rank, head_addr="10.0.0.1"))
        assert argv[argv.index("--dist-init-addr") + 1] == "10.0.0.1:20000"
        # DP attention over both nodes: --tp-size counts the whole group, the same on every node
        assert has_flags(argv, {"--tp-size": "16", "--dp-size": "2", "--enable-dp-attention": None})
        assert launch.env == {"GLOO_SOCKET_IFNAME": "ens1f0", "NCCL_SOCKET_IFNAME": "ens1f0"}
        assert "--headless" not in argv and added_flags(profile, "sglang", launch) == SGLANG_NODE_FLAGS
    assert without(launches[0].argv, {"--node-rank"}) == without(launches[1].argv, {"--node-rank"})
    # a shell variable inside a longer word is still filled by the shell
    assert '--dist-init-addr "$HEAD_IP:20000"' in emit_nodes(profile, "sglang")[1].shell()


def test_what_is_not_emitted_says_why_and_what_to_do():
    with pytest.raises(EmitError, match="multiNodesInferEnabled.*--emit vllm-ascend"):
        emit_nodes(planned(*BF16_A2), "mindie")
    with pytest.raises(EmitError, match="plain DP replicas.*--upstream"):
        emit_nodes(planned("h200", None, Layout(tp=8, dp=2)), "sglang")
    # vLLM DP replicas whose pipeline stages would span nodes: neither documented form
    cross = Profile(model="/m", chip="h200", devices=8, nodes=4, tp=8, pp=2, dp=2)
    with pytest.raises(EmitError, match="do not sit whole inside nodes.*--layout tp=8,dp=4"):
        emit_nodes(cross, "vllm")
    with pytest.raises(EmitError, match="does not fill 2 nodes x 8 devices"):
        emit_nodes(Profile(model="/m", chip="h200", devices=8, nodes=2, tp=8), "vllm")
    with pytest.raises(EmitError, match="emit_nodes"):
        emit(planned(*H200_PP), "vllm")
    with pytest.raises(EmitError, match="head_addr"):
        emit_nodes(planned(*H200_PP), "vllm", head_addr="")
    with pytest.raises(EmitError, match="Unknown engine"):
        emit_nodes(planned(*H200_PP), "tgi")


def test_one_node_is_the_single_launch():
    one = Profile(model="/models/GLM-5.3-Flash", chip="h200", model_type="glm5_next", devices=8, tp=8)
    (launch,) = emit_nodes(one, "vllm")
    assert launch == emit(one, "vllm")
    assert not {"--nnodes", "--headless", "--data-parallel-address"} & set(launch.argv)
    assert "GLOO_SOCKET_IFNAME" not in launch.env and not launch.setup
    reparsed(launch)


def test_cli_prints_each_nodes_script_under_its_heading():
    args = ["plan", "--model", "glm-5.3-flash", "--chip", "ascend910b", "--devices", "8", "--nodes", "2",
            "--policy", "no-fp8", "--layout", "tp=8,dp=2,ep=16", "--emit", "vllm-ascend",
            "--master-addr", "10.0.0.1", "--nic", "eth0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("# node 0 of 2\n")
    head, worker = r.output.split("# node 1 of 2\n")
    expected = emit_nodes(planned(*INT8_A2), "vllm-ascend", head_addr="10.0.0.1", nic="eth0")
    assert head == f"# node 0 of 2\n{expected[0].shell()}\n" and worker == expected[1].shell()
    assert "--data-parallel-address 10.0.0.1" in head and "--headless --data-parallel-start-rank 1" in worker
    r = CliRunner().invoke(main, args[:-4] + ["--emit", "mindie"])
    assert r.exit_code != 0 and "multiNodesInferEnabled" in r.output
