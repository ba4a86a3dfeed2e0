"""`flagdeploy plan --pd` (issue 53, the external engines): a layout per role, the P:D ratio, whether PD pays, and each
engine's launches with their KV transfer settings (profiles/engines.yaml `pd`, /work/shared/docs/pd-disaggregation.md)."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from flagdeploy.cli import main
from flagdeploy.planner import Layout, PlanInputError, PlanRequest
from flagdeploy.planner.pd import PDRequest, make_pd_plan, pd_data
from flagdeploy.planner.pd_emit import role_launches, router_launch, script


def glm5_a3(**kw) -> PDRequest:
    """The vLLM-Ascend GLM-5 recipe's hardware: A3 (ascend910c, 16 dies a node), prefill 2 nodes, decode 4."""
    return PDRequest(PlanRequest("glm-5.3-flash", "ascend910c", 16, concurrency=64), prefill_nodes=2,
                     decode_nodes=4, **kw)


@pytest.fixture(scope="module")
def recipe():
    return make_pd_plan(glm5_a3())


def argv_of(launch) -> list[str]:
    return shlex.split(launch.shell().splitlines()[-1])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_vllm_ascend_glm5_recipe_comes_out_for_its_hardware(recipe):
    assert recipe.engine == "vllm-ascend" and recipe.connector == "mooncake"  # the Ascend default engine
    assert (recipe.prefill.nodes, recipe.prefill.devices) == (2, 16)
    assert (recipe.decode.nodes, recipe.decode.devices) == (4, 16)
    # prefill DP2 x TP16, decode DP16 x TP4, EP on (ep = tp x dp), no pipeline stages
    assert recipe.prefill.layout == Layout(tp=16, dp=2, ep=32, pp=1)
    assert recipe.decode.layout == Layout(tp=4, dp=16, ep=64, pp=1)
    assert recipe.prefill.recipe == recipe.decode.recipe == "vllm-ascend-glm5-a3"
    assert recipe.verdict.pays, recipe.verdict.reasons


def test_the_recipe_topology_is_the_same_on_every_node_and_kv_port_clears_the_transport(recipe):
    seen = set()
    for role, kv_role, nodes in (("prefill", "kv_producer", 2), ("decode", "kv_consumer", 4)):
        launches = role_launches(recipe, role)
        assert len(launches) == nodes
        for launch in launches:
            argv = argv_of(launch)
            cfg = json.loads(flag(argv, "--kv-transfer-config"))
            assert cfg["kv_connector"] == "MooncakeConnectorV1" and cfg["kv_role"] == kv_role
            extra = cfg["kv_connector_extra_config"]
            assert extra["use_ascend_direct"] is True
            seen.add(json.dumps({k: extra[k] for k in ("prefill", "decode")}, sort_keys=True))
            assert int(cfg["kv_port"]) >= 36000  # 16 NPUs a node: AscendDirectTransport picks [20000, 36000)
            assert flag(argv, "--tensor-parallel-size") == ("16" if role == "prefill" else "4")
            assert "--enable-expert-parallel" in argv
            env = launch.env
            for var in ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
                        "HCCL_BUFFSIZE", "HCCL_OP_EXPANSION_MODE"):
                assert var in env, var
            assert any("LD_LIBRARY_PATH=/usr/local/lib" in s for s in launch.setup)
    assert seen == {json.dumps({"prefill": {"dp_size": 2, "tp_size": 16}, "decode": {"dp_size": 16, "tp_size": 4}},
                               sort_keys=True)}


def test_kv_port_follows_the_npus_a_node():
    a2 = make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "ascend910b", 8, concurrency=64), prefill_nodes=4,
                                decode_nodes=4))
    assert a2.prefill.recipe == "vllm-ascend-glm52-a2"
    assert a2.prefill.layout == Layout(8, 4, 32, 1) and a2.decode.layout == Layout(4, 8, 32, 1)
    cfg = json.loads(flag(argv_of(role_launches(a2, "decode")[0]), "--kv-transfer-config"))
    assert cfg["kv_port"] == "28000"


def test_vllm_ascend_router_is_its_proxy(recipe):
    argv = router_launch(recipe, "10.0.0.1", "10.0.0.3").argv
    assert argv[1].endswith("examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py")
    assert flag(argv, "--prefiller-hosts") == "10.0.0.1" and flag(argv, "--prefiller-ports") == "8100"
    assert flag(argv, "--decoder-hosts") == "10.0.0.3" and flag(argv, "--decoder-ports") == "8200"


@pytest.fixture(scope="module")
def h200_vllm():
    return make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, nodes=3, concurrency=64, engine="vllm"),
                                  input_len=10000, output_len=1000))


def test_vllm_nixl_launches_and_router(h200_vllm):
    p = h200_vllm
    assert p.connector == "nixl" and p.prefill.nodes + p.decode.nodes == 3
    # glm5_next is hybrid (KDA state): NIXL needs the same TP on both sides
    assert p.prefill.layout.tp == p.decode.layout.tp
    assert p.prefill.layout.pp == p.decode.layout.pp == 1
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        for launch in role_launches(p, role):
            argv = argv_of(launch)
            assert json.loads(flag(argv, "--kv-transfer-config")) == {"kv_connector": "NixlConnector",
                                                                      "kv_role": kv_role}
            assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$NODE_IP"
            assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
            assert flag(argv, "--port") == ("8100" if role == "prefill" else "8200")
            assert ': "${NODE_IP:?' in launch.shell()
    argv = router_launch(p, "p0", "d0").argv
    assert argv[:2] == ["vllm-router", "--vllm-pd-disaggregation"]
    assert argv[argv.index("--prefill") + 1:argv.index("--prefill") + 3] == ["http://p0:8100", "none"]
    assert flag(argv, "--decode") == "http://d0:8200" and flag(argv, "--kv-connector") == "nixl"
    assert p.ratio > 0 and ":" in p.ratio_text()


def test_vllm_mooncake_sets_the_bootstrap_port():
    p = make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, concurrency=64, engine="vllm"),
                               prefill_nodes=1, decode_nodes=2, connector="mooncake"))
    launch = role_launches(p, "prefill")[0]
    assert json.loads(flag(argv_of(launch), "--kv-transfer-config"))["kv_connector"] == "MooncakeConnector"
    assert launch.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"
    argv = router_launch(p, "p0", "d0").argv
    assert argv[argv.index("--prefill") + 2] == "8998" and flag(argv, "--kv-connector") == "mooncake"
    assert p.prefill.layout.tp == p.decode.layout.tp  # MooncakeConnector: the same TP on both sides (llm-d)


@pytest.mark.parametrize("chip,backend_connector", [("h200", "mooncake"), ("ascend910c", "ascend")])
def test_sglang_disaggregation_flags_and_router(chip, backend_connector):
    devices = 16 if chip == "ascend910c" else 8
    p = make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", chip, devices, concurrency=64, engine="sglang"),
                               prefill_nodes=2, decode_nodes=2))
    assert p.connector == backend_connector
    for role in ("prefill", "decode"):
        for launch in role_launches(p, role):
            argv = argv_of(launch)
            assert flag(argv, "--disaggregation-mode") == role
            assert flag(argv, "--disaggregation-transfer-backend") == backend_connector
            assert (flag(argv, "--disaggregation-bootstrap-port") == "8998") if role == "prefill" \
                else "--disaggregation-bootstrap-port" not in argv
    argv = router_launch(p, "p0", "d0").argv
    assert argv[:5] == ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill"]
    assert argv[5:7] == ["http://p0:8100", "8998"] and flag(argv, "--decode") == "http://d0:8200"


# ---- when PD does not pay -----------------------------------------------------------------------------------


def reasons(p) -> str:
    assert not p.verdict.pays
    return "\n".join(p.verdict.reasons)


def test_small_model_short_prompts_one_node_do_not_pay():
    p = make_pd_plan(PDRequest(PlanRequest("smollm2-135m-instruct", "h200", 8, concurrency=4, engine="vllm"),
                               input_len=128, output_len=128))
    text = reasons(p)
    for word in ("one node", "short prompts", "low concurrency", "small model"):
        assert word in text
    # the roles share the node: the decode role takes the devices after prefill's
    pre, dec = role_launches(p, "prefill")[0], role_launches(p, "decode")[0]
    first = [int(d) for d in dec.env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert first[0] == p.prefill.devices and len(first) == p.decode.devices
    assert pre.env["CUDA_VISIBLE_DEVICES"].split(",")[0] == "0"
    assert script(p).startswith("# warning: PD does not pay here")


def test_a_slow_kv_fabric_does_not_pay(recipe):
    slow = make_pd_plan(glm5_a3(kv_interconnect="tcp"))
    assert "slow KV fabric" in reasons(slow) and "tcp" in reasons(slow)
    assert slow.transfer_ms > recipe.transfer_ms
    assert recipe.link == "roce"


def test_short_prompts_alone_are_named(recipe):
    p = make_pd_plan(glm5_a3(input_len=512, output_len=512))
    assert reasons(p).startswith("short prompts")


def test_the_recipe_split_comes_out_of_its_total_nodes():
    p = make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=6, concurrency=64)))
    assert (p.prefill.nodes, p.decode.nodes) == (2, 4)
    assert p.prefill.layout == Layout(16, 2, 32, 1) and p.decode.layout == Layout(4, 16, 64, 1)


def test_the_planner_splits_nodes_when_not_told(h200_vllm):
    p = h200_vllm
    assert p.prefill.nodes >= 1 and p.decode.nodes >= 1
    assert p.prefill.plan.chosen and p.decode.plan.chosen


def test_errors_say_what_to_do():
    base = PlanRequest("glm-5.3-flash", "h200", 8, concurrency=64)
    with pytest.raises(PlanInputError, match="max-model-len"):
        make_pd_plan(PDRequest(base, input_len=30000, output_len=4000, prefill_nodes=1, decode_nodes=1))
    with pytest.raises(PlanInputError, match="prefill-decode"):
        make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, engine="mindie")))
    with pytest.raises(PlanInputError, match="nixl"):
        make_pd_plan(PDRequest(PlanRequest("glm-5.3-flash", "h200", 8, engine="vllm"), connector="ascend",
                               prefill_nodes=1, decode_nodes=1))
    with pytest.raises(PlanInputError, match="--decode-devices"):
        make_pd_plan(PDRequest(PlanRequest("smollm2-135m-instruct", "h200", 8), prefill_devices=5, decode_devices=5))


def test_engine_pd_data_has_sources():
    data = pd_data()
    for engine, spec in data["engines"].items():
        assert spec["router"]["source"], engine
        for name, conn in spec["connectors"].items():
            assert conn["source"], (engine, name)
    for r in data["recipes"]:
        assert r["source"] and r["prefill"]["nodes"] and r["decode"]["nodes"]


# ---- the command ----------------------------------------------------------------------------------------------


def test_cli_plan_pd_table_json_and_emit():
    args = ["plan", "--model", "glm-5.3-flash", "--chip", "ascend910c", "--pd", "--prefill-nodes", "2",
            "--decode-nodes", "4", "--concurrency", "64"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "tp=16,dp=2,ep=32,pp=1" in r.output and "tp=4,dp=16,ep=64,pp=1" in r.output
    assert "P:D ratio" in r.output and "verdict: PD pays" in r.output
    r = CliRunner().invoke(main, args + ["--json"])
    data = json.loads(r.output)
    assert data["roles"]["prefill"]["chosen"]["tp"] == 16 and data["roles"]["decode"]["chosen"]["dp"] == 16
    assert data["pays"] is True and data["reasons"] == []
    r = CliRunner().invoke(main, args + ["--emit", "vllm-ascend"])
    assert r.exit_code == 0, r.output
    assert r.output.count("# prefill (node") == 2 and r.output.count("# decode (node") == 4
    assert "# router" in r.output and "MooncakeConnectorV1" in r.output


def test_cli_nothing_fits_exits_1_with_the_suggestions():
    r = CliRunner().invoke(main, ["plan", "--model", "glm-5.3-flash", "--chip", "l20", "--pd", "--prefill-nodes", "1",
                                  "--decode-nodes", "1"])
    assert r.exit_code == 1 and "prefill: 1 node(s) x 8 l20: nothing fits" in r.output
    assert "more devices" in r.output and "verdict" not in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "glm-5.3-flash", "--chip", "l20", "--pd", "--prefill-nodes", "1",
                                  "--decode-nodes", "1", "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["ratio_text"] == "n/a"


def test_cli_pd_flags_need_pd():
    r = CliRunner().invoke(main, ["plan", "--model", "glm-5.3-flash", "--chip", "h200", "--input-len", "100"])
    assert r.exit_code != 0 and "add --pd" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "glm-5.3-flash", "--chip", "h200", "--pd", "--emit", "profile"])
    assert r.exit_code != 0 and "--pd emits" in r.output


def test_uneven_experts_only_for_engines_that_split_them():
    """288 experts over EP 64: vLLM gives the first ranks one more (engines.yaml layouts.uneven_experts); a plan for
    no engine in particular keeps the even split and says which engines do it."""
    from flagdeploy.planner import make_plan

    lay = Layout(4, 16, 64, 1)
    strict = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=4, concurrency=64, layout=lay))
    assert strict.chosen is None and "do not divide by EP 64" in strict.rejected[0].reason
    assert "vllm" in strict.rejected[0].reason
    loose = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=4, concurrency=64, layout=lay,
                                  engine="vllm-ascend"))
    assert loose.chosen is not None
    even = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, nodes=2, concurrency=64,
                                 layout=Layout(16, 2, 32, 1), engine="vllm-ascend"))
    # the fullest rank holds ceil(288 / 64) = 5 experts' worth, more than 288 / 64
    assert loose.chosen.memory.weights > 0 and even.chosen is not None
