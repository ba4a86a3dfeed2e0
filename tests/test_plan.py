"""`flagdeploy plan`: the ledger against real checkpoints and our engine's allocations, the cost model's
known behaviours, the search's rejections and suggestions, and the command line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flagdeploy.errors import UnknownChipError
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next
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
    from flagdeploy.engine.replica import load_model
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
    # a profile planned for an external engine is not run by the builtin one: the refusal names the command
    import dataclasses

    from flagdeploy.planner import Profile

    dataclasses.replace(Profile.load(profile), engine="vllm").save(staged)
    out = subprocess.run([sys.executable, "-m", "flagdeploy.cli", "serve", "--profile", str(staged)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and f"serve --profile {staged} --engine vllm" in out.stderr
    port = _free_port()
    proc = _serve("--port", str(port), "--max-model-len", "1024")
    try:
        wait_ready(proc, port)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "plan: smollm2-135m-instruct: 0.13B params" in err and "KiB/token" in err
    # the weights as held, after loading: Q4 blocks, the dense copy for prompts where the CPU's tune table keeps
    # one (bf16 or fp32 by its dtype), the int8 head; not "0.50 GiB (fp32)"
    plan_line = next(line for line in err.splitlines() if "plan: " in line)
    held = next(line for line in err.splitlines() if "weights held on cpu: " in line)
    assert "fp32" not in plan_line and "q4 blocks" in held and "int8" in held
    copy = _dense_copy_name()
    assert (f"{copy} copy (many-row steps)" in held) if copy else "copy" not in held


def _dense_copy_name() -> str | None:
    """What the held-weights line calls the cpu backend's dense copy on this CPU (its tune table's dtype); None
    where the table keeps none beside the backend's own kernels (`dense_copy: false`)."""
    from flagdeploy.backends.cpu import native
    from flagdeploy.backends.cpu import ops as cpu_ops

    if native.available() and not cpu_ops.TUNE["linear_w4a16"]["dense_copy"]:
        return None
    return {"bfloat16": "bf16", "float32": "fp32"}[cpu_ops.TUNE["weight_only_dense"]["dtype"]]


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


# ---- plans that reproduce real deployments (issue 32) -----------------------------------------------------

GIB = 1 << 30
DAY_ONE = PlanRequest("glm-5.3-flash", "h20-141g", 4, layout=Layout(tp=4, ep=4), max_model_len=1_048_576, concurrency=1)


def test_the_4x_h20_141g_day_one_deployment_fits():
    """The seeds' SGLang setup on 4x H20 (docs/glm-5.3-flash.md): FP8 weights at TP4 + EP4, BF16 KV over a
    1,048,576-token context. The figures are the ledger's own, not tuned to fit: ~75.8 GiB of weights per
    card (the report says 75-78), and per token the MLA latent (512) and the DSA indexer rows (2 x 128) of
    each of the 11 indexed layers, in BF16, on every card (they have no head axis for TP to split)."""
    plan = make_plan(DAY_ONE)
    assert plan.chosen is not None and plan.chosen.layout == Layout(tp=4, ep=4)
    m = plan.chosen.memory
    assert 75 * GIB < m.weights < 78 * GIB
    assert plan.cache.kv_bytes_per_token(2) == 11 * (512 + 2 * 128) * 2
    assert m.kv_cache == 11 * (512 + 2 * 128) * 2 * 1_048_576  # 16.5 GiB
    assert m.capacity == int(140.4 * GIB * 0.9) and m.free > 0
    # the catalog's only H20 was the 96 GB one, on which this plan says nothing fits
    assert make_plan(replace(DAY_ONE, chip="h20")).chosen is None
    r = _plan("--model", "glm-5.3-flash", "--chip", "h20-141g", "--devices", "4", "--layout", "tp=4,ep=4",
              "--max-model-len", "1048576", "--concurrency", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-> tp=4,dp=1,ep=4,pp=1" in r.stdout and "h20-141g (140.4 GiB, 90% of it usable" in r.stdout


def test_gpu_memory_utilization_bounds_the_plan_and_reaches_the_engines():
    short = make_plan(replace(DAY_ONE, memory_utilization=0.6))
    assert short.chosen is None and "has 84.2 GiB" in short.rejected[0].reason  # 140.4 GiB x 0.6
    args = ("--model", "glm-5.3-flash", "--chip", "h20-141g", "--devices", "4", "--layout", "tp=4,ep=4",
            "--max-model-len", "1048576", "--concurrency", "1", "--gpu-memory-utilization", "0.85")
    assert "--gpu-memory-utilization 0.85" in _plan(*args, "--emit", "vllm").stdout
    assert "--mem-fraction-static 0.85" in _plan(*args, "--emit", "sglang").stdout
    assert "memory_utilization: 0.85" in _plan(*args, "--emit", "profile").stdout
    r = _plan(*args[:-1], "1.5")
    assert r.returncode == 2 and "--gpu-memory-utilization" in r.stderr


def test_a_context_that_does_not_fit_says_the_largest_concurrency_and_the_shortest_context():
    """Eight sequences of 1M tokens do not fit on 4x H20 141 GB; the plan names both ways out, and both are the
    edge: at them it fits, one step further it does not."""
    req = replace(DAY_ONE, concurrency=8)
    plan = make_plan(req)
    assert plan.chosen is None
    most, longest = plan.fits_at["max_concurrency"], plan.fits_at["max_model_len"]
    text = "\n".join(plan.suggestions)
    assert f"fewer sequences: --concurrency {most} fits at --max-model-len 1048576" in text
    assert f"a shorter context: --max-model-len {longest} fits at --concurrency 8" in text
    assert most == 2  # (126.4 GiB usable - 75.8 weights - 3 activations and reserve) / 16.5 GiB per sequence
    assert make_plan(replace(req, concurrency=most)).chosen and not make_plan(replace(req, concurrency=most + 1)).chosen
    assert make_plan(replace(req, max_model_len=longest)).chosen
    assert not make_plan(replace(req, max_model_len=longest + 256)).chosen
    assert to_json(plan)["fits_at"] == {"max_concurrency": 2, "max_model_len": longest}
    # on the 96 GB H20 not even one 1M-token sequence fits: said as such, beside the shorter context
    small = make_plan(replace(req, chip="h20"))
    assert small.fits_at["max_concurrency"] is None
    assert any("not even one of --max-model-len 1048576 tokens fits" in x for x in small.suggestions)


def test_serve_reports_the_weights_the_backend_holds(default_model):
    """The default model as the cpu backend holds it (weight format auto): its GGUF's Q4_1 blocks (20 bytes
    per 32 weights, however the backend packs them), where the tune table keeps one a dense copy of every quantized
    linear for prompt steps (bf16 on a CPU with bf16 matmuls), the head re-stored as int8 with a scale per row (float32
    for the backend's own int8 kernel, bf16 for torch's; and its dense copy), the fp32 embedding and norms.
    The line adds up to those bytes, not to the checkpoint's dequantised 0.50 GiB."""
    from conftest import make_engine

    from flagdeploy.planner.held import held_line, held_weights

    engine = make_engine(default_model, "auto", kv_cache_memory=64 << 20)
    cfg = engine.model.cfg
    h, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    d = cfg.head_dim
    linear = layers * (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size)
    held = held_weights(engine.model)
    assert held["q4 blocks"] == linear * 20 // 32
    own_int8 = "w8" in engine.model.lm_head.qweight.prepared
    assert held["int8"] == v * h + v * (4 if own_int8 else 2)
    name, copies = _dense_copy_name(), {}
    if name:  # where the tune table keeps a dense copy (oneDNN's layout may pad it)
        copies[f"{name} copy"] = (linear + v * h) * {"bf16": 2, "fp32": 4}[name]
    for copy, size in copies.items():
        assert held[copy] == pytest.approx(size, rel=0.01)
    assert held["fp32"] == (v * h + (2 * layers + 1) * h) * 4
    assert set(held) == {"q4 blocks", "int8", "fp32", *copies}
    line = held_line(held, "cpu")
    assert line.startswith(f"weights held on cpu: {sum(held.values()) / GIB:.2f} GiB = ") and "q4 blocks 0.06" in line


def test_held_weights_count_each_form_and_each_storage_once():
    """A dequantised copy kept beside the packed form is a copy; kept alone (the cuda backend's) it is that
    format's weight; a tied head counts once; a table derived at start-up (RoPE) is not a weight."""
    from torch import nn

    from flagdeploy.models.linear import Linear
    from flagdeploy.ops.weights import Int4Weight, stripped
    from flagdeploy.planner.held import held_weights

    w = Int4Weight(torch.zeros(64, 32, dtype=torch.uint8), torch.ones(64, 1), torch.zeros(64, 1), 32, 64, 32)
    m = nn.Module()
    m.alone, m.beside, m.head = (Linear(64, 32, torch.float32, (p,)) for p in "abh")
    m.alone.qweight = stripped(w, dense=torch.zeros(64, 32, dtype=torch.bfloat16))
    m.beside.qweight = stripped(w, nib=torch.zeros(64, 16, dtype=torch.uint8), dense=torch.zeros(64, 32, dtype=torch.bfloat16))
    m.embed = nn.Parameter(torch.zeros(10, 32), requires_grad=False)
    m.head.weight = m.embed
    m.rope_cos = torch.zeros(1000)
    assert held_weights(m) == {"bf16 from q4 blocks": 64 * 32 * 2, "bf16 copy": 64 * 32 * 2, "q4 blocks": 64 * 16,
                               "fp32": 10 * 32 * 4}


def test_a_hosts_own_memory_replaces_the_catalogs_nominal_figure(llama70b):
    """`serve` on a CPU plans in the machine's RAM, not the catalog's nominal 256 GiB."""
    nominal = make_plan(PlanRequest(llama70b, "cpu", 1, max_model_len=4096, concurrency=1))
    small = make_plan(PlanRequest(llama70b, "cpu", 1, max_model_len=4096, concurrency=1, memory_gib=24))
    assert nominal.chip.memory_gib == 256 and small.chip.memory_gib == 24
    assert nominal.chosen is not None and small.chosen is None  # 70B does not fit 24 GiB


# ---- speculative decoding with the MTP layer (issue 29) -------------------------------------------------------

MTP_BASE = PlanRequest("glm-5.3-flash", "h200", 8, layout=Layout(tp=8), max_model_len=131072, concurrency=32)


def test_mtp_adds_its_own_ledger_lines_that_sum_to_the_device_memory():
    """--mtp (K=3) against the same plan without it: the MTP layer's weights, its own cache per token (one more
    MLA latent plus one more full DSA indexer's key and gate rows, from the config like the main layers') and K
    more KDA states per sequence (K+1 slots in all); each its own line, the lines adding up to what is used."""
    from flagdeploy.models.glm5_next import from_hf_config
    from flagdeploy.planner.cost import is_draft_layer
    from flagdeploy.planner.report import memory_lines, table

    _, config = load_config("glm-5.3-flash")
    c = from_hf_config(config)
    shape = cache_shape(config, include_mtp=True)
    assert not cache_shape(config).has_draft_layer and shape.kv_bytes_per_token(2) == cache_shape(config).kv_bytes_per_token(2)
    full = next(i for i, (lt, kind) in enumerate(zip(c.layer_types, c.indexer_types))
                if lt == "indexed_attention" and kind == "full")
    one_layer = (shape.dense[full] + shape.sparse[full]) * 2
    assert shape.draft_kv_bytes_per_token(2) == one_layer == (c.kv_lora_rank + 2 * c.index_head_dim) * 2  # 1,536 B
    assert round(shape.state_bytes_per_sequence(2) / 2**20, 2) == 140.78  # KDA state per sequence, before TP

    plain, spec = make_plan(MTP_BASE), make_plan(replace(MTP_BASE, mtp=True))
    m0, m = plain.chosen.memory, spec.chosen.memory
    tokens = 32 * 131072
    assert m.kv_cache == m0.kv_cache and m.linear_state == m0.linear_state and m0.mtp_kv_cache == m0.draft_state == 0
    assert m.draft_state == 3 * m.linear_state  # KDA split by TP 8: 3 x 17.6 MiB per sequence
    assert m.mtp_kv_cache == one_layer * tokens  # no head axis: TP does not split it
    mtp_weights = sum(g.bytes for g in spec.groups if is_draft_layer(g, c.num_layers))
    assert 6 * GIB < mtp_weights < 8 * GIB and m.weights - m0.weights == m.mtp_weights > 0
    assert m.used - m0.used == m.mtp_weights + m.mtp_kv_cache + m.draft_state

    lines = {item.strip(): n for item, _, n in memory_lines(spec)}
    assert lines["MTP layer KV (per token)"] == m.mtp_kv_cache
    assert lines["KDA draft-state slots (3 x per seq)"] == m.draft_state
    assert lines["of which MTP layer weights"] == m.mtp_weights
    assert sum(n for item, n in lines.items() if item not in ("of which MTP layer weights", "free")) == m.used
    assert lines["free"] == m.free == m.capacity - m.used
    assert "MTP layer KV" not in table(plain) and "KDA draft-state slots" not in table(plain)
    text = table(spec)
    assert "MTP layer KV (per token)" in text and "KDA draft-state slots (3 x per seq)" in text
    spec_json = to_json(spec)["ledger"]["speculative"]
    assert spec_json["mtp_kv_bytes_per_token"] == one_layer
    assert spec_json["draft_state_bytes_per_sequence"] == 3 * shape.state_bytes_per_sequence(2)
    assert to_json(plain)["ledger"]["speculative"] is None
    k1 = make_plan(replace(MTP_BASE, mtp=True, num_speculative_tokens=1)).chosen.memory
    assert k1.draft_state == m.linear_state and k1.mtp_kv_cache == m.mtp_kv_cache


def test_mtp_fits_fewer_sequences_on_the_same_chip():
    spec = make_plan(replace(MTP_BASE, mtp=True))
    plain = make_plan(MTP_BASE)
    assert spec.max_sequences < plain.max_sequences == spec.max_sequences_without_mtp
    assert to_json(spec)["max_sequences"] == spec.max_sequences
    # the edge: the most sequences fit, one more does not, with MTP; without it that one more fits
    edge = replace(MTP_BASE, concurrency=spec.max_sequences)
    assert make_plan(replace(edge, mtp=True)).chosen
    assert not make_plan(replace(edge, mtp=True, concurrency=spec.max_sequences + 1)).chosen
    assert make_plan(replace(edge, concurrency=spec.max_sequences + 1)).chosen
    # when nothing fits, the largest --concurrency is smaller with MTP too
    over = replace(MTP_BASE, concurrency=2 * plain.max_sequences)
    assert make_plan(replace(over, mtp=True)).fits_at["max_concurrency"] < make_plan(over).fits_at["max_concurrency"]


def test_mtp_cost_model_acceptance_length_and_verify_rows():
    """The acceptance length is a stated figure (GLM-5 family AL 2.99 at K=3), scaled for other K; verifying K+1
    rows costs about one step while decode is weight-bound and more once it is compute-bound."""
    from flagdeploy.planner import PlanInputError
    from flagdeploy.planner.cost import acceptance_length

    assert acceptance_length(3) == pytest.approx(2.99, abs=1e-6)
    als = [acceptance_length(k) for k in range(1, 8)]
    assert all(a < b for a, b in itertools.pairwise(als)) and all(al <= k + 1 for k, al in enumerate(als, 1))
    assert 1.7 < als[0] < 1.9 and als[-1] < 5.3

    def speedup(concurrency, **kw):
        req = replace(MTP_BASE, max_model_len=4096, concurrency=concurrency)
        return make_plan(replace(req, mtp=True, **kw)).chosen.decode_tokens_s / make_plan(req).chosen.decode_tokens_s

    small, large = speedup(1), speedup(512)
    assert 2.0 < small < 2.99  # AL 2.99 per round, a verify step of 4 rows ~ one step, plus 3 draft steps
    assert large < small
    assert speedup(1, acceptance_length=2.0) < small  # a measured, lower AL is used as given
    with pytest.raises(PlanInputError, match="K\\+1 = 4"):
        make_plan(replace(MTP_BASE, mtp=True, acceptance_length=4.5))


def test_mtp_rejects_dp_attention_layouts():
    """The engines turn MTP off under DP attention (engines.yaml no-mtp-with-dp-attention): with --mtp the
    planner does not choose such a layout."""
    plan = make_plan(replace(MTP_BASE, layout=None, mtp=True))
    assert not (plan.chosen.layout.dp > 1 and plan.chosen.layout.ep > 1)
    assert any(r.reason.startswith("--mtp: DP attention") for r in plan.rejected)


def test_cli_mtp_k_reaches_the_profile_and_the_engines(tmp_path):
    from click.testing import CliRunner

    from flagdeploy.cli import main
    from flagdeploy.planner.emit import emit
    from flagdeploy.planner.profile import Profile

    args = ["plan", "--model", "glm-5.3-flash", "--chip", "h200", "--devices", "8", "--layout", "tp=8",
            "--max-model-len", "65536", "--mtp", "--num-speculative-tokens", "2"]
    run = CliRunner().invoke(main, [*args, "--emit", "profile"])
    assert run.exit_code == 0, run.output
    path = tmp_path / "p.yaml"
    path.write_text(run.output)
    profile = Profile.load(path)
    assert profile.mtp and profile.num_speculative_tokens == 2
    argv = emit(profile, "vllm").argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0 and "KDA draft-state slots (2 x per seq)" in run.output and "without --mtp: " in run.output
    run = CliRunner().invoke(main, [a for a in args if a != "--mtp"])
    assert run.exit_code != 0 and "add --mtp" in run.output


def test_serve_with_an_engine_reads_k_back_from_the_profile(tmp_path, monkeypatch):
    """`serve --engine vllm --profile p.yaml`: the launched engine's flags come from the profile `plan` wrote,
    its MTP K included (nothing is started here)."""
    from click.testing import CliRunner

    import flagdeploy.gateway
    import flagdeploy.server
    from flagdeploy.cli import main
    from flagdeploy.gateway.launch import launch_plan
    from flagdeploy.planner.profile import Profile

    path = tmp_path / "p.yaml"
    Profile(model="zai-org/GLM-5.3-Flash", chip="h200", model_type="glm5_next", devices=8, tp=8, mtp=True,
            num_speculative_tokens=2).save(path)
    built = []

    class _Gateway:
        pools = []

    monkeypatch.setattr(flagdeploy.gateway, "build_gateway", lambda cfg: built.append(cfg) or _Gateway())
    monkeypatch.setattr(flagdeploy.server, "make_server", lambda *a, **k: type("S", (), {"run": lambda self: None})())
    r = CliRunner().invoke(main, ["serve", "--engine", "vllm", "--profile", str(path), "--port", "0"])
    assert r.exit_code == 0, r.output
    argv = launch_plan(built[0].models[0], 9000).argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}


def test_vision_encoder_peak_is_its_own_ledger_line_on_the_first_stage():
    """GLM-5.3-Flash's vision tower at its published width runs on at most ENCODER_CHUNK_PATCHES patches at
    once (engine: Glm5NextForCausalLM.encode_media): its widest intermediate there is the block MLP
    (2 x 1024 + 3 x 4096 values per patch, bf16), reserved on the stage that holds the embeddings."""
    from flagdeploy.models.glm5_next.model import ENCODER_CHUNK_PATCHES
    from flagdeploy.planner.report import memory_lines

    _, config = load_config("glm-5.3-flash")
    v = config["vision_config"]
    assert (v["hidden_size"], v["intermediate_size"]) == (1024, 4096)
    plan = make_plan(PlanRequest("glm-5.3-flash", "h200", 8, layout=Layout(tp=8)))
    m = plan.chosen.memory
    assert m.encoder_activations == ENCODER_CHUNK_PATCHES * (2 * 1024 + 3 * 4096) * 2  # ~0.9 GiB
    lines = {item.strip(): n for item, _, n in memory_lines(plan)}
    assert lines["vision encoder activations"] == m.encoder_activations
    assert sum(n for item, n in lines.items() if item != "free") == m.used
    pp = make_plan(PlanRequest("glm-5.3-flash", "h200", 8, layout=Layout(tp=4, pp=2)))
    assert pp.chosen.memory.encoder_activations in (0, m.encoder_activations)  # only if stage 0 is the fullest
    text = {k: v for k, v in config.items() if k != "vision_config"}  # a text-only checkpoint
    text_only = make_plan(PlanRequest("glm-text", "h200", 8, layout=Layout(tp=8), config=text)).chosen.memory
    assert text_only.encoder_activations == 0 and m.weights > text_only.weights  # the tower's weights too
    assert m.used - text_only.used == m.encoder_activations + m.weights - text_only.weights
