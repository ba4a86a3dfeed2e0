"""glm5_next through the engine and the CLI: continuous batching, chunked prefill across the KDA
state and preemption give transformers' greedy tokens; `flagdeploy serve --model DIR` answers."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_cli import _free_port, _serve, wait_ready
from test_glm5_next import TEXT, _hf_model

from flagdeploy.backends.cpu import ops as cpu_ops
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer
from flagdeploy.ops.registry import OPS

PROMPTS = [[5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 6, 8],
           [12, 14, 16],
           [33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53]]
STEPS = 10


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    """A tiny random GLM-5.3-Flash checkpoint as transformers saves it, plus a tokenizer: servable."""
    path = tmp_path_factory.mktemp("glm5_next_tiny")
    model = _hf_model()
    model.config.text_config.eos_token_id = None
    model.save_pretrained(path)
    write_word_tokenizer(path, TEXT["vocab_size"])
    return path, model


def _greedy_by_full_forward(model, prompt: list[int]) -> list[int]:
    """The oracle: transformers' full forward over the whole sequence at every step, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("budget,blocks", [(512, 512), (5, 512), (7, 12)], ids=["one-shot", "chunked", "preempted"])
def test_engine_greedy_matches_transformers(glm_dir, budget, blocks):
    path, hf = glm_dir
    want = [_greedy_by_full_forward(hf, p) for p in PROMPTS]
    probe = build_llm_engine(path, "safetensors", EngineConfig(max_model_len=64), chip="cpu", progress=False)
    per_block = probe.runner.bytes_per_block(probe.model, 4)
    state = probe.runner.state_bytes(probe.model, 16)  # the KDA state rows of --max-num-seqs 16 come first
    engine = build_llm_engine(path, "safetensors", EngineConfig(
        max_model_len=40, max_num_batched_tokens=budget, block_size=4, kv_cache_memory=state + blocks * per_block),
        chip="cpu", progress=False)
    assert engine.stats()["kv_blocks_total"] == blocks
    decode, decoded = engine.model.forward_decode, []
    engine.model.forward_decode = lambda ids, *args, **kw: decoded.append(len(ids)) or decode(ids, *args, **kw)
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    assert got == want
    assert decoded and max(decoded) > 1  # steps of decodes only ran batched, through the state rows
    assert engine.runner.state_rows == {}  # every sequence gave its state row back when it finished
    if blocks == 12:
        assert engine.stats()["preemptions"] > 0
    assert engine.stats()["prefix_cache_hit_tokens"] == 0  # KDA state is never resumed from shared blocks


def test_compiled_decode_step_gives_transformers_tokens(glm_dir, monkeypatch, tmp_path, graphs_serve_every_batch):
    """`--compile`: one torch.compile graph (built at start-up on two rows of two blocks) serves batches of
    3 and 1 (a padding row) and block tables of 2 to 9 blocks, on both sides of the width where the
    indexer's pools (4 per block here) outnumber its top-k (16 tokens = 4 pools). Guards are skipped once
    the graph exists: one that had specialised a size would be refused a recompile or give other tokens.
    The experts run the per-expert loop (the path of a real checkpoint's many experts: the dense
    all-expert path is turned off), which reads the routing on the host: one opaque op inside the one
    graph, not a break into pieces. (One build: each costs minutes on a 2-core runner.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, as on a fresh host
    monkeypatch.setitem(cpu_ops.TUNE["moe_experts"], "dense_max_token_experts", 0)
    hf = _hf_model(index_topk=16)
    hf.config.text_config.eos_token_id = None
    hf.save_pretrained(tmp_path / "ckpt")
    write_word_tokenizer(tmp_path / "ckpt", TEXT["vocab_size"])
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    want = [_greedy_by_full_forward(hf, p) for p in PROMPTS]
    engine = build_llm_engine(tmp_path / "ckpt", "safetensors", EngineConfig(max_model_len=40, block_size=4, compile=True),
                              chip="cpu", progress=False)
    assert engine.runner.compiled is not None and engine.runner.compiled.ready  # compiled before any request
    assert engine.generate(PROMPTS, params) == want
    assert engine.generate(PROMPTS[1:2], params) == want[1:2]

    # blocks of 2 tokens under pools of 4 (the default tiny model): the pool count is a floor of the width
    # that the trace fixes; it says so at start-up and the engine decodes eagerly
    path, hf = glm_dir
    engine = build_llm_engine(path, "safetensors", EngineConfig(max_model_len=40, block_size=2, compile=True),
                              chip="cpu", progress=False)
    assert engine.runner.compiled is None
    assert engine.generate(PROMPTS[:1], params) == [_greedy_by_full_forward(hf, PROMPTS[0])]
    # a step that does break (a host read in the step itself) is refused at start-up, not compiled
    # piecewise behind guard-free calls
    monkeypatch.setattr(cpu_ops, "looped_experts", lambda x, routing, *banks: OPS["moe_experts"].reference(x, routing, *banks))
    engine = build_llm_engine(path, "safetensors", EngineConfig(max_model_len=40, block_size=4, compile=True),
                              chip="cpu", progress=False)
    assert engine.runner.compiled is None


def test_serve_answers_chat_with_a_glm5_next_directory(glm_dir):
    path, _ = glm_dir
    port = _free_port()
    proc = _serve("--model", str(path), "--port", str(port), "--max-model-len", "64")
    try:
        url = wait_ready(proc, port)
        body = {"model": path.name, "max_tokens": 6, "messages": [{"role": "user", "content": "w5 w9 w13"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == 6 and data["choices"][0]["finish_reason"] == "length"
        assert data["choices"][0]["message"]["content"].startswith("w")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
