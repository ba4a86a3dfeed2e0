"""`flagdeploy plan`: the ledger against real checkpoints and our engine's allocations, the cost model's
known behaviours, the search's rejections and suggestions, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flagdeploy.errors import UnknownChipError
from flagdeploy.loaders.tiny_checkpoint import write_tiny_glm5_next
from flagdeploy.planner import Layout, PlanRequest, make_plan
from flagdeploy.planner.ledger import cache_shape, load_config, weight_groups
from flagdeploy.planner.report import to_json
from flagdeploy.planner.shapes import parameter_count

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama70b")
    (d / "config.json").write_text(json.dumps(LLAMA_70B))
    return str(d)


def _index_total(path: Path) -> int:
    return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


# ---- the ledger ----------------------------------------------------------------------------------------


def test_glm_5_3_flash_preset_matches_the_published_checkpoint():
    """Parameters by the model's own config, bytes by its stated dtypes: the published checkpoint's
    index says 328,326,771,576 bytes (with its MTP layer); the ledger lands on that byte."""
    _, config = load_config("glm-5.3-flash")
    groups = weight_groups(config, include_mtp=True)
    assert sum(g.bytes for g in groups) == 328_326_771_576
    assert sum(g.params for g in groups) == parameter_count(config, include_mtp=True)
    no_mtp = sum(g.params for g in weight_groups(config))
    assert 313e9 < no_mtp < 315e9  # "320B" on the model card counts the MTP layer and rounds up
    dtypes = {g.family: g.dtype for g in groups if g.layer == 4}
    assert dtypes["experts"] == "fp8" and dtypes["router"] in ("bf16", "fp32") and dtypes["linear_attention"] in ("bf16", "fp32")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ledger_bytes_equal_a_written_checkpoint(tmp_path, fp8):
    src = write_tiny_glm5_next(tmp_path / "ckpt", fp8=fp8)
    config = json.loads((src / "config.json").read_text())
    assert sum(g.bytes for g in weight_groups(config)) == _index_total(src)


def test_ledger_bytes_of_a_policy_equal_the_converted_checkpoint(tmp_path):
    from flagdeploy.quantize import load_policy, quantize

    src = write_tiny_glm5_next(tmp_path / "fp8", fp8=True)
    quantize(src, tmp_path / "int8", chip="ascend910c", progress=False)
    planned = weight_groups(json.loads((src / "config.json").read_text()), policy=load_policy("no-fp8"))
    assert sum(g.bytes for g in planned) == _index_total(tmp_path / "int8")
    converted = weight_groups(json.loads((tmp_path / "int8" / "config.json").read_text()))
    assert sum(g.bytes for g in converted) == _index_total(tmp_path / "int8")


def test_kv_and_state_agree_with_our_engine(tmp_path):
    """KV bytes per token as our engine's block pools allocate them, KDA state as our model keeps it."""
    from flagdeploy.engine.loader import load_model
    from flagdeploy.engine.model_runner import PagedRunner
    from flagdeploy.models import build_model, config_from_hf

    llama = {**LLAMA_70B, "num_hidden_layers": 3, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": 300}
    model = build_model(config_from_hf(llama), torch.float32, "meta")
    assert cache_shape(llama).kv_bytes_per_token(4) == PagedRunner.bytes_per_block(model, 16) // 16

    src = write_tiny_glm5_next(tmp_path / "glm")
    config = json.loads((src / "config.json").read_text())
    glm, _ = load_model(src, "safetensors", torch.float32, "cpu", progress=False)
    shape = cache_shape(config)
    assert shape.kv_bytes_per_token(4) == glm.cache_bytes_per_token()
    cache = glm.new_cache()
    glm.forward(torch.tensor([3, 4, 5]), cache)
    states = [s for s in cache.layers if hasattr(s, "recurrent")]
    held = sum(s.recurrent.numel() * s.recurrent.element_size() + s.conv.numel() * s.conv.element_size() for s in states)
    assert shape.state_bytes_per_sequence(4) == held == glm.state_bytes_per_seq()


# ---- the cost model -------------------------------------------------------------------------------------


def _one(model, chip, devices, layout, **kw):
    plan = make_plan(PlanRequest(model, chip, devices, layout=layout, **kw))
    assert plan.chosen is not None, plan.rejected
    return plan.chosen


def test_pcie_box_prefers_narrow_tp_with_dp(llama70b):
    """8 devices on PCIe, a model that fits in TP4: TP8 spends its decode step in slow all-reduces."""
    kw = dict(interconnect="pcie", max_model_len=8192, concurrency=64)
    tp8 = _one(llama70b, "h20", 8, Layout(tp=8), **kw)
    tp4dp2 = _one(llama70b, "h20", 8, Layout(tp=4, dp=2), **kw)
    assert tp4dp2.decode_tokens_s > tp8.decode_tokens_s
    # and the search itself picks a DP layout there
    best = make_plan(PlanRequest(llama70b, "h20", 8, **kw)).chosen
    assert best.layout.dp > 1 and best.layout.tp < 8


@pytest.mark.parametrize("chip", ["h100", "ascend910b"])
def test_fast_links_give_tp8_the_lower_latency(llama70b, chip):
    kw = dict(max_model_len=8192, concurrency=1, objective="latency")
    tp8 = _one(llama70b, chip, 8, Layout(tp=8), **kw)
    tp4 = _one(llama70b, chip, 4, Layout(tp=4), **kw)
    assert tp8.token_latency_ms < tp4.token_latency_ms


# ---- the search --------------------------------------------------------------------------------------------


def test_explicit_layout_is_evaluated_or_explained(llama70b):
    plan = make_plan(PlanRequest(llama70b, "h100", 8, layout=Layout(tp=8, dp=1), max_model_len=4096))
    assert plan.chosen.layout == Layout(tp=8) and not plan.rejected
    plan = make_plan(PlanRequest(llama70b, "h100", 8, layout=Layout(tp=1, dp=8), max_model_len=4096))
    assert plan.chosen is None and "does not fit" in plan.rejected[0].reason
    plan = make_plan(PlanRequest("glm-5.3-flash", "h200", 8, layout=Layout(tp=8, dp=1, ep=8), max_model_len=4096))
    assert plan.chosen is not None
    plan = make_plan(PlanRequest(llama70b, "h100", 6, layout=Layout(tp=6), max_model_len=4096))
    assert "64 attention heads do not divide by TP 6" in plan.rejected[0].reason


def test_glm_on_910c_is_planned_converted_and_split_by_experts():
    plan = make_plan(PlanRequest("glm-5.3-flash", "ascend910c", 16, max_model_len=131072, concurrency=32))
    assert any("no-fp8" in n for n in plan.notes)
    assert {g.dtype for g in plan.groups if g.family == "experts"} == {"int8"}
    assert plan.chosen.layout.ep > 1 and plan.chosen.memory.free >= 0
    out = to_json(plan)
    assert set(out["chosen"]["per_device_bytes"]) >= {"weights", "kv_cache", "linear_state", "reserve", "free"}
    assert out["alternatives"] and all("reason" in r for r in out["rejected"])
    # the MLA latent has no head axis: wider TP does not shrink the KV cache per device
    kv = {e.layout.tp: e.memory.kv_cache for e in [plan.chosen, *plan.alternatives] if e.layout.dp * e.layout.tp == 16}
    assert len(set(v // t for t, v in kv.items())) <= len(kv)


def test_nothing_fits_says_by_how_much_and_what_would(llama70b):
    plan = make_plan(PlanRequest("glm-5.3-flash", "ascend910b4", 8, nodes=2, max_model_len=1048576, concurrency=8))
    assert plan.chosen is None
    text = "\n".join(plan.suggestions)
    assert "short by" in text and "more devices" in text and "--max-model-len" in text
    plan = make_plan(PlanRequest("glm-5.3-flash", "ascend910b4", 8, max_model_len=4096, concurrency=1))
    assert "the weights alone need" in "\n".join(plan.suggestions)
    # a BF16 model on int8-capable chips also hears about a quantize policy
    plan = make_plan(PlanRequest(llama70b, "ascend910b4", 4, max_model_len=4096, concurrency=1))
    assert plan.chosen is None and any("quantize --policy no-fp8" in s for s in plan.suggestions)


def test_unknown_chip_lists_the_known_ones():
    with pytest.raises(UnknownChipError, match="ascend910c.*h200"):
        make_plan(PlanRequest("glm-5.3-flash", "ascend910x", 8))


# ---- the command line ---------------------------------------------------------------------------------------


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "flagdeploy.cli", "plan", *args], capture_output=True, text=True, timeout=120)


def test_cli_json_and_emit():
    r = _plan("--model", "glm-5.3-flash", "--chip", "h200", "--devices", "8", "--max-model-len", "65536", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"tp", "dp", "ep", "pp", "decode_tokens_s", "per_device_bytes"} <= set(out["chosen"])
    r = _plan("--model", "glm-5.3-flash", "--chip", "ascend950", "--devices", "8", "--layout", "tp=8", "--emit", "vllm")
    assert r.returncode == 0, r.stderr
    assert "--tensor-parallel-size 8" in r.stdout and "--block-size 512" in r.stdout and "--quantization" not in r.stdout
    r = _plan("--model", "glm-5.3-flash", "--chip", "ascend910b4", "--devices", "8", "--max-model-len", "1048576")
    assert r.returncode == 1 and "nothing fits" in r.stdout and "short by" in r.stdout


# ---- serve and the planner --------------------------------------------------------------------------------


def test_serve_prints_the_plan_and_runs_a_profile(tmp_path, default_model):
    """No profile: serve prints the planner's ledger line. A profile from `plan --emit profile` sets the
    serve options, its tensor-parallel split included (a worker process beside the server); a profile
    with pipeline stages is refused with what to do instead."""
    from test_cli import _free_port, _serve, wait_ready

    import httpx

    src = write_tiny_glm5_next(tmp_path / "glm")
    r = _plan("--model", str(src), "--chip", "cpu", "--devices", "1", "--max-model-len", "512", "--concurrency", "3",
              "--emit", "profile")
    assert r.returncode == 0, r.stderr
    port = _free_port()
    profile = tmp_path / "p.yaml"
    profile.write_text(r.stdout.replace("port: 8000", f"port: {port}").replace("tp: 1", "tp: 2"))
    proc = _serve("--profile", str(profile))
    try:
        url = wait_ready(proc, port)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert model["max_model_len"] == 512
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ranks = [w for w in workers if "spawn_main" in Path(f"/proc/{w}/cmdline").read_text()]
        assert len(ranks) == 1, "tp: 2 in the profile starts the second rank beside the server"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    staged = tmp_path / "staged.yaml"
    staged.write_text(r.stdout.replace("pp: 1", "pp: 2"))
    out = subprocess.run([sys.executable, "-m", "flagdeploy.cli", "serve", "--profile", str(staged)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "pp=2" in out.stderr and "--emit" in out.stderr
    port = _free_port()
    proc = _serve("--port", str(port), "--max-model-len", "1024")
    try:
        wait_ready(proc, port)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "plan: smollm2-135m-instruct: 0.13B params" in err and "KiB/token" in err


def test_unknown_decoder_gets_a_generic_estimate(tmp_path):
    """A DeepSeek-V3-like MoE config the shape table does not know: estimated, and the plan says so."""
    cfg = {"model_type": "some_new_moe", "hidden_size": 2048, "intermediate_size": 8192, "moe_intermediate_size": 1024,
           "num_hidden_layers": 8, "num_attention_heads": 16, "vocab_size": 32000, "n_routed_experts": 16,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1}
    plan = make_plan(PlanRequest("new-moe", "h100", 2, config=cfg, max_model_len=4096))
    assert any("estimated" in n for n in plan.notes) and plan.chosen is not None
    experts = sum(g.params for g in plan.groups if g.family == "experts")
    assert experts == 7 * 16 * 3 * 2048 * 1024  # 7 MoE layers after one dense one
    with pytest.raises(ValueError, match="intermediate_size"):
        make_plan(PlanRequest("bad", "h100", 2, config={"model_type": "mystery", "hidden_size": 8}))
