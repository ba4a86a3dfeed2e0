"""GLM-5.3-Flash (glm5_next) on flagdeploy.ops against transformers' own implementation.

A tiny random configuration exercises every layer kind: KDA and indexed (MLA + DSA) layers, full and
shared indexer layers, kpool with a tail, dense and MoE FFNs with several expert groups, and
hyper-connections. The transformers model's weights are perturbed (its init leaves biases, gates and
mHC bases at constants that would hide mistakes), renamed to the published checkpoint's layout, and
loaded through our loader.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

from flagdeploy.errors import ModelLoadError  # noqa: E402
from flagdeploy.models.glm5_next import Glm5NextForCausalLM, from_hf_config, load_hf_weights  # noqa: E402
from flagdeploy.ops import glm as glm_ops  # noqa: E402
from flagdeploy.ops.registry import OPS  # noqa: E402

ATOL = RTOL = 1e-4

# 8 layers: KDA at 0, 3, 5; indexed at 1 (full), 2 (shared), 4 (full), 6 (full), 7 (shared); dense FFN at
# 0, 2, 6, MoE elsewhere (8 experts in 2 groups, 1 group and 2 experts per token). index_topk 8 with kpool 4
# keeps 2 pools per query, so longer prompts really are sparse. 8 indexer heads: with few heads the
# relu'd pool scores are often exactly 0 and tie; we keep the lower pool index of equal scores, transformers
# keeps torch.topk's choice (which depends on the row's width), so these comparisons stay clear of ties.
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=8,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=2, topk_group=1,
    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8,
    index_head_dim=8, index_n_heads=8, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=3,
    hc_sinkhorn_iters=5, pad_token_id=0,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full", "full", "full", "shared"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "sparse", "dense", "sparse"],
)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
              projection_intermediate_size=16)


def _hf_model(**overrides) -> Glm5NextForConditionalGeneration:
    torch.manual_seed(0)
    text = {**TEXT, **overrides}
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=VISION)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "language_model" in name or name == "lm_head.weight":
                t.add_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


def _checkpoint_form(state: dict[str, torch.Tensor]):
    """transformers' state_dict → the published shards' names (per-expert, split convs, hc_* names)."""
    for name, t in state.items():
        name = re.sub(r"\.self_attn\.forget_gate\.", ".self_attn.", name)
        name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate.clone()
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(t):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), w.clone()
        elif name.endswith("self_attn.conv1d.weight"):
            for proj, w in zip("qkv", t.chunk(3)):
                yield name.replace("conv1d", f"{proj}_conv1d"), w.clone()
        else:
            yield name, t


@pytest.fixture(scope="module")
def models():
    hf = _hf_model()
    ours = Glm5NextForCausalLM(from_hf_config(hf.config.to_dict()))
    load_hf_weights(ours, _checkpoint_form(hf.state_dict()))
    return hf, ours


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TEXT["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_matches_transformers(models):
    hf, ours = models
    ids = _ids(45, 2)  # 11 complete kpools + a tail; KDA chunk boundaries do not matter here (one chunk)
    want, got = _hf_logits(hf, ids), ours(ids)
    print(f"prefill max |dlogit| = {(got - want).abs().max().item():.3g}")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_prefill_longer_than_a_kda_chunk(models):
    hf, ours = models
    ids = _ids(150, 3)  # 3 KDA chunks of 64 (the last partial), 37 kpools
    torch.testing.assert_close(ours(ids), _hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_state_dict_names_load_the_same_model(models):
    hf, ours = models
    again = Glm5NextForCausalLM(from_hf_config(hf.config.to_dict()))
    load_hf_weights(again, hf.state_dict().items())
    ids = _ids(20, 4)
    torch.testing.assert_close(again(ids), ours(ids), atol=0, rtol=0)


def test_decode_steps_match_full_forward(models):
    hf, ours = models
    ids = _ids(45, 5)
    want = _hf_logits(hf, ids)
    cache = ours.new_cache()
    got = [ours(ids[:29], cache)]
    for i in range(29, 45):  # 16 single-token steps across kpool boundaries
        got.append(ours(ids[i : i + 1], cache))
    got = torch.cat(got)
    print(f"decode max |dlogit| = {(got - want).abs().max().item():.3g}")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert cache.length == 45


@pytest.mark.parametrize("overrides", [
    {"index_kpool_always_select_tail": False},  # queries inside the first pool select nothing: zero output
    {"index_kpool": 1, "index_topk": 3},  # per-token DSA, no tail
    {"linear_lower_bound": None},  # softplus forget gate instead of the bounded sigmoid
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20},
], ids=["no-tail", "kpool1", "softplus-gate", "groups4-hc4"])
def test_variants_prefill_then_decode_from_one_token(overrides):
    hf = _hf_model(**overrides)
    ours = Glm5NextForCausalLM(from_hf_config(hf.config.to_dict()))
    load_hf_weights(ours, _checkpoint_form(hf.state_dict()))
    ids = _ids(30, 12)
    want = _hf_logits(hf, ids)
    torch.testing.assert_close(ours(ids), want, atol=ATOL, rtol=RTOL)
    cache = ours.new_cache()
    got = torch.cat([ours(ids[i : i + 1], cache) for i in range(30)])  # a 1-token prompt, then 29 steps
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("overrides", [{}, {"index_kpool_always_select_tail": False}, {"index_kpool": 1, "index_topk": 3}],
                         ids=["default", "no-tail", "kpool1"])
def test_batched_decode_through_the_pools_matches_transformers(overrides):
    """The engine's decode step (`forward_decode`: fixed shapes, state rows and block tables as tensors,
    the shape a CUDA graph captures) continues prefills of unequal lengths; a padding row on a scratch
    block and state row rides along and disturbs nothing."""
    hf = _hf_model(**overrides)
    ours = Glm5NextForCausalLM(from_hf_config(hf.config.to_dict()))
    load_hf_weights(ours, _checkpoint_form(hf.state_dict()))
    bs, seqs, prompt = 4, [_ids(30, 13), _ids(22, 14), _ids(27, 15)], [9, 1, 14]
    pools = ours.cache_pools(num_blocks=40, block_size=bs, max_seqs=4)  # row 3 / block 39: scratch
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    outs = [[ours.forward_packed(s[:n], torch.tensor([0, n]), [ours.engine_cache(pools, t, i, 0)])]
            for i, (s, n, t) in enumerate(zip(seqs, prompt, tables))]
    for step in range(max(len(s) - n for s, n in zip(seqs, prompt))):
        live = [i for i in range(3) if prompt[i] + step < len(seqs[i])]
        pos = [prompt[i] + step for i in live]
        t = lambda x: torch.tensor(x)  # noqa: E731
        logits = ours.forward_decode(t([int(seqs[i][p]) for i, p in zip(live, pos)] + [0]), pools, t([*live, 3]),
                                     t([tables[i][p // bs] * bs + p % bs for i, p in zip(live, pos)] + [39 * bs]),
                                     t([tables[i] for i in live] + [[39] * 8]), t([p + 1 for p in pos] + [1]))
        for j, i in enumerate(live):
            outs[i].append(logits[j : j + 1])
    for s, out in zip(seqs, outs):
        torch.testing.assert_close(torch.cat(out), _hf_logits(hf, s), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_continues_a_cache(models):
    hf, ours = models
    ids = _ids(40, 6)
    cache = ours.new_cache()
    got = torch.cat([ours(ids[:13], cache), ours(ids[13:30], cache), ours(ids[30:], cache)])
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_packed_batch_mixing_prefill_and_decode(models):
    """Unequal sequences in one packed step, some prefilling (a first or a continued chunk), some
    decoding, a third joining later: each must equal transformers' forward on that sequence alone."""
    hf, ours = models
    seqs = [_ids(23, 7), _ids(9, 8), _ids(31, 9)]
    caches = [ours.new_cache() for _ in seqs]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    steps = [{0: (0, 10), 1: (0, 5)}, {0: (10, 11), 1: (5, 9), 2: (0, 20)}]
    steps += [{i: (n, n + 1) for i, n in ((0, 11 + k), (2, 20 + k)) if n < len(seqs[i])} for k in range(12)]
    for step in steps:
        order = sorted(step)
        logits = ours.forward_batch([seqs[i][slice(*step[i])] for i in order], [caches[i] for i in order])
        for i, lg in zip(order, logits):
            outs[i].append(lg)
    for s, out in zip(seqs, outs):
        torch.testing.assert_close(torch.cat(out), _hf_logits(hf, s), atol=ATOL, rtol=RTOL)


def test_config_rejected_like_transformers():
    bad = {**TEXT, "index_topk": 10}
    with pytest.raises(Exception) as hf_err:
        Glm5NextConfig(text_config=bad, vision_config=VISION)
    with pytest.raises(ModelLoadError) as ours_err:
        from_hf_config({"model_type": "glm5_next", "text_config": bad})
    assert str(ours_err.value) == "index_topk (10) must be divisible by index_kpool (4)."
    assert str(ours_err.value) in str(hf_err.value)


def test_config_defaults_match_transformers():
    hf = Glm5NextConfig().text_config
    ours = from_hf_config({"model_type": "glm5_next", "text_config": {}})
    assert ours.layer_types == hf.layer_types and ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.indexer_types == hf.indexer_types and ours.linear_lower_bound == hf.linear_lower_bound
    assert (ours.num_layers, ours.index_kpool, ours.hc_mult) == (hf.num_hidden_layers, hf.index_kpool, hf.hc_mult)


def test_shared_indexer_without_full_predecessor_is_rejected():
    bad = {**TEXT, "indexer_types": ["full", "shared", *TEXT["indexer_types"][2:]]}
    with pytest.raises(ModelLoadError, match="layer 1 is a 'shared' indexer layer"):
        from_hf_config({"model_type": "glm5_next", "text_config": bad})


def test_missing_and_misshapen_tensors_are_named(models):
    hf, _ = models
    cfg = from_hf_config(hf.config.to_dict())
    drop = "model.language_model.layers.5.mlp.experts.3.down_proj.weight"
    tensors = [(k, v) for k, v in _checkpoint_form(hf.state_dict()) if k != drop]
    with pytest.raises(ModelLoadError, match=r"1 weights are missing.*layers\.5\.mlp\.experts\.3\.down_proj\.weight"):
        load_hf_weights(Glm5NextForCausalLM(cfg), tensors)
    wrong = [(k, v[:, :-1] if k.endswith("layers.1.self_attn.q_b_proj.weight") else v)
             for k, v in _checkpoint_form(hf.state_dict())]
    with pytest.raises(ModelLoadError, match=r"q_b_proj\.weight.*\(16, 23\).*\(16, 24\)"):
        load_hf_weights(Glm5NextForCausalLM(cfg), wrong)


def test_fp8_block_scaled_weights_are_dequantized(models):
    """Store the big projections as FP8 with one scale per 4x4 block, as the published checkpoint does
    with 128x128: the model must equal one loaded from the dequantized float32 weights."""
    hf, _ = models
    cfg = from_hf_config({**hf.config.to_dict(), "quantization_config": {"quant_method": "fp8",
                                                                          "weight_block_size": [4, 4]}})
    assert cfg.fp8_block == (4, 4)
    fp8, plain = [], []
    for name, w in _checkpoint_form(hf.state_dict()):
        if re.search(r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|experts\.\d+\.\w+_proj)\.weight$", name):
            blocks = w.unflatten(0, (-1, 4)).unflatten(2, (-1, 4))  # [R/4, 4, C/4, 4]
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            q = (w / scale.repeat_interleave(4, 0).repeat_interleave(4, 1)).to(torch.float8_e4m3fn)
            fp8 += [(name + "_scale_inv", scale), (name, q)]  # the scale first: the loader must wait for it
            w = q.float() * scale.repeat_interleave(4, 0).repeat_interleave(4, 1)
        else:
            fp8.append((name, w))
        plain.append((name, w))
    a, b = Glm5NextForCausalLM(cfg), Glm5NextForCausalLM(cfg)
    load_hf_weights(a, fp8)
    load_hf_weights(b, plain)
    ids = _ids(20, 13)
    torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_kda_chunk_agrees_with_recurrent(chunk):
    gen = torch.Generator().manual_seed(10)
    args = glm_ops._kda_args(torch.float64, "cpu", gen, 37)
    o_ref, s_ref = glm_ops.kda_recurrent(*args)
    o, s = glm_ops.kda_chunk(*args, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=1e-10)


def test_conv_in_steps_equals_one_pass():
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, state_whole = glm_ops.causal_conv1d(x, w, None)
    state, steps = None, []
    for i in range(9):
        y, state = glm_ops.causal_conv1d(x[i : i + 1], w, state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps), whole)
    torch.testing.assert_close(state, state_whole)


GLM_OPS = ["moe_router", "moe_experts", "kda_recurrent", "kda_chunk", "causal_conv1d", "causal_conv1d_update",
           "gated_rms_norm", "hc_pre",
           "hc_post", "dsa_indexer_topk", "sparse_attention", "dsa_indexer_topk_decode", "latent_attention_decode"]


def test_batched_decode_ops_equal_the_per_sequence_ops():
    """The fixed-shape decode ops (one query per sequence, padded rows) are the per-sequence ops row by row."""
    g = torch.Generator().manual_seed(3)
    x, w, pool = torch.randn(3, 10, generator=g), torch.randn(10, 4, generator=g), torch.randn(5, 3, 10, generator=g)
    slots, before = torch.tensor([4, 1, 2]), pool.clone()
    y = glm_ops.causal_conv1d_update(x, w, pool, slots)
    for i, s in enumerate(slots.tolist()):
        want, state = glm_ops.causal_conv1d(x[i : i + 1], w, before[s])
        torch.testing.assert_close(y[i : i + 1], want)
        torch.testing.assert_close(pool[s], state)
    assert torch.equal(pool[[0, 3]], before[[0, 3]])  # other rows untouched
    b, s, hi, d, p, r = 4, 24, 3, 8, 4, 6
    q, w = torch.randn(b, hi, d, generator=g), torch.randn(b, hi, generator=g)
    keys, gate, ape = torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g), torch.randn(p, d, generator=g)
    lengths = torch.tensor([24, 13, 4, 1])
    for tail in (True, False):
        mask = glm_ops.dsa_indexer_topk_decode(q, w, keys, gate, ape, lengths, 8, tail)
        for i, n in enumerate(lengths.tolist()):
            one = glm_ops.dsa_indexer_topk(q[i : i + 1], w[i : i + 1], keys[i, :n], gate[i, :n], ape, n - 1, 8, tail)
            assert torch.equal(mask[i, :n], one[0]) and not mask[i, n:].any()
    ql, lat = torch.randn(b, 2, r, generator=g), torch.randn(b, s, r, generator=g)
    mask = glm_ops.dsa_indexer_topk_decode(q, w, keys, gate, ape, lengths, 8, True)
    got = glm_ops.latent_attention_decode(ql, lat, mask, 0.3)
    for i, n in enumerate(lengths.tolist()):
        shared = lat[i, :n].unsqueeze(1).expand(-1, 2, -1)
        torch.testing.assert_close(got[i], glm_ops.sparse_attention(ql[i : i + 1], shared, shared, mask[i : i + 1, :n],
                                                                     0.3)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", GLM_OPS)
def test_glm_op_reference_matches_float64(name, dtype):
    """What tests/test_ops.py checks for every registered op, here too until flagdeploy.ops imports glm."""
    from test_ops import _run, _to64

    spec = OPS[name]
    args, kwargs = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(0))
    got = _run(spec, spec.reference, args, kwargs)
    want = _run(spec, spec.reference, [_to64(a) for a in args], kwargs)
    tol = spec.tolerance[dtype]
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, atol=tol.atol, rtol=tol.rtol)
