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
from flagdeploy.loaders import gguf_reader
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


@pytest.fixture(scope="module")
def engines(default_model, llm_engine):
    return llm_engine, make_engine(default_model, "auto")


@pytest.mark.parametrize("prompt_through", ["dense copy", "few-row kernel"])
def test_packed_model_stays_close_to_dense(engines, prompt_through, monkeypatch):
    """A prompt's rows normally go through the dense copy of the 4-bit weights; forced through the few-row
    kernel (decode's: the cpu backend's int4 x int8 one where it builds), the model stays as close."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    if prompt_through == "few-row kernel":
        monkeypatch.setitem(cpu_ops.TUNE["linear_w4a16"], "packed_max_m", 4096)
    dense, packed = engines
    assert any(lin.qweight is not None for lin in packed.model.modules() if hasattr(lin, "qweight"))
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
    kernel; prompt tokens take the dense copy whatever their number, so the logprobs do not move."""
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
