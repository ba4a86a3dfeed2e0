"""GLM-5.3-Flash split over CPU processes (gloo): tensor parallelism (heads, intermediate sizes, vocabulary)
and expert parallelism (routed experts, all-to-all dispatch) give one process's logits and greedy tokens.

Each case loads the tiny published-layout checkpoint through the engine's loader on every rank (the
model is built with that rank's layout), runs a prefill and greedy decode steps through the cache, and
also a packed step of two sequences (uneven token counts per EP block, batched KDA decode); all ranks
must agree with the unsplit model within 1e-4 in float32, with identical tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from flagdeploy import ops, parallel
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next
from flagdeploy.models.glm5_next import Glm5NextForCausalLM, from_hf_config, load_hf_weights
from flagdeploy.parallel import ParallelConfig, Shard

PROMPT = [5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19]  # odd: the EP blocks are uneven
OTHER = [12, 14, 16, 18, 20, 2]
STEPS = 6
ATOL = 1e-4


def _run(model) -> dict:
    """Prefill + greedy decode of one sequence, then a packed prefill / decode of two sequences."""
    cache = model.new_cache()
    logits = [model.forward(torch.tensor(PROMPT), cache)]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(model.forward(torch.tensor([tokens[-1]]), cache))
    caches = [model.new_cache(), model.new_cache()]
    packed = model.forward_batch([torch.tensor(PROMPT[:5]), torch.tensor(OTHER)], caches)
    for _ in range(2):  # two sequences decoding together: the KDA layers step them as one op call
        packed += model.forward_batch([p[-1:].argmax(-1) for p in packed[-2:]], caches)
    return {"logits": torch.cat(logits), "tokens": tokens, "packed": torch.cat(packed)}


def _worker(rank: int, tp: int, ep: int, init_method: str, ckpt: str, out: str) -> None:
    from flagdeploy.engine.replica import load_model

    torch.set_num_threads(1)
    ops.use_backend("cpu")
    parallel.init_model_parallel(ParallelConfig(tp=tp, ep=ep), rank, init_method)
    try:
        model, _ = load_model(Path(ckpt), "safetensors", torch.float32, "cpu", progress=False)
        result = _run(model)
        # what this rank holds: its heads, experts and vocabulary rows
        result["held"] = (model.layers[1].attn.heads, model.layers[0].attn.heads,
                          tuple(model.layers[1].mlp.experts.gate_up.shape), tuple(model.lm_head.weight.shape))
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        parallel.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny checkpoint (BF16 as published, and FP8 block-scaled) and one process's results on it."""
    from flagdeploy.engine.replica import load_model

    ops.use_backend("cpu")
    out = {}
    for fp8 in (False, True):
        path = write_tiny_glm5_next(tmp_path_factory.mktemp("ckpt") / f"glm5-tiny-{fp8}", fp8=fp8)
        model, _ = load_model(path, "safetensors", torch.float32, "cpu", progress=False)
        out[fp8] = path, _run(model)
    return out


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    return checkpoints[False][0]


@pytest.mark.parametrize("tp,ep,fp8", [(2, 1, False), (1, 2, False), (2, 2, False), (1, 2, True)],
                         ids=["tp2", "ep2", "tp2-ep2", "ep2-fp8"])
def test_split_model_matches_one_process(checkpoints, tmp_path, tp, ep, fp8):
    ckpt, reference = checkpoints[fp8]
    mp.spawn(_worker, args=(tp, ep, f"file://{tmp_path / 'rendezvous'}", str(ckpt), str(tmp_path)),
             nprocs=tp * ep, join=True)
    for rank in range(tp * ep):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["held"] == (2 // tp, 2 // tp, (8 // ep, 2 * 16 // tp, 32), (64 // tp, 32)), rank
        assert got["tokens"] == reference["tokens"], rank
        for key in ("logits", "packed"):
            assert got[key].shape == reference[key].shape
            torch.testing.assert_close(got[key], reference[key], atol=ATOL, rtol=0, msg=f"rank {rank} {key}")


# ---- single-process checks of the split layout (a rank's layout set by hand, no process group) ---------


def _as_rank(monkeypatch, tp: int, ep: int, rank: int) -> None:
    monkeypatch.setattr(parallel, "_layout", parallel._Layout(tp, ep, rank, None, None, None))


def _cfg(ckpt):
    import json

    return from_hf_config(json.loads((ckpt / "config.json").read_text()))


@pytest.mark.parametrize("tp,ep,flag,what", [(3, 1, "--tp", "heads"), (1, 3, "--ep", "routed experts"),
                                              (2, 1, "--tp", "moe_intermediate_size")])
def test_uneven_split_names_the_flag(ckpt, monkeypatch, tp, ep, flag, what):
    cfg = _cfg(ckpt)
    if what == "moe_intermediate_size":  # heads and the dense MLP split, the experts' 15 rows do not
        cfg.moe_intermediate_size = 15
        cfg.intermediate_size = 48
    _as_rank(monkeypatch, tp, ep, 0)
    with pytest.raises(ValueError, match=rf"{what}.*pick a {flag} that divides"):
        Glm5NextForCausalLM(cfg)


def test_read_plan(ckpt, monkeypatch):
    _as_rank(monkeypatch, 2, 2, 3)  # tp_rank 1, ep_rank 1: experts 4..7, second half of every split
    model = Glm5NextForCausalLM(_cfg(ckpt))
    p = "model.language_model.layers."
    plan = model.read_plan
    assert plan(p + "1.mlp.experts.0.gate_proj.weight") == "skip"
    assert plan(p + "1.mlp.experts.3.down_proj.weight_scale_inv") == "skip"
    assert plan(p + "1.mlp.experts.5.gate_proj.weight") == Shard(0, 8, 8, 16)
    assert plan(p + "1.mlp.experts.5.down_proj.weight") == Shard(1, 8, 8, 16)
    assert plan(p + "1.mlp.experts.5.down_proj.weight_scale_inv") is None
    assert plan(p + "1.mlp.shared_experts.up_proj.weight") == Shard(0, 8, 8, 16)
    assert plan(p + "0.mlp.down_proj.weight") == Shard(1, 24, 24, 48)  # dense layer: not an expert, not skipped
    assert plan(p + "1.self_attn.q_b_proj.weight") == Shard(0, 8, 8, 16)  # 2 heads x 8
    assert plan(p + "1.self_attn.kv_b_proj.weight") == Shard(0, 16, 16, 32)  # 2 heads x (8 + 8)
    assert plan(p + "1.self_attn.o_proj.weight") == Shard(1, 8, 8, 16)
    assert plan(p + "1.self_attn.kv_a_proj_with_mqa.weight") is None  # the latent: replicated
    assert plan(p + "1.self_attn.indexer.wq_b.weight") is None
    assert plan(p + "1.mlp.gate.weight") is None
    assert plan(p + "0.self_attn.q_conv1d.weight") == Shard(0, 8, 8, 16)
    assert plan(p + "0.self_attn.A_log") == Shard(0, 1, 1, 2)
    assert plan(p + "0.self_attn.b_proj.weight") == Shard(0, 1, 1, 2)
    assert plan(p + "0.self_attn.f_a_proj.weight") is None
    assert plan(p + "0.hc_attn_fn") is None
    assert plan("model.language_model.embed_tokens.weight") == Shard(0, 32, 32, 64)
    assert plan("lm_head.weight") == Shard(0, 32, 32, 64)
    # transformers' fused tensors are read whole and split by name afterwards
    assert plan(p + "1.mlp.experts.gate_up_proj") is None
    assert plan(p + "0.self_attn.conv1d.weight") is None
    assert plan("model.visual.blocks.0.attn.qkv.weight") is None


def test_reader_slices_16bit_tensors_and_reads_fp8_ones_whole(tmp_path, monkeypatch):
    """The safetensors reader follows read_plan: other ranks' experts are never read, BF16 tensors are
    read as this rank's slice, FP8 weights whole (their blocks must meet their scales)."""
    from flagdeploy.checkpoints import safetensors_reader

    path = tmp_path / "fp8"
    write_tiny_glm5_next(path, fp8=True)
    _as_rank(monkeypatch, 2, 2, 3)
    model = Glm5NextForCausalLM(_cfg(path))
    got = dict(safetensors_reader.iter_tensors(path, torch.float32, model.read_plan))
    p = "model.language_model.layers."
    q_b = got[p + "1.self_attn.q_b_proj.weight"]
    assert q_b.dtype == torch.float8_e4m3fn and q_b.shape[0] == 16  # whole: 2 heads x 8 rows
    assert got[p + "0.self_attn.q_proj.weight"].shape[0] == 8  # BF16 KDA projection: this rank's 8 of 16 rows
    assert p + "1.mlp.experts.0.gate_proj.weight" not in got and p + "1.mlp.experts.5.gate_proj.weight" in got


def _weights(model) -> dict[str, torch.Tensor]:
    """Every parameter, and every Linear's (plain-attribute) weight."""
    out = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), torch.Tensor) and not isinstance(m.weight, torch.nn.Parameter):
            out[name + ".weight"] = m.weight
    return out


def test_loads_whole_or_sliced_tensors_alike(ckpt, monkeypatch):
    """One rank's model from whole tensors, and from what a reader following read_plan hands over
    (slices, skipped experts), is the same; no expert another rank holds is missing or stored."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    _as_rank(monkeypatch, 2, 2, 1)  # tp_rank 1, ep_rank 0
    cfg = _cfg(ckpt)
    whole, sliced = Glm5NextForCausalLM(cfg), Glm5NextForCausalLM(cfg)
    load_hf_weights(whole, ((n, t.float()) for n, t in tensors.items()))
    read = []
    for n, t in tensors.items():
        what = sliced.read_plan(n)
        if what == "skip":
            continue
        read.append((n, what.take(t.float()) if isinstance(what, Shard) else t.float()))
    assert len(read) < len(tensors)
    load_hf_weights(sliced, read)
    a, b = _weights(whole), _weights(sliced)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert whole.layers[1].mlp.experts.gate_up.shape == (4, 16, 32)  # 4 of 8 experts, half of 16 rows each
    assert whole.lm_head.weight.shape == (32, 32)
