"""A GGUF's quantized linears of every common type on the cpu backend's packed kernels (weight_format "auto").

What users download is mostly Q4_K_M: Q4_K linears with Q6_K ones among them (attn_v and ffn_down of some layers,
the output), and Q5_0 / Q8_0 where a row is not a multiple of 256 values. Q4_0, Q4_1 and Q4_K must arrive as
the 4-bit bundle without loss; the wider types as int8 with a scale per group (Q8_0, Q5_0, Q6_K exactly); and
a model mixing them must decode on the C++ step, bit for bit what the eager step computes, close to the dense
float32 model.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from flagdeploy.checkpoints import gguf_reader
from flagdeploy.checkpoints.tiny_gguf import write_llama_gguf
from flagdeploy.ops.weights import Int4Weight, Int8Weight

# where each type keeps its fp16 scales in a block, and their size: the rest of a block is random bytes
_HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
           T.Q6_K: (208,)}
_SCALE = {T.Q4_0: 1 / 8, T.Q4_1: 1 / 15, T.Q5_0: 1 / 16, T.Q5_1: 1 / 31, T.Q8_0: 1 / 127, T.Q4_K: 1 / (63 * 15),
          T.Q5_K: 1 / (63 * 31), T.Q6_K: 1 / (127 * 32)}
FOUR_BIT = (T.Q4_0, T.Q4_1, T.Q4_K)
WIDER = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0)


def random_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator, peak: float = 0.1) -> np.ndarray:
    """Raw rows [rows, bytes] of valid `kind` blocks: random quants and sub-block scales, fp16 scales (and
    minimums: a second half, negated) that keep the values within about +-peak."""
    block, size = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for i, at in enumerate(_HALVES[kind]):
        half = (rng.uniform(0.5, 1.0, (rows, cols // block)) * peak * _SCALE[kind] * (1 if i == 0 else -0.5))
        data[..., at:at + 2] = half.astype(np.float16)[..., None].view(np.uint8)
    if kind == T.Q6_K:  # as llama.cpp's quantiser writes them: a block's largest sub-scale is 127 or -128
        data[..., 192] = rng.choice(np.array([127, 128], dtype=np.uint8), (rows, cols // block))
    return data.reshape(rows, -1)


def test_every_quantized_type_arrives_as_the_kernels_take_it(tmp_path):
    """4-bit types as Int4Weight, dequantising to the GGUF's own values; the wider ones as int8 with a scale per
    group, exactly where the type is int8 times a scale per group (Q8_0, Q5_0 per 32, Q6_K per 16), else in groups
    of 32 within half a step of the group's grid; floats and non-linears as they were."""
    rng = np.random.default_rng(0)
    path, kinds = tmp_path / "types.gguf", FOUR_BIT + WIDER
    w = GGUFWriter(str(path), "llama")
    for layer, kind in enumerate(kinds):
        w.add_tensor(f"blk.{layer}.ffn_down.weight", random_blocks(kind, 16, 512, rng), raw_dtype=kind)
    w.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(512).astype(np.float32))
    w.add_tensor("token_embd.weight", random_blocks(T.Q6_K, 8, 256, rng), raw_dtype=T.Q6_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    reader = gguf_reader.open_gguf(path)
    cfg = SimpleNamespace(num_heads=1, num_kv_heads=1)
    got = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32, keep_int4=True, keep_int8=True))
    for t in GGUFReader(str(path)).tensors:
        want = dequantize(t.data, t.tensor_type) if t.tensor_type != T.F32 else np.asarray(t.data)
        name = t.name.replace("blk.", "model.layers.").replace("ffn_down", "mlp.down_proj").replace(
            "ffn_norm", "post_attention_layernorm").replace("token_embd", "model.embed_tokens")
        bundle = got[name]
        if t.tensor_type in FOUR_BIT and "down_proj" in name:
            assert isinstance(bundle, Int4Weight) and bundle.group_size == 32, t.tensor_type
            np.testing.assert_allclose(bundle.dequantize(torch.float64).numpy(), want, rtol=0, atol=1e-7 * abs(want).max())
        elif t.tensor_type in WIDER and "down_proj" in name:
            exact = {T.Q8_0: 32, T.Q5_0: 32, T.Q6_K: 16}  # d * q per group: exactly
            assert isinstance(bundle, Int8Weight) and bundle.group_size == exact.get(t.tensor_type, 32), t.tensor_type
            got_w = bundle.dequantize(torch.float64).numpy()
            if t.tensor_type in exact:
                np.testing.assert_array_equal(got_w, want)
            else:  # within half a step of the group's int8 grid
                step = np.abs(want).reshape(16, -1, 32).max(axis=-1, keepdims=True) / 127
                assert (np.abs(got_w - want).reshape(16, -1, 32) <= step / 2 * (1 + 1e-5)).all(), t.tensor_type
        else:  # the embedding and the norm: dense, as they were
            assert isinstance(bundle, torch.Tensor) and torch.equal(bundle, torch.from_numpy(want.astype(np.float32)))
    # without keep_int8 the wider types stay dense, as before
    plain = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32, keep_int4=True))
    assert isinstance(plain["model.layers.3.mlp.down_proj.weight"], torch.Tensor)


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0])
def test_q_and_k_rows_come_back_in_hf_order_with_their_scales(tmp_path, kind):
    """llama.cpp stores q / k rows interleaved for its rope; the bundles un-permute the values and their per-group
    scales alike, so each dequantises to the dense tensor's HF order exactly."""
    path = tmp_path / "qk.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", random_blocks(kind, 32, 256, np.random.default_rng(5)), raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    reader, cfg = gguf_reader.open_gguf(path), SimpleNamespace(num_heads=4, num_kv_heads=4)
    bundle = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32, keep_int4=True, keep_int8=True))
    dense = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dense[name], torch.from_numpy(dequantize(reader.tensors[0].data, kind)))  # rows moved
    torch.testing.assert_close(bundle[name].dequantize(torch.float32), dense[name], rtol=0, atol=1e-7)


# A Q4_K_M-like mix on a small llama whose rows are whole K-quant super-blocks: q / k / gate / up Q4_K, v Q6_K (so
# qkv mixes layouts), o Q5_0, down Q6_K in layer 0 and Q4_K in layer 1, the tied embedding / head Q8_0.
MIX = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_0, "ffn_gate": T.Q4_K,
       "ffn_up": T.Q4_K, "blk.0.ffn_down": T.Q6_K, "blk.1.ffn_down": T.Q4_K, "token_embd": T.Q8_0}


def write_k_quant_llama(path, tokenizer_from, mix: dict = MIX) -> None:
    rng = np.random.default_rng(1)

    def weight(name: str, rows: int, cols: int):
        kind = next(k for part, k in mix.items() if part in name)
        return random_blocks(kind, rows, cols, rng, peak=1.0 if "token_embd" in name else 0.25), kind

    write_llama_gguf(path, tokenizer_from, weight, hidden=256, layers=2, ffn=512, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def k_quant_model(default_model, tmp_path_factory):
    from flagdeploy.checkpoints.source import resolve

    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_k_quant_llama(path, default_model.path)
    return resolve(str(path))


def test_a_q4_k_m_mix_decodes_on_the_cpp_step_close_to_dense(k_quant_model):
    """Every linear packed (Q4_K-only fusions 4-bit, qkv as its Q4_K q, k and Q6_K v pieces, the wider types int8),
    the C++ step serving greedy decoding bit for bit as the eager step, and the prompt's logits close to the dense
    model's."""
    from conftest import make_engine
    from flagdeploy.backends.cpu import native
    from test_cpu_llama_step import _checking
    from test_llama_vs_transformers import _prefill_logits

    from flagdeploy.engine import SamplingParams

    packed = make_engine(k_quant_model, "auto", compile=None, max_num_seqs=2, max_model_len=256)
    layer = packed.model.layers[0]
    kinds = {name: type(getattr(layer, name).qweight).__name__ for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert kinds == {"qkv_proj": "PiecewiseWeight", "o_proj": "Int8Weight", "gate_up_proj": "Int4Weight", "down_proj": "Int8Weight"}
    assert [type(p) for p in layer.qkv_proj.qweight.pieces] == [Int4Weight, Int8Weight]
    assert type(packed.model.layers[1].down_proj.qweight) is Int4Weight
    if native.available() and native.holds_low_bits():  # Q6_K in 6 bits with its own int8 scales
        assert layer.down_proj.qweight.prepared["w8"].shape[-1] == 208
    tok = packed.tokenizer
    ids = tok.encode("The capital of France is")
    if native.available():
        assert packed.runner.native is not None, "the C++ step refused a model whose linears are all packed"
        served = _checking(packed.runner)
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        both, alone = packed.generate([ids, ids[:3]], greedy), packed.generate([ids], greedy)
        assert 1 in served and 2 in served and both[0] == alone[0]
    dense = make_engine(k_quant_model, "dense", max_num_seqs=2, max_model_len=256)
    a, b = _prefill_logits(dense, ids), _prefill_logits(packed, ids)
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert rel < 0.05, f"relative logit drift {rel:.4f} against the dense model"  # measured 0.019


def test_ngram_speculation_on_a_q4_k_m_mix_keeps_greedy_output_exact(k_quant_model):
    """Verify steps through the grouped int8 and the 4-bit kernels (several rows of one sequence at once) give each
    row a lone row's logits: greedy output with ngram speculation equals greedy output without, token for token."""
    from conftest import make_engine

    from flagdeploy.engine import SamplingParams
    from flagdeploy.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    on = make_engine(k_quant_model, "auto", compile=None, max_num_seqs=2, max_model_len=256, speculative=spec)
    off = make_engine(k_quant_model, "auto", compile=None, max_num_seqs=2, max_model_len=256)
    ids = on.tokenizer.encode("one two three four five six one two three four five six one two three")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    rows = []
    run = on.runner.execute
    on.runner.execute = lambda step: rows.append(len(step.ids)) or run(step)
    assert on.generate([ids], greedy) == off.generate([ids], greedy)
    assert max(rows[1:]) > 1, "no verify step ran: the test would not see a verify row differ"


@pytest.mark.parametrize("packed", [True, False], ids=["pieces where both kernels run", "a dense copy elsewhere"])
def test_a_fused_linear_of_mixed_layouts_keeps_each_part_as_the_file_holds_it(packed):
    """A Q4_K q and k beside a Q6_K v: where the backend runs both layouts natively (the cpu) the fused linear holds
    them as two pieces, q and k joined 4-bit and v int8, exactly the parts' own values, and its output is the
    pieces' outputs side by side with the bias after; elsewhere (a backend that makes a dense copy at load, as cuda
    does) the exact dense join, as before."""
    from dataclasses import replace

    from flagdeploy import ops
    from flagdeploy.models.linear import Linear
    from flagdeploy.ops.weights import PiecewiseWeight

    g = torch.Generator().manual_seed(3)

    def int4(rows):
        return Int4Weight(torch.randint(0, 16, (rows, 64), generator=g, dtype=torch.uint8),
                          torch.rand(rows, 2, generator=g) * 0.01, torch.randn(rows, 2, generator=g) * 0.01, 32, rows, 64)

    q, k, v = int4(64), int4(32), Int8Weight.quantize(torch.randn(32, 64, generator=g) * 0.05, 16)
    bias = {"q_proj": torch.randn(64, generator=g), "k_proj": torch.randn(32, generator=g), "v_proj": torch.randn(32, generator=g)}
    want = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    cpu, x = ops.active_backend(), torch.randn(3, 64, generator=g)

    def fused(backend) -> Linear:
        ops.use_backend(backend)
        try:
            lin = Linear(128, 64, torch.float32, ("q_proj", "k_proj", "v_proj"), bias=True)
            for part, w in zip(lin.parts, (q, k, v)):
                lin.load_part(part, "weight", w)
                lin.load_part(part, "bias", bias[part])
            lin.finalize()
            return lin
        finally:
            ops.use_backend(cpu)

    if packed:
        canonical = fused(replace(cpu, prepare={})).qweight  # the pieces as finalize made them, before packing
        assert isinstance(canonical, PiecewiseWeight) and [type(p) for p in canonical.pieces] == [Int4Weight, Int8Weight]
        assert [p.out_features for p in canonical.pieces] == [96, 32]
        assert torch.equal(canonical.dequantize(), want)  # exact: no rounding
        lin = fused(cpu)
        y = lin(x)
        for p, (a, b) in zip(lin.qweight.pieces, ((0, 96), (96, 128))):  # each piece through its kernel, the bias after
            op = ops.linear_w4a16 if isinstance(p, Int4Weight) else ops.linear_w8a16
            assert torch.equal(y[:, a:b], op(x, p, None) + torch.cat(list(bias.values()))[a:b].to(y.dtype))
    else:
        lin = fused(replace(cpu, packed_weights=()))
        assert lin.qweight is None and torch.equal(lin.weight, want)
        y = lin(x)
    torch.testing.assert_close(y.float(), x @ want.T + torch.cat(list(bias.values())), rtol=0.02, atol=0.02)


def test_a_q6_k_head_loads_as_the_file_holds_it_where_the_kernels_hold_6_bits(default_model, tmp_path):
    """A tied Q6_K token embedding (what llama.cpp's K-quant mixes give a tied head): where the backend's int8 kernels
    hold 6-bit values (AVX-512 builds) the head is the file's own values, exactly, packed in 6 bits with Q6_K's
    scales (6.6 bits a weight, not per-channel int8's 8), the embedding still dense for the lookups; elsewhere per
    channel as before. Either way the C++ step decodes as the eager step does."""
    from conftest import make_engine
    from test_cpu_llama_step import _checking

    from flagdeploy import ops
    from flagdeploy.checkpoints.source import resolve
    from flagdeploy.engine import SamplingParams

    path = tmp_path / "tiny-q6_k-head.gguf"
    write_k_quant_llama(path, default_model.path, {**MIX, "token_embd": T.Q6_K})
    engine = make_engine(resolve(str(path)), "auto", compile=None, max_num_seqs=2, max_model_len=256)
    model, head = engine.model, engine.model.lm_head.qweight
    if ops.active_backend().int8_low_bits():
        # the file's Q6_K as its exact int8 per 16 (test_every_quantized_type...), in 6 bits and its own int8 scales
        assert not model.cfg.tie_word_embeddings and head.group_size == 16 and head.prepared["w8"].shape[-1] == 208
        assert model.embed_tokens.dtype == model.dtype  # still dense, for the lookups
    else:
        assert head.group_size == 0
    ids = engine.tokenizer.encode("The capital of France is")
    if engine.runner.native is not None:
        served = _checking(engine.runner)
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        assert engine.generate([ids, ids[:3]], greedy)[0] == engine.generate([ids], greedy)[0] and 2 in served
