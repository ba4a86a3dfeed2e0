"""A tiny GLM-5.3-Flash checkpoint in the published layout (flagdeploy.checkpoints.tiny_checkpoint), loaded
by transformers and by flagdeploy from the same files: BF16, FP8 block-scaled, written atomically, and a
bad config rejected before any weight is read."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from conftest import ties_keep_the_lower_index  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, FineGrainedFP8Config, Glm5NextForConditionalGeneration  # noqa: E402

from flagdeploy.engine.replica import check_source, load_model  # noqa: E402
from flagdeploy.errors import ModelLoadError  # noqa: E402
from flagdeploy.checkpoints import safetensors_reader, tiny_checkpoint  # noqa: E402
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next  # noqa: E402
from flagdeploy.models import build_model, load_weights  # noqa: E402

# float32 on both sides from the same stored values; the remaining difference is summation order.
ATOL = RTOL = 1e-5
IDS = torch.randint(0, 64, (45,), generator=torch.Generator().manual_seed(3))  # 11 kpools + a tail


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return write_tiny_glm5_next(tmp_path_factory.mktemp("ckpt") / "glm5-tiny")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_tiny_glm5_next(tmp_path_factory.mktemp("ckpt") / "glm5-tiny-fp8", fp8=True, seed=1)


def _hf_logits(path: Path, **kwargs) -> torch.Tensor:
    hf, info = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                output_loading_info=True, **kwargs)
    assert not any(info.values()), info  # no missing / unexpected / mismatched key: the names are transformers'
    # With a quantization_config transformers leaves the checkpoint's BF16 tensors in BF16 despite
    # dtype=float32 (its forward then fails on a BF16 x float32 matmul); BF16 -> float32 is exact.
    hf = hf.float().eval()
    with torch.no_grad():
        return hf(input_ids=IDS[None]).logits[0].float()


def _shard_tensors(path: Path):
    """The shards' tensors in their stored dtypes (FP8 stays FP8), as the published files hold them."""
    for f in safetensors_reader.shard_files(path):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _ours_from_shards(path: Path, tensors=None):
    model = build_model(safetensors_reader.read_config(path), torch.float32, "cpu")
    load_weights(model, tensors if tensors is not None else _shard_tensors(path))
    return model


def _report(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    print(f"{label}: max |dlogit| = {(got - want).abs().max().item():.3g} (logit std {want.std().item():.3g})")


# ---- layout -------------------------------------------------------------------------------------------


def test_published_layout(fp8_dir):
    files = sorted(os.listdir(fp8_dir))
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards == [f for f in files if f.endswith(".safetensors")]
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    dtypes, total = {}, 0
    for name, t in _shard_tensors(fp8_dir):
        dtypes[name] = t.dtype
        total += t.numel() * t.element_size()
    assert set(dtypes) == set(index["weight_map"]) and total == index["metadata"]["total_size"]
    cfg = json.loads((fp8_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == ("fp8", "e4m3", "dynamic",
                                                                                           [16, 16])
    assert cfg["model_type"] == "glm5_next" and cfg["vision_config"]["depth"] == 1
    p = "model.language_model.layers."
    fp8 = torch.float8_e4m3fn
    # layer 1: indexed attention + MoE; layer 0: KDA + dense MLP
    for name in ("1.mlp.experts.7.down_proj.weight", "1.mlp.shared_experts.up_proj.weight", "0.mlp.gate_proj.weight",
                 "1.self_attn.q_a_proj.weight", "1.self_attn.q_b_proj.weight", "1.self_attn.kv_a_proj_with_mqa.weight",
                 "1.self_attn.o_proj.weight"):
        assert dtypes[p + name] == fp8 and dtypes[p + name + "_scale_inv"] == torch.float32, name
    for name in ("0.self_attn.o_proj.weight", "0.self_attn.q_conv1d.weight", "0.self_attn.f_a_proj.weight",
                 "1.self_attn.kv_b_proj.weight", "1.self_attn.indexer.wq_b.weight", "1.mlp.gate.weight",
                 "1.hc_attn_fn", "1.input_layernorm.weight"):
        assert dtypes[p + name] == torch.bfloat16, name
    for name in ("1.mlp.gate.e_score_correction_bias", "0.self_attn.dt_bias", "0.self_attn.A_log", "1.hc_ffn_base",
                 "1.hc_attn_scale"):
        assert dtypes[p + name] == torch.float32, name
    assert dtypes["lm_head.weight"] == dtypes["model.language_model.embed_tokens.weight"] == torch.bfloat16
    assert any(n.startswith("model.visual.") for n in dtypes)
    assert not any(n.endswith("_scale_inv") and not n.startswith(p) for n in dtypes)


# ---- BF16 ---------------------------------------------------------------------------------------------


def test_bf16_checkpoint_loads_like_transformers(bf16_dir):
    want = _hf_logits(bf16_dir)
    ours, tokenizer = load_model(Path(bf16_dir), "safetensors", torch.float32, "cpu", progress=False)
    got = ours(IDS)
    _report("bf16 load_model vs transformers", got, want)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert tokenizer is not None


def test_auto_keeps_bf16_experts_bf16(bf16_dir, fp8_dir):
    """weight_format auto in a float32 run keeps a BF16 checkpoint's expert banks bfloat16 (the stored
    values exactly, half the bytes a decode step reads) where the cpu backend has bf16 matmuls; the
    logits stay close to the all-float32 model (mean next-token KL: 0.003 measured, transformers' own
    bf16 model is at 0.05 against its float32). FP8 experts, dequantised, are not bf16 numbers: float32."""
    from flagdeploy import ops
    from flagdeploy.models.glm5_next import ExpertBank

    if "bfloat16" not in ops.get_backend("cpu").narrow_weight_dtypes:
        pytest.skip("this CPU has no oneDNN bf16 matmuls: auto keeps float32 experts")

    def banks(model):
        return [(m.gate_up, m.down) for m in model.modules() if isinstance(m, ExpertBank)]

    dense, _ = load_model(Path(bf16_dir), "safetensors", torch.float32, "cpu", progress=False)
    auto, _ = load_model(Path(bf16_dir), "safetensors", torch.float32, "cpu", progress=False, weight_format="auto")
    assert banks(auto)
    for narrow, wide in zip(banks(auto), banks(dense)):
        for n, w in zip(narrow, wide):
            assert n.dtype == torch.bfloat16 and w.dtype == torch.float32 and torch.equal(n.float(), w)
    want, got = dense(IDS).log_softmax(-1), auto(IDS).log_softmax(-1)
    assert (want.exp() * (want - got)).sum(-1).mean() < 0.01
    fp8, _ = load_model(Path(fp8_dir), "safetensors", torch.float32, "cpu", progress=False, weight_format="auto")
    assert all(b.dtype == torch.float32 for pair in banks(fp8) for b in pair)


def test_bf16_directory_is_servable(bf16_dir):
    """Tokenizer and chat template included: the engine's greedy tokens are transformers' (full forward)."""
    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    engine = build_llm_engine(Path(bf16_dir), "safetensors", EngineConfig(max_model_len=64), chip="cpu",
                              progress=False)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w9 w13 w22"}])
    prompt = engine.tokenizer.encode(text)
    assert prompt == [5, 9, 13, 22, 2]
    hf = Glm5NextForConditionalGeneration.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert got == [ids[len(prompt):]]


# ---- FP8 ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_reference(fp8_dir):
    """transformers' fine-grained FP8 path, dequantised on the CPU (its default without a GPU). The FP8 weights
    make the indexer tie at the top-k cut (max |diff| 8.7 under torch.topk's own choice, 5e-6 under the rule)."""
    with ties_keep_the_lower_index():
        return _hf_logits(fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True))


def test_fp8_shards_load_like_transformers(fp8_dir, fp8_reference):
    """The model's loader fed the shards' tensors as stored (FP8 + weight_scale_inv)."""
    got = _ours_from_shards(fp8_dir)(IDS)
    _report("fp8 shards -> load_weights vs transformers", got, fp8_reference)
    torch.testing.assert_close(got, fp8_reference, atol=ATOL, rtol=RTOL)


def test_fp8_checkpoint_through_load_model(fp8_dir, fp8_reference):
    ours, _ = load_model(Path(fp8_dir), "safetensors", torch.float32, "cpu", progress=False)
    got = ours(IDS)
    _report("fp8 load_model vs transformers", got, fp8_reference)
    torch.testing.assert_close(got, fp8_reference, atol=ATOL, rtol=RTOL)


def test_fp8_partial_blocks_equal_hand_dequantised(tmp_path):
    """q_lora_rank 24 with 16x16 blocks: q_a / q_b have partial edge blocks (transformers derives the block
    size from the scale grid and cannot do these). Equals the same weights dequantised block by block here."""
    path = write_tiny_glm5_next(tmp_path / "partial", fp8=True, seed=2, q_lora_rank=24)
    fp8 = list(_shard_tensors(path))
    scales = {n[: -len("_scale_inv")]: t for n, t in fp8 if n.endswith("_scale_inv")}
    assert tuple(scales["model.language_model.layers.1.self_attn.q_a_proj.weight"].shape) == (2, 2)
    plain = []
    for name, t in fp8:
        if name in scales:
            w, s = t.float(), scales[name]
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] *= s[i, j]
            plain.append((name, w))
        elif not name.endswith("_scale_inv"):
            plain.append((name, t))
    got, want = _ours_from_shards(path, fp8)(IDS), _ours_from_shards(path, plain)(IDS)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---- atomic writes ------------------------------------------------------------------------------------


def test_write_leaves_no_temporary_directory(tmp_path):
    out = write_tiny_glm5_next(tmp_path / "m", shard_size_bytes=50_000)
    assert os.listdir(tmp_path) == ["m"] and out == tmp_path / "m"
    assert len(list(out.glob("model-*.safetensors"))) >= 4
    with pytest.raises(FileExistsError):
        write_tiny_glm5_next(out)


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    real = tiny_checkpoint.save_file

    def second_shard_fails(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(tiny_checkpoint, "save_file", second_shard_fails)
    with pytest.raises(OSError, match="disk full"):
        write_tiny_glm5_next(tmp_path / "m", shard_size_bytes=50_000)
    assert len(calls) == 2 and Path(calls[0]).parent.name != "m"  # one shard had been written, elsewhere
    assert os.listdir(tmp_path) == []


# ---- config checks ------------------------------------------------------------------------------------


def test_check_source_rejects_what_transformers_rejects_before_reading_weights(tmp_path, monkeypatch):
    path = write_tiny_glm5_next(tmp_path / "bad")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["index_topk"] = 10  # index_kpool is 4
    (path / "config.json").write_text(json.dumps(cfg))
    for shard in path.glob("model-*.safetensors"):
        shard.write_bytes(b"not a safetensors file")

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(safetensors_reader, "safe_open", no_weights)
    with pytest.raises(Exception) as hf_err:
        AutoConfig.from_pretrained(path)
    with pytest.raises(ModelLoadError) as ours_err:
        check_source(path, "safetensors")
    assert str(ours_err.value) == "index_topk (10) must be divisible by index_kpool (4)."
    assert str(ours_err.value) in str(hf_err.value)


def test_fp8_linears_can_stay_fp8(tmp_path):
    """keep_fp8 (what a backend with FP8 matmuls gets): the MLA projections and MLPs hold Fp8BlockWeight
    and run linear_fp8_block (here its reference: FP8 activations too), the routed experts become FP8
    banks; other tensors are dequantized; logits stay within a few percent of the dequantized model's (index_topk covers the whole
    prompt, so that the DSA's selection does not amplify the FP8 activation noise)."""
    from flagdeploy.ops.weights import Fp8BlockWeight

    fp8_dir = write_tiny_glm5_next(tmp_path / "fp8", fp8=True, seed=1, index_topk=256)

    def logits(keep):
        model = build_model(safetensors_reader.read_config(fp8_dir), torch.float32, "cpu")
        load_weights(model, _shard_tensors(fp8_dir), keep_fp8=keep)
        return model, model(IDS)

    kept, got = logits(True)
    assert isinstance(kept.layers[1].attn.latent_proj.qweight, Fp8BlockWeight)
    assert isinstance(kept.layers[0].mlp.gate_up_proj.qweight, Fp8BlockWeight)  # gate and up fused, both FP8
    assert isinstance(kept.layers[1].mlp.experts.gate_up, Fp8BlockWeight)
    assert kept.layers[1].mlp.experts.gate_up.q.shape[0] == kept.cfg.n_routed_experts
    _, want = logits(False)
    assert 0 < (got - want).norm() / want.norm() < 0.1
