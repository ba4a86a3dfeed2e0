"""GLM-5.3-Flash's own MTP draft layer (`--speculative mtp`): the checkpoint layout and loading (and the
refusal of a checkpoint without the layer), the proposer's paged catch-up and draft chain against a
standalone computation, a draft layer built to agree with its target accepting nearly every draft, and a
random one staying exact (batched, preempted, aborted) against speculation off."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import (
    TIED_INDEXER,
    agreeing_mtp_layer,
    counting_indexer_ties,
    generate_with_an_abort,
    graphs_on_the_cpu,
    greedy_in_every_arrangement,
    ties_keep_the_lower_index,
)
from safetensors import safe_open

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine import mtp as engine_mtp
from flagdeploy.engine.replica import build_llm_engine, load_model
from flagdeploy.engine.mtp import MtpProposer, MtpState
from flagdeploy.engine.llm_engine import build_proposer
from flagdeploy.engine.speculative import SpeculativeConfig
from flagdeploy.errors import ModelLoadError
from flagdeploy.checkpoints.tiny_checkpoint import (
    TEXT_PREFIX,
    TINY_TEXT,
    write_tiny_glm5_next,
)
from flagdeploy.models.glm5_next import MlaCache, MoE
from flagdeploy.planner.shapes import checkpoint_tensors

N = TINY_TEXT["num_hidden_layers"]  # the MTP layer's index
MTP3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19, 23, 29], [12, 14, 16], [33, 35, 37, 39, 41, 43, 45]]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_tiny_glm5_next(tmp_path_factory.mktemp("glm5_mtp") / "ckpt", mtp=True, seed=3)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return write_tiny_glm5_next(tmp_path_factory.mktemp("glm5_plain") / "ckpt", seed=3)


def _engine(path, spec: SpeculativeConfig | None = None, chip: str = "cpu", **options) -> object:
    cfg = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4, "weight_format": "dense",
           "kv_cache_memory": 64 << 20}
    cfg.update(options)
    return build_llm_engine(path, "safetensors", EngineConfig(speculative=spec or SpeculativeConfig(), **cfg),
                            chip=chip, progress=False)


def _stored(path, name: str) -> torch.Tensor:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(path / index[name], framework="pt") as f:
        return f.get_tensor(name)


# ---- checkpoint layout and loading --------------------------------------------------------------------

def test_tiny_checkpoint_ships_the_planner_layout(mtp_dir, tmp_path):
    """The MTP tensors written (and read by the model's slots) are the planner's `include_mtp` layout, FP8
    where the main layers' MLA / MoE projections are; the config says so."""
    config = json.loads((mtp_dir / "config.json").read_text())
    assert config["text_config"]["num_nextn_predict_layers"] == 1
    want = {n: s for n, s in checkpoint_tensors(config, include_mtp=True) if n.startswith(f"{TEXT_PREFIX}layers.{N}.")}
    index = json.loads((mtp_dir / "model.safetensors.index.json").read_text())["weight_map"]
    got = {n for n in index if n.startswith(f"{TEXT_PREFIX}layers.{N}.")}
    assert got == set(want) and len(want) > 20
    assert all(tuple(_stored(mtp_dir, n).shape) == s for n, s in want.items())

    fp8 = write_tiny_glm5_next(tmp_path / "fp8", mtp=True, fp8=True)
    names = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    p = f"{TEXT_PREFIX}layers.{N}."
    for name in ("self_attn.q_a_proj.weight", "self_attn.o_proj.weight", "mlp.experts.3.down_proj.weight",
                 "mlp.shared_experts.gate_proj.weight"):
        assert _stored(fp8, p + name).dtype == torch.float8_e4m3fn and p + name + "_scale_inv" in names
    for name in ("eh_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.indexer.wk.weight"):
        assert _stored(fp8, p + name).dtype == torch.bfloat16
    model, _ = load_model(fp8, "safetensors", torch.float32, "cpu", progress=False, mtp=True)
    assert model.mtp is not None


def test_loading_attaches_the_layer_and_refuses_a_checkpoint_without_one(mtp_dir, plain_dir, tmp_path):
    model, _ = load_model(mtp_dir, "safetensors", torch.float32, "cpu", progress=False, mtp=True)
    p = f"{TEXT_PREFIX}layers.{N}."
    assert torch.equal(model.mtp.eh_proj.weight, _stored(mtp_dir, p + "eh_proj.weight").float())
    assert torch.equal(model.mtp.head_norm, _stored(mtp_dir, p + "shared_head.norm.weight").float())
    assert torch.equal(model.mtp.mlp.experts.down[5], _stored(mtp_dir, p + "mlp.experts.5.down_proj.weight").float())
    assert isinstance(model.mtp.mlp, MoE) and model.mtp.attn.indexer is not None

    # without the flag the model is the plain one: no draft layer, no pool, no bytes per token for it
    plain, _ = load_model(mtp_dir, "safetensors", torch.float32, "cpu", progress=False)
    assert plain.mtp is None and N not in plain.cache_pools(2, 4, 1)
    c = plain.cfg
    extra = (c.kv_lora_rank + 2 * c.index_head_dim) * 4
    assert model.cache_bytes_per_token() == plain.cache_bytes_per_token() + extra
    assert set(model.cache_pools(2, 4, 1)[N]) == {"latent", "index_keys", "index_gate"}
    assert sum(p.numel() for p in model.parameters()) > sum(p.numel() for p in plain.parameters())
    with pytest.raises(ValueError, match="MTP draft layer"):
        build_proposer(MTP3, plain)

    # a checkpoint without the layer: refused before any weight is read, with what to do instead
    with pytest.raises(ModelLoadError, match=rf"has no MTP layer \(layers\.{N}\.eh_proj\.weight missing\).*"
                                             "--speculative ngram or off"):
        _engine(plain_dir, MTP3)
    two = write_tiny_glm5_next(tmp_path / "two", num_nextn_predict_layers=2)
    with pytest.raises(ModelLoadError, match="2 MTP layers.*exactly 1"):
        load_model(two, "safetensors", torch.float32, "cpu", progress=False, mtp=True)
    none = write_tiny_glm5_next(tmp_path / "none", num_nextn_predict_layers=0)
    with pytest.raises(ModelLoadError, match="has no MTP layer.*num_nextn_predict_layers is 0"):
        load_model(none, "safetensors", torch.float32, "cpu", progress=False, mtp=True)


# ---- the proposer against a standalone computation ------------------------------------------------------

class _Seq:
    def __init__(self, tokens, table):
        self.token_ids, self.block_table, self.draft_state = list(tokens), table, None

    @property
    def num_tokens(self):
        return len(self.token_ids)


def _standalone(model, tokens, hidden, k):
    """The drafts from scratch, one unpaged cache: the layer over positions 0..T-2 in one call (t_{i+1}
    and h_i), then k - 1 chain steps on its own block output and the previous draft; and the cache."""
    layer, t = model.mtp, len(tokens)
    cache = MlaCache()
    logits, x = layer.forward_packed(model, torch.tensor(tokens[1:]), hidden[: t - 1], [(0, t - 1, 0)], [cache], [t - 2])
    drafts, last = [int(logits[0].argmax())], x[t - 2]
    for j in range(1, k):
        logits, x = layer.forward_packed(model, torch.tensor([drafts[-1]]), last[None], [(0, 1, t - 1 + j - 1)],
                                         [cache], [0])
        drafts.append(int(logits[0].argmax()))
        last = x[0]
    return drafts, cache


def test_proposer_catch_up_and_chain_equal_a_standalone_computation(mtp_dir, monkeypatch):
    model, _ = load_model(mtp_dir, "safetensors", torch.float32, "cpu", progress=False, mtp=True)
    bs, hsize = 4, model.cfg.hidden_size
    pools = model.cache_pools(16, bs, 2)
    proposer = MtpProposer(model)
    proposer.bind(type("Runner", (), {"pools": pools, "group": 4, "block_size": bs, "scratch_block": 15})())
    gen = torch.Generator().manual_seed(0)
    hidden_a, hidden_b = torch.randn(20, hsize, generator=gen), torch.randn(20, hsize, generator=gen)
    a = _Seq([3, 17, 9, 44, 21, 8, 30, 12], [5, 2, 7, 0, 9])  # 7 prompt tokens and the first output token
    b = _Seq([40, 41, 6, 7], [11, 3, 14])

    # a prompt in two chunks, then the first propose: the catch-up runs the layer over positions 0..6
    proposer.observe(a, 0, hidden_a[:4])
    proposer.observe(a, 4, hidden_a[4:7])
    assert a.draft_state.num_pending == 7
    got = proposer.propose([a], [3])
    want, cache = _standalone(model, a.token_ids, hidden_a, 3)
    assert got == [want]
    st = a.draft_state
    assert (st.cached, st.num_pending) == (7, 0)
    # the catch-up wrote the real positions into the pools, the chain wrote nothing past them
    paged = model.mtp.paged_cache(pools[N], a.block_table, 7)
    assert torch.allclose(paged.latent.all(), cache.latent.all()[:7], atol=1e-5)
    assert torch.allclose(paged.index_keys.all(), cache.index_keys.all()[:7], atol=1e-5)
    flat = pools[N]["latent"].view(-1, model.cfg.kv_lora_rank)
    beyond = [a.block_table[p // bs] * bs + p % bs for p in range(7, 20)]
    assert not flat[beyond].any()
    assert proposer.propose([a], [3]) == [want]  # nothing new observed: the same drafts again

    # a verify step accepted two drafts (3 new positions) while b arrives; both in one batch, b with k = 1
    a.token_ids += [50, 51, 52]
    proposer.observe(a, 7, hidden_a[7:10])
    proposer.observe(b, 0, hidden_b[:3])
    got = proposer.propose([b, a], [1, 2])
    assert got == [_standalone(model, b.token_ids, hidden_b, 1)[0], _standalone(model, a.token_ids, hidden_a, 2)[0]]
    assert (a.draft_state.cached, b.draft_state.cached) == (10, 3)

    # rows observed past MAX_PENDING_ROWS are run through the layer at once (a long prompt, no propose)
    monkeypatch.setattr(engine_mtp, "MAX_PENDING_ROWS", 2)
    b.token_ids += [60, 61]
    proposer.observe(b, 3, hidden_b[3:5])
    assert (b.draft_state.cached, b.draft_state.num_pending) == (5, 0)
    assert proposer.propose([b], [3]) == [_standalone(model, b.token_ids, hidden_b, 3)[0]]

    # a restart (preemption: start 0) forgets everything; a gap in the positions means no drafts
    proposer.observe(b, 0, hidden_b[:1])
    assert b.draft_state.cached == 0 and b.draft_state.num_pending == 1
    proposer.observe(a, 12, hidden_a[12:13])
    assert a.draft_state.broken and proposer.propose([a], [3]) == [[]]
    proposer.release(a)
    assert a.draft_state is None
    assert isinstance(b.draft_state, MtpState)


# ---- through the engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_an_agreeing_draft_layer_is_accepted(mtp_dir, graphed, monkeypatch):
    on = _engine(mtp_dir, MTP3)
    if graphed:  # the decode and verify steps through the graphs' code (a CPU stand-in replays them)
        graphs_on_the_cpu(on, monkeypatch)
    agreeing_mtp_layer(on.model)
    # speculation off: the target's greedy chain, the next token a function of the current one alone
    nxt: dict[int, int] = {}

    def f(t: int) -> int:
        if t not in nxt:
            nxt[t] = int(on.model.forward(torch.tensor([t]))[0].argmax())
        return nxt[t]

    want = []
    for p in PROMPTS:
        out = [f(p[-1])]
        while len(out) < GREEDY.max_tokens:
            out.append(f(out[-1]))
        want.append(out)
    assert on.generate(PROMPTS, GREEDY) == want
    stats = on.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"] > 0.9
    assert stats["steps"] <= 2 + GREEDY.max_tokens // 2  # a prefill, then mostly 4 tokens per step
    if graphed:
        assert on.runner.verify_graphs.graphs and on.proposer.graphs.graphs


def _assert_idle(engine):
    assert not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.runner.state_rows == {}  # every sequence gave its KDA state rows back


@pytest.fixture(scope="module")
def reference(mtp_dir):
    """The prompts' greedy tokens with speculation off (dense float32), batched."""
    return _engine(mtp_dir).generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def spec_engine(mtp_dir):
    """The same checkpoint with a random MTP layer drafting K=3 (tests leave it idle)."""
    return _engine(mtp_dir, MTP3)


def test_a_random_draft_layer_is_exact_batched_and_aborted(spec_engine, reference):
    on = spec_engine
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # still running at the abort
    assert generate_with_an_abort(on, PROMPTS, GREEDY, [7, 8, 9, 10, 11], abort_at=4, victim_params=long) == reference
    assert on.stats()["spec_decode_num_draft_tokens"] > 0
    _assert_idle(on)
    assert on.generate(PROMPTS[:1], GREEDY) == reference[:1]  # again, alone: the same tokens
    _assert_idle(on)


def test_a_random_draft_layer_is_exact_under_preemption(mtp_dir, spec_engine, reference):
    probe = spec_engine
    per_block = probe.runner.bytes_per_block(probe.model, 4)  # the MTP layer's rows included
    state = (64 << 20) - probe.stats()["kv_blocks_total"] * per_block  # what the state rows take (or a bit more)
    tight = _engine(mtp_dir, MTP3, max_model_len=40, kv_cache_memory=state + 10 * per_block, max_num_batched_tokens=8)
    assert tight.stats()["kv_blocks_total"] == 10
    assert tight.generate(PROMPTS, GREEDY) == reference
    assert tight.stats()["preemptions"] > 0 and tight.stats()["spec_decode_num_draft_tokens"] > 0
    _assert_idle(tight)


def _recording_drafts(engine) -> list:
    """Every draft list the engine's proposer returns, in order."""
    drafts, propose = [], engine.proposer.propose

    def record(seqs, limits):
        out = propose(seqs, limits)
        drafts.append(out)
        return out

    engine.proposer.propose = record
    return drafts


# Over NCCL where two GPUs are lent (skipped elsewhere): the one-GPU engine is the reference there.
CHIPS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                               reason="needs two CUDA devices (NCCL)"))]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_the_draft_layer_splits_over_ranks_like_the_target(mtp_dir, reference, tp, ep, chip):
    """Under --tp / --ep every rank holds its shard of the MTP layer (heads, experts, vocabulary) and runs
    each catch-up and draft step rank 0's proposer plans (the hidden rows travel over the collective): the
    tokens are speculation off's and every draft is the one-process proposer's."""
    if chip != "cpu":
        reference = _engine(mtp_dir, chip=chip).generate(PROMPTS, GREEDY)
    one = _engine(mtp_dir, MTP3, chip=chip)
    want = _recording_drafts(one)
    assert one.generate(PROMPTS, GREEDY) == reference
    split = _engine(mtp_dir, MTP3, chip=chip, tp=tp, ep=ep)
    try:
        got = _recording_drafts(split)
        assert split.generate(PROMPTS, GREEDY) == reference
        _assert_idle(split)
    finally:
        split.close()
    assert sum(len(d) for step in want for d in step) > 0
    assert got == want


# ---- greedy output is a function of the request alone (issue 55) ----------------------------------------


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A checkpoint whose indexer scores tie exactly at the top-k cut (conftest.py TIED_INDEXER)."""
    return write_tiny_glm5_next(tmp_path_factory.mktemp("glm5_tied") / "ckpt", mtp=True, **TIED_INDEXER)


NGRAM4 = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
LONG_GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_greedy_tokens_at_indexer_ties_do_not_depend_on_the_batch_or_speculation(tied_dir, monkeypatch, one_thread):
    """The same greedy requests alone, in batches of 2 and 4 beside prompts of other lengths (block tables
    of other widths) and all together, with speculation off, ngram K=4 and mtp K=3: the same tokens, in
    a checkpoint whose indexer meets exact ties at its top-k cut (counted). With torch.topk's own choice
    among equal scores (which follows the padded row's width) the arrangements gave different text."""
    ties = counting_indexer_ties(monkeypatch)
    want = None
    for spec in (None, NGRAM4, MTP3):
        engine = _engine(tied_dir, spec, max_model_len=96)
        got = greedy_in_every_arrangement(engine, LONG_GREEDY)
        want = want or got["alone"]
        for arrangement, outputs in got.items():
            assert outputs == want, (spec and spec.method, arrangement)
        if spec is not None:
            assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert ties[0] > 0


def test_transformers_gives_the_same_tokens_once_its_ties_keep_the_lower_pool(tied_dir, one_thread):
    """The oracle at ties. transformers' indexer keeps torch.topk's choice among equal scores, which
    depends on the row's width (the sequence's pool count at each step): on this checkpoint its greedy
    tokens differ from ours at a tie. With torch.topk keeping the lower index of equal scores (patched for
    the oracle's run only) its full forwards give our tokens."""
    transformers = pytest.importorskip("transformers")
    from conftest import TIE_PROMPTS

    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(tied_dir, dtype=torch.float32).eval()
    steps = 12

    def full_forwards(prompt):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    prompts = [TIE_PROMPTS[0], TIE_PROMPTS[3]]
    ours = _engine(tied_dir, max_model_len=96).generate(prompts, SamplingParams(max_tokens=steps, temperature=0,
                                                                                 ignore_eos=True))
    assert [full_forwards(p) for p in prompts] != ours  # transformers as it is: torch.topk's choice at the ties
    with ties_keep_the_lower_index():
        assert [full_forwards(p) for p in prompts] == ours


# ---- what --speculative mtp compiles, and how a refusal is logged (issue 55) -----------------------------


def test_mtp_compiles_no_decode_step_and_reports_none(mtp_dir, caplog):
    """The MTP proposer reads the target's hidden states, which the compiled decode step does not return,
    and verify steps never run through it: nothing is compiled, neither in the background (the default,
    which this model would otherwise get) nor with --compile (a warning says it is unused), and the
    metrics say decode_step_compiled 0."""
    from flagdeploy.engine.model_runner import _background_compile_fits

    for compile in (None, True):
        with caplog.at_level(logging.WARNING, logger="flagdeploy.engine.model_runner"):
            engine = _engine(mtp_dir, MTP3, compile=compile)
        assert _background_compile_fits(engine.model)  # (speculation off would compile it in the background)
        assert engine.runner.keep_hidden and engine.runner.compiled is None and engine.runner.compiling is None
        stats = engine.stats()
        assert stats["decode_step_compiled"] == 0 and stats["decode_step_compiling"] == 0
        warned = "--compile is not used with --speculative mtp" in caplog.text
        assert warned == bool(compile)
        caplog.clear()
    assert engine.generate(PROMPTS[:1], GREEDY)  # (and it serves)


def test_a_refused_checkpoint_is_logged_as_one_line_and_a_bug_with_its_traceback(plain_dir, caplog):
    """A server asked for --speculative mtp on a checkpoint without the layer logs the refusal as one line
    (a FlagdeployError: the message says what to do) and keeps answering 503 with it; an unexpected
    exception while loading still logs its traceback."""
    from flagdeploy.server.engine_slot import EngineSlot

    slot = EngineSlot(lambda: _engine(plain_dir, MTP3))
    with caplog.at_level(logging.INFO, logger="flagdeploy.server.engine_slot"):
        slot._load()
    assert slot.engine is None and "has no MTP layer" in slot.error
    [record] = [r for r in caplog.records if r.name == "flagdeploy.server.engine_slot"]
    assert record.exc_info is None and "Traceback" not in caplog.text and len(caplog.text.splitlines()) == 1

    def bug():
        raise RuntimeError("an index out of range somewhere")

    caplog.clear()
    slot = EngineSlot(bug)
    with caplog.at_level(logging.INFO, logger="flagdeploy.server.engine_slot"):
        slot._load()
    [record] = [r for r in caplog.records if r.name == "flagdeploy.server.engine_slot"]
    assert record.exc_info is not None and "Traceback" in caplog.text and "in bug" in caplog.text
