"""weight_format="auto": a GGUF's 4-bit linears stay packed (int4) and the head goes int8.

The Q4 blocks must arrive without loss (the packed weights dequantise to exactly what the GGUF's own
dequantiser gives), and the model must stay close to the dense float32 one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from conftest import make_engine
from flagdeploy.engine import SamplingParams
from flagdeploy.checkpoints import gguf_reader
from flagdeploy.ops.weights import Int4Weight


def test_q4_blocks_are_read_without_loss(default_model):
    reader = gguf_reader.open_gguf(default_model.path)
    cfg = gguf_reader.read_config(reader)
    raw = {t.name: t for t in reader.tensors}
    got = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32, keep_int4=True))
    w = got["model.layers.3.mlp.down_proj.weight"]
    assert isinstance(w, Int4Weight)
    t = raw["blk.3.ffn_down.weight"]
    want = dequantize(t.data, t.tensor_type)
    np.testing.assert_allclose(w.dequantize(torch.float64).numpy(), want, rtol=0, atol=1e-6)
    # q/k rows come back in HF order in both forms
    dense = dict(gguf_reader.iter_tensors(reader, cfg, torch.float32))
    q = got["model.layers.0.self_attn.q_proj.weight"].dequantize(torch.float32)
    torch.testing.assert_close(q, dense["model.layers.0.self_attn.q_proj.weight"], atol=1e-6, rtol=0)


@pytest.fixture(scope="module", params=["dense copy", "packed only"])
def engines(request, default_model, llm_engine):
    """The dense float32 engine, and the packed one with its prompts through a dense copy of the 4-bit weights
    (tune.yaml's `dense_copy: true`, the AVX-512 tables') or through the packed kernels alone (`false`: the AVX2
    table). The choice is made when the weights are prepared; the table goes back afterwards."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    with pytest.MonkeyPatch.context() as mp:
        for op in ("linear_w4a16", "linear_w8a16"):
            mp.setitem(cpu_ops.TUNE[op], "dense_copy", request.param == "dense copy")
        packed = make_engine(default_model, "auto")
    own = [b for m in packed.model.modules() if getattr(m, "qweight", None) is not None
           for b in [m.qweight.prepared] if "nib" in b or "w8" in b]  # the backend's own kernels' bundles
    assert own and all(("dense" in b) == (request.param == "dense copy") for b in own)
    return llm_engine, packed


def test_packed_model_stays_close_to_dense(engines):
    """Whichever kernel a prompt's rows take (the dense copy, or the few-row kernel of decode: the cpu backend's
    int4 x int8 one where it builds), the packed model stays close to the dense one."""
    dense, packed = engines
    tok = dense.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write two sentences about the ocean."}]))
    from test_llama_vs_transformers import _prefill_logits

    a, b = _prefill_logits(dense, ids), _prefill_logits(packed, ids)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement with dense only {agree:.2f}"
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert rel < 0.1, f"relative logit drift {rel:.3f}"  # measured 0.072 (bf16 copy), 0.051 (int4 x int8 kernel)


def test_packed_model_answers(engines):
    _, packed = engines
    tok = packed.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = packed.generate([ids], SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in tok.decode(out)


def test_packed_prompt_computes_the_same_after_a_prefix_cache_hit(engines):
    """A cached prompt leaves only its last few tokens to compute, few enough rows for the packed int4
    kernel; prompt tokens take the dense copy whatever their number, or (no dense copy kept) the packed kernel
    whatever their number, so the logprobs do not move."""
    _, packed = engines
    tok = packed.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe, please."}]))

    def logprobs(rid: str) -> list[float]:
        packed.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True))
        got: list[float] = []
        while rid in packed.requests:
            got += [lp.logprob for out in packed.step() if out.request_id == rid for lp in out.logprobs or []]
        return got

    first = logprobs("cold")
    before = packed.stats()["prefix_cache_hit_tokens"]
    second = logprobs("cached")
    assert packed.stats()["prefix_cache_hit_tokens"] - before >= (len(ids) - 1) // 16 * 16 > 0
    assert len(first) == 4 and second == first


# ---- the GGUF header and tensor table (checkpoints/gguf_file.py) ---------------------------------------------


def _same_as_gguf_reader(path, nested: frozenset[str] = frozenset()) -> None:
    """Every key and tensor of our one-pass reader equals what gguf's own GGUFReader parses (but `nested`
    arrays of arrays, which its `contents()` flattens into one list)."""
    from gguf import GGUFReader

    from flagdeploy.checkpoints.gguf_file import GGUFFile

    ours, theirs = GGUFFile(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # GGUFReader's own header entries
    assert sorted(ours.keys()) == sorted(keys)
    for k in keys:
        want = theirs.fields[k].contents()
        assert (sum(ours.get(k), []) if k in nested else ours.get(k)) == want, k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data)


def test_gguf_file_reads_every_value_type_and_tensor_layout(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "all.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "", "ßz"])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    for kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        data = quantize(rng.standard_normal((4, 64)).astype(np.float32), kind)
        w.add_tensor(f"q.{kind.name}", data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path, nested=frozenset({"t.nested"}))
    from flagdeploy.checkpoints.gguf_file import GGUFFile

    f = GGUFFile(path)
    assert f.get("t.nested") == [[1, 2], [3]] and f.array_len("t.strs") == 3 and f.get("absent", 7) == 7


def test_gguf_file_reads_the_default_model_as_gguf_does(default_model):
    _same_as_gguf_reader(default_model.path)
