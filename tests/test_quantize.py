"""`flagdeploy quantize` on tiny glm5_next checkpoints: what each policy writes, that our runtime runs
the result (int8 ops included) close to the FP8 source, the vLLM-Ascend layout, interruption and resume,
and the errors raised before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flagdeploy.engine.replica import load_model
from flagdeploy.errors import FlagdeployError
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next
from flagdeploy.ops.weights import Int8Weight, W8A8Weight
from flagdeploy.quantize import PolicyError, QuantizeError, quantize
from flagdeploy.quantize.shards import CorruptShardError

# index_topk at least the text length: the DSA indexer then keeps every position, so the comparison
# measures the weights' precision rather than which positions a perturbed indexer happens to select.
TINY = dict(index_topk=256)
PREFIX = "model.language_model.layers."
# Bounds for the no-fp8 mix on this tiny random model, about 3x what it measures (mean KL 7.2e-3, perplexity
# -0.56%; the all-BF16 conversion alone: KL 1.5e-3, +0.53%).
MAX_KL, MAX_PPL_CHANGE = 0.02, 0.02


def _text(n: int = 400) -> str:
    g = torch.Generator().manual_seed(7)
    return " ".join(f"w{i}" for i in torch.randint(2, 64, (n,), generator=g).tolist())


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_tiny_glm5_next(tmp_path_factory.mktemp("q") / "fp8", fp8=True, seed=2, **TINY)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "eval.txt"
    p.write_text(_text())
    return p


@pytest.fixture(scope="module")
def no_fp8(src, text_file, tmp_path_factory):
    dst = tmp_path_factory.mktemp("out") / "int8"
    return dst, quantize(src, dst, chip="ascend910c", eval_text=text_file, progress=False)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(path: Path, dtype=torch.float32) -> torch.Tensor:
    model, tok = load_model(path, "safetensors", dtype, "cpu", progress=False)
    model.prepare(512)
    return model.score(torch.tensor(tok.encode(_text(200))))


def test_default_policy_for_ascend910c_puts_experts_and_mlps_in_w8a8(no_fp8):
    dst, report = no_fp8
    schemes = {r["name"]: r["scheme"] for r in report["tensors"]}
    w8a8 = {n for n, s in schemes.items() if s == "w8a8_dynamic"}
    assert w8a8 and all(".mlp." in n and ".mlp.gate." not in n for n in w8a8)
    assert all(n in w8a8 for n in schemes if ".mlp.experts." in n or ".mlp.shared_experts." in n)
    for sensitive in ("lm_head.weight", "model.language_model.embed_tokens.weight", PREFIX + "1.mlp.gate.weight",
                      PREFIX + "1.self_attn.q_a_proj.weight", PREFIX + "1.self_attn.o_proj.weight",
                      PREFIX + "0.self_attn.q_proj.weight", PREFIX + "0.input_layernorm.weight"):
        assert schemes[sensitive] == "bf16", sensitive
    assert all(schemes[n] == "bf16" for n in schemes if n.startswith("model.visual.") or ".hc_" in n)
    # what is on disk, and what the config says
    t = _tensors(dst)
    down = PREFIX + "1.mlp.experts.3.down_proj"
    assert t[down + ".weight"].dtype == torch.int8 and t[down + ".weight_scale"].shape == (32, 1)
    assert t[down + ".weight_scale"].dtype == torch.float32
    assert t[PREFIX + "1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16  # FP8 in the source
    assert t[PREFIX + "0.self_attn.A_log"].dtype == torch.float32  # float32 stays float32
    assert not any(v.dtype.itemsize == 1 and v.is_floating_point() for v in t.values()), "FP8 left on a no-FP8 chip"
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "flagdeploy" and qc["modules"][down] == "w8a8_dynamic"
    assert qc["source_quantization_config"]["quant_method"] == "fp8"
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(t)
    # the report: every int8 weight within a fraction of a step of its FP8-dequantised value
    rows = {r["name"]: r for r in report["tensors"]}
    assert 0 < rows[down + ".weight"]["rel_error"] < 0.01
    assert report["totals"]["bytes_before"] == sum(r["bytes_before"] for r in report["tensors"])
    assert json.loads((dst / "quantize_report.json").read_text())["totals"] == report["totals"]


def test_runtime_runs_the_int8_checkpoint_with_the_w8a8_ops(no_fp8):
    dst, _ = no_fp8
    model, _ = load_model(dst, "safetensors", torch.float32, "cpu", progress=False)
    moe_layer = model.layers[1].mlp
    assert isinstance(moe_layer.experts.gate_up, W8A8Weight) and moe_layer.experts.gate_up.q.shape == (8, 32, 32)
    assert isinstance(moe_layer.shared.down_proj.qweight, W8A8Weight)
    assert model.layers[1].attn.latent_proj.qweight is None  # BF16 stays a dense linear


def test_int8_mix_stays_close_to_the_fp8_model(no_fp8):
    """The model-level check: mean KL and perplexity change of the no-fp8 mix against the FP8 source."""
    ev = no_fp8[1]["eval"]
    assert ev["tokens"] == 399
    assert 0 < ev["mean_kl"] < MAX_KL
    assert abs(ev["perplexity_change"]) < MAX_PPL_CHANGE


def test_all_bf16_conversion_reproduces_the_dequantised_logits(src, tmp_path):
    dst = tmp_path / "bf16"
    quantize(src, dst, chip="ascend910c", policy="bf16", progress=False)
    # the runtime dequantises FP8 to bf16 exactly as the conversion does: identical logits
    torch.testing.assert_close(_logits(dst, torch.bfloat16), _logits(src, torch.bfloat16), atol=0, rtol=0)
    # in float32 the source keeps the exact FP8 products; bf16 rounding of the weights (2^-9) remains
    ref, got = _logits(src), _logits(dst)
    assert (got - ref).norm() / ref.norm() < 0.01


@pytest.mark.parametrize("policy", ["no-fp8", "bf16"])
def test_one_pass_fp8_kernels_write_what_the_torch_path_writes(src, tmp_path, monkeypatch, policy):
    """Where the cpu backend's kernels build, FP8 weights are converted by its one-pass kernels
    (backends/cpu/csrc/fp8_convert.cpp): the output is byte for byte what torch's passes write, and the
    report's errors agree to float32 accumulation."""
    from flagdeploy.backends.cpu import native

    if native.unsupported():
        pytest.skip(f"no cpu kernels here: {native.unsupported()}")
    calls = []
    for name in ("fp8_to_int8", "fp8_to_bf16"):
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    one_pass = quantize(src, tmp_path / "native", chip="ascend910c", policy=policy, progress=False)
    assert calls and (policy == "bf16" or "fp8_to_int8" in calls)
    monkeypatch.setattr(native, "converts_fp8", lambda *a, **k: False)
    torch_path = quantize(src, tmp_path / "torch", chip="ascend910c", policy=policy, progress=False)
    a, b = _tensors(tmp_path / "native"), _tensors(tmp_path / "torch")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    errors = [(x["rel_error"], y["rel_error"]) for x, y in zip(one_pass["tensors"], torch_path["tensors"])]
    assert len(errors) == len(torch_path["tensors"]) > 0
    assert all(abs(x - y) <= 1e-5 * max(y, 1e-9) + 1e-9 for x, y in errors)


def test_groupwise_w8a16_policy_file(src, tmp_path):
    policy = tmp_path / "w8a16.yaml"
    policy.write_text("name: experts-w8a16\nrules:\n"
                      "  - {match: '*.mlp.experts.*.weight', scheme: w8a16, group_size: 16}\n"
                      "  - {match: '*', scheme: bf16}\n")
    dst = tmp_path / "w8a16"
    quantize(src, dst, chip="ascend910b", policy=policy, progress=False)
    t = _tensors(dst)
    assert t[PREFIX + "1.mlp.experts.0.gate_proj.weight_scale"].shape == (16, 2)  # [out, in / 16]
    model, _ = load_model(dst, "safetensors", torch.float32, "cpu", progress=False)
    bank = model.layers[1].mlp.experts.gate_up
    assert type(bank) is Int8Weight and bank.group_size == 16
    ref, got = _logits(src), _logits(dst)
    assert (got - ref).norm() / ref.norm() < 0.05


def test_fp8_chip_keeps_the_checkpoint_as_published(src, tmp_path):
    dst = tmp_path / "fp8"
    report = quantize(src, dst, chip="h200", progress=False)  # the fp8 policy: keep everything
    assert {r["scheme"] for r in report["tensors"]} == {"keep"}
    before, after = _tensors(src), _tensors(dst)
    assert before.keys() == after.keys() and all(torch.equal(before[k].view(torch.uint8) if before[k].dtype.itemsize == 1
                                                             else before[k], after[k].view(torch.uint8)
                                                             if after[k].dtype.itemsize == 1 else after[k]) for k in before)
    torch.testing.assert_close(_logits(dst), _logits(src), atol=0, rtol=0)


def test_vllm_ascend_cannot_carry_kept_fp8(src, tmp_path):
    """Its description file has no FP8 type (the weights were labelled FLOAT and the block size lost, so the
    output could not load): a policy that keeps FP8 is refused before anything is written."""
    with pytest.raises(QuantizeError, match="no way to describe FP8 weights"):
        quantize(src, tmp_path / "va8", chip="h200", fmt="vllm-ascend", progress=False)
    assert not (tmp_path / "va8").exists()


def test_vllm_ascend_layout(src, tmp_path):
    dst = tmp_path / "va"
    quantize(src, dst, chip="ascend910c", fmt="vllm-ascend", progress=False)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    assert desc.pop("model_quant_type") == "W8A8_DYNAMIC"
    desc.pop("version")
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(desc) == set(index)  # every tensor listed, nothing else
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    with_dtype = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                with_dtype[k] = sf.get_slice(k).get_dtype(), tuple(sf.get_slice(k).get_shape())
    for name, kind in desc.items():
        dtype, shape = with_dtype[name]
        if kind == "FLOAT":
            assert dtype in ("BF16", "F32"), name
            continue
        assert kind == "W8A8_DYNAMIC"
        base, _, leaf = name.rpartition(".")
        rows = with_dtype[base + ".weight"][1][0]
        assert {"weight": ("I8", shape), "weight_scale": ("F32", (rows, 1)), "weight_offset": ("F32", (rows, 1))}[leaf] \
            == (dtype, shape), name
    # vLLM-Ascend reads expert 0's gate/up/down to decide the MoE scheme, and the router stays FLOAT
    layer = PREFIX + "1.mlp."
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert desc[f"{layer}experts.0.{proj}.weight"] == desc[f"{layer}experts.0.{proj}.weight_offset"] == "W8A8_DYNAMIC"
    assert desc[layer + "gate.weight"] == "FLOAT" and desc["lm_head.weight"] == "FLOAT"
    offsets = [v for k, v in _tensors(dst).items() if k.endswith(".weight_offset")]
    assert offsets and all(not o.any() for o in offsets)  # symmetric


# ---- interruption -----------------------------------------------------------------------------------------


def _big_source(root: Path, shards: int = 4) -> Path:
    """A plain BF16 checkpoint big enough (4 x 48 MiB) that converting it takes a moment."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{i}.mlp.{p}.weight": torch.randn(2048, 4096, generator=g).to(torch.bfloat16)
                   for p in ("gate_proj", "up_proj", "down_proj")}
        save_file(tensors, root / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flagdeploy.cli", "quantize", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_killed_conversion_leaves_no_output_and_resumes(tmp_path):
    source = _big_source(tmp_path / "big")
    dst = tmp_path / "out"
    partial = tmp_path / ".out.partial"
    proc = _cli(str(source), "-o", str(dst), "--chip", "ascend910c")
    deadline = time.time() + 120
    state = partial / ".quantize-state.json"
    while not (state.exists() and "model-00001" in state.read_text()):  # one shard done, others to go
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dst.exists()
    assert not (partial / "config.json").exists() and not (partial / "quantize_report.json").exists()
    done = json.loads((partial / ".quantize-state.json").read_text())["done"]
    assert "model-00001-of-00004.safetensors" in done and len(done) < 4
    proc = _cli(str(source), "-o", str(dst), "--chip", "ascend910c", "--log-level", "warning")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming" in err
    assert not partial.exists() and (dst / "quantize_report.json").exists()
    # the resumed result is what an uninterrupted run writes
    clean = tmp_path / "clean"
    quantize(source, clean, chip="ascend910c", progress=False)
    a, b = _tensors(dst), _tensors(clean)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((dst / "quantize_report.json").read_text())["notes"]  # "not FP8" is noted


# ---- bad input: a clear error, and nothing written -------------------------------------------------------


def _assert_nothing_written(dst: Path) -> None:
    assert not dst.exists() and not (dst.parent / f".{dst.name}.partial").exists()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bf16_source_is_converted_and_noted(tmp_path):
    src = write_tiny_glm5_next(tmp_path / "bf16src", **TINY)
    report = quantize(src, tmp_path / "out", chip="ascend910c", progress=False)
    assert any("no FP8" in n for n in report["notes"])
    assert "w8a8_dynamic" in report["schemes"]


def test_corrupt_shard(src, tmp_path):
    bad = _copy(src, tmp_path / "bad")
    shard = sorted(bad.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CorruptShardError, match=shard.name):
        quantize(bad, tmp_path / "out", chip="ascend910c", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_missing_scale(src, tmp_path):
    bad = _copy(src, tmp_path / "noscale")
    shard = sorted(bad.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    victim = next(k for k in tensors if k.endswith("_scale_inv"))
    del tensors[victim]
    save_file(tensors, shard)
    with pytest.raises(QuantizeError, match=victim.removesuffix("_scale_inv").replace(".", r"\.")):
        quantize(bad, tmp_path / "out", chip="ascend910c", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_unknown_scheme_in_policy(src, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("rules:\n  - {match: '*', scheme: int3}\n")
    with pytest.raises(PolicyError, match="unknown scheme 'int3'.*w8a8_dynamic"):
        quantize(src, tmp_path / "out", chip="ascend910c", policy=policy, progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_schemes_the_chip_cannot_run(src, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("rules:\n  - {match: '*.experts.*', scheme: fp8}\n  - {match: '*', scheme: bf16}\n")
    with pytest.raises(PolicyError, match="needs fp8 matmuls.*ascend910c"):
        quantize(src, tmp_path / "out", chip="ascend910c", policy=policy, progress=False)
    with pytest.raises(QuantizeError, match="keeps the FP8 tensor.*no FP8 matmuls"):  # `keep` of an FP8 tensor
        quantize(src, tmp_path / "out", chip="ascend910c", policy="fp8", progress=False)
    with pytest.raises(FlagdeployError, match="ascend910x"):
        quantize(src, tmp_path / "out", chip="ascend910x", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_cli_reports_errors_without_a_traceback(src, tmp_path):
    proc = _cli(str(src), "-o", str(tmp_path / "out"), "--chip", "ascend910c", "--policy", "fp8")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err.startswith("error: ") and "Traceback" not in err
    _assert_nothing_written(tmp_path / "out")
    proc = _cli(str(src), "-o", str(tmp_path / "out"), "--chip", "ascend910c")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "w8a8_dynamic" in out and "total" in out


# ---- the converted checkpoint serves ---------------------------------------------------------------------


def test_engine_serves_the_converted_glm5_next(no_fp8):
    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    engine = build_llm_engine(no_fp8[0], "safetensors", EngineConfig(max_model_len=128, kv_cache_memory=8 << 20),
                              chip="cpu", progress=False)
    out = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o) for o in out] == [6, 6]


def test_llama_checkpoint_through_the_no_fp8_policy(tmp_path):
    """A llama-family BF16 checkpoint: MLPs become W8A8 linears (gate/up fused), logits stay close."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer

    write_word_tokenizer(tmp_path / "src", 211)
    quantize(tmp_path / "src", tmp_path / "int8", chip="ascend910b", progress=False)
    model, _ = load_model(tmp_path / "int8", "safetensors", torch.float32, "cpu", progress=False)
    layer = model.layers[0]
    assert isinstance(layer.gate_up_proj.qweight, W8A8Weight) and isinstance(layer.down_proj.qweight, W8A8Weight)
    assert layer.qkv_proj.qweight is None
    ref, got = _logits(tmp_path / "src"), _logits(tmp_path / "int8")
    assert (got - ref).norm() / ref.norm() < 0.05
