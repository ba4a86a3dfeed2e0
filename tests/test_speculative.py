"""Speculative decoding with prompt-lookup drafts: the proposer, exactness against speculation off on the
default model (batched, prefix-cache hits, an abort, preemption), no leaked blocks, the metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import generate_with_an_abort, make_engine

from flagdeploy.engine import SamplingParams
from flagdeploy.engine.llm_engine import build_proposer
from flagdeploy.engine.speculative import NgramProposer, SpeculativeConfig

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
EDIT = ("Repeat this sentence exactly, fixing the typo: The quick brown fox jumsp over the lazy dog "
        "and runs into the forest.")
QUESTIONS = [EDIT, "Name a color.", "Count from one to ten in words."]


# ---- the proposer and the config --------------------------------------------------------------------

def test_ngram_proposer_drafts_the_most_recent_longest_match():
    p = NgramProposer(1, 3)
    assert p.lookup(np.array([1, 2, 3, 4, 5, 9, 2, 3]), 3) == [4, 5, 9]
    assert p.lookup(np.array([1, 2, 3, 7, 2, 3, 8, 9, 2, 3]), 3) == [8, 9, 2]  # the latest of two matches
    # a longer match wins over a more recent shorter one: [7, 2, 3] occurs at 0..2, [2, 3] later too
    assert p.lookup(np.array([7, 2, 3, 4, 4, 2, 3, 5, 7, 2, 3]), 2) == [4, 4]
    assert p.lookup(np.array([1, 2, 3, 4, 5, 9, 2, 3]), 1) == [4]  # capped at k
    assert p.lookup(np.array([1, 2, 3, 4, 5, 3]), 9) == [4, 5, 3]  # up to the end of the history
    assert NgramProposer(2, 3).lookup(np.array([1, 2, 3, 4, 3]), 3) == []  # only a 1-gram recurs
    assert p.lookup(np.array([5]), 3) == [] and p.lookup(np.array([1, 2, 1]), 0) == []
    assert NgramProposer(1, 5).lookup(np.array([4, 4, 4, 4]), 3) == [4]  # overlapping match: what follows it


def test_ngram_proposer_is_cheap_and_incremental():
    import time

    class Seq:
        def __init__(self, ids):
            self.token_ids, self.draft_state = ids, None

        @property
        def num_tokens(self):
            return len(self.token_ids)

    rng = np.random.default_rng(0)
    seq = Seq(rng.integers(0, 49152, 4096).tolist())
    p = NgramProposer(1, 5)
    p.propose([seq], [4])
    seq.token_ids.extend([1, 2, 3])
    t = time.perf_counter()
    for _ in range(20):
        drafts = p.propose([seq], [4])
    per_call = (time.perf_counter() - t) / 20
    assert isinstance(drafts[0], list)
    assert per_call < 2e-3  # a 4k context: well under a decode step (tens of ms on two cores)
    assert seq.draft_state[1] == 4099


def test_config_parsing_and_refusals():
    c = SpeculativeConfig.parse(config_json='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig(method="ngram").prompt_lookup_min == 5  # vLLM's default when neither is given
    c = SpeculativeConfig.parse("ngram", 2, '{"method":"mtp","num_speculative_tokens":5}')  # flags win
    assert (c.method, c.num_speculative_tokens) == ("ngram", 2)
    assert SpeculativeConfig.parse(config_json='{"method":"glm5_next_mtp"}').method == "mtp"
    assert not SpeculativeConfig.parse(None, None, None).enabled
    assert SpeculativeConfig.parse(config_json=c.as_json()) == c
    for bad in ('{"method":"eagle"}', '{"method":"ngram","draft_model":"x"}', "[1]", "{"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(config_json=bad)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="needs a method"):
        SpeculativeConfig.parse(None, 3, None)
    with pytest.raises(ValueError, match="MTP draft layer"):  # a model without one (tests/test_mtp.py: with one)
        build_proposer(SpeculativeConfig(method="mtp"))


# ---- exactness on the default model ---------------------------------------------------------------

def _ids(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def reference(llm_engine):
    """Each prompt's greedy output alone, speculation off (dense float32: batch-invariant kernels)."""
    return [llm_engine.generate([_ids(llm_engine, q)], GREEDY)[0] for q in QUESTIONS]


def _assert_no_leaks(engine):
    assert not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(r == 0 for r in engine.blocks.ref)


@pytest.fixture(scope="module")
def spec_engine(default_model):
    """The dense engine with ngram speculation (tests leave it idle)."""
    return make_engine(default_model, "dense", speculative=NGRAM)


def test_batched_prefix_hit_and_abort_give_the_same_tokens(spec_engine, reference):
    spec = spec_engine
    prompts = [_ids(spec, q) for q in QUESTIONS]
    # an extra request in the batch, aborted after a few steps while the others speculate
    victim = _ids(spec, "Write a long story about a dragon.")
    assert generate_with_an_abort(spec, prompts, GREEDY, victim, abort_at=4) == reference
    stats = spec.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["generation_tokens"] < stats["steps"] * len(prompts) + 40  # sanity: counted once each
    _assert_no_leaks(spec)

    # the same editing prompt again: its prompt blocks come from the cache (including blocks the first
    # run filled with accepted drafts), and the output is unchanged
    before = spec.stats()["prefix_cache_hit_tokens"]
    accepted_before = spec.stats()["spec_decode_num_accepted_tokens"]
    assert spec.generate([prompts[0]], GREEDY)[0] == reference[0]
    assert spec.stats()["prefix_cache_hit_tokens"] > before
    assert spec.stats()["spec_decode_num_accepted_tokens"] > accepted_before  # the editing prompt accepts drafts
    _assert_no_leaks(spec)

    # an output that finishes inside a verify step (max_tokens, stop token) ends exactly where it would
    short = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    stop = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[reference[0][9]])
    assert spec.generate([prompts[0]], short)[0] == reference[0][:7]
    assert spec.generate([prompts[0]], stop)[0] == reference[0][: reference[0].index(reference[0][9]) + 1]
    _assert_no_leaks(spec)


def test_preemption_gives_the_same_tokens(default_model, reference):
    tight = make_engine(default_model, "dense", speculative=NGRAM, max_model_len=96, max_num_batched_tokens=24,
                        block_size=4, max_num_seqs=4, kv_cache_memory=26 * 4 * 46080)
    prompts = [_ids(tight, q) for q in QUESTIONS]
    assert tight.generate(prompts, GREEDY) == reference
    stats = tight.stats()
    assert stats["preemptions"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    _assert_no_leaks(tight)


def test_seeded_sampled_requests_beside_greedy_ones_give_their_unspeculated_tokens(spec_engine, llm_engine, reference):
    spec, plain = spec_engine, llm_engine
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    p = _ids(spec, QUESTIONS[1])
    want = plain.generate([p], sampled)[0]
    got = spec.generate([_ids(spec, EDIT), p], [GREEDY, sampled])
    assert got == [reference[0], want]
    _assert_no_leaks(spec)


def test_penalized_requests_do_not_speculate_and_keep_their_tokens(spec_engine, llm_engine):
    """Penalties and logit_bias make row j's logits depend on the drafts before it: such a request takes
    no drafts (beside one that does) and gives speculation off's tokens."""
    spec, plain = spec_engine, llm_engine
    p = _ids(spec, EDIT)
    penalized = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.5,
                               logit_bias={11: -5.0})
    want = plain.generate([p], penalized)
    before = spec.stats()["spec_decode_num_draft_tokens"]
    assert spec.generate([p], penalized) == want
    assert spec.stats()["spec_decode_num_draft_tokens"] == before
    assert spec.generate([p, p], [penalized, GREEDY])[0] == want[0]
    assert spec.stats()["spec_decode_num_draft_tokens"] > before  # the greedy one speculated beside it
    _assert_no_leaks(spec)


def test_quantized_single_stream_is_exact(default_model):
    """weight_format auto (int4 packed kernels, bf16 cache): verify rows stay in the packed kernel's
    bucket and each row's attention is computed as a lone decode row's, so the tokens are the same."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    off = make_engine(default_model, "auto", kv_cache_memory=64 << 20)
    on = make_engine(default_model, "auto", kv_cache_memory=64 << 20, speculative=NGRAM)
    p = _ids(off, EDIT)
    assert on.generate([p], params)[0] == off.generate([p], params)[0]
    assert on.stats()["spec_decode_num_accepted_tokens"] > 0
    _assert_no_leaks(on)


def test_metrics_export_the_counters(spec_engine):
    from flagdeploy.server.metrics import _EngineCollector

    spec = spec_engine
    spec.generate([_ids(spec, EDIT)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    metrics = {m.name: m for m in _EngineCollector(lambda: spec).collect()}
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert metrics["flagdeploy:" + name].samples[0].value > 0
    per_pos = metrics["flagdeploy:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_pos] == ["0", "1", "2", "3"]
    assert sum(s.value for s in per_pos) == spec.stats()["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_rows_are_taken_as_torch_indexes_them_and_a_run_is_a_view(dtype):
    """A verify step hands on each sequence's first logits row: the same values as torch's own indexing for any
    rows (a run, rows apart, repeated, none), in the logits' dtype; a run of rows (a lone sequence's first row,
    or every row) is a view, no copy of a vocabulary-wide row."""
    from flagdeploy.engine.model_runner import take_rows

    logits = torch.randn(11, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    for rows in ([0], [4], list(range(11)), [2, 3, 4], [0, 5, 10], [7, 1], [3, 3], []):
        got = take_rows(logits, rows)
        assert got.dtype == dtype and torch.equal(got, logits[torch.tensor(rows, dtype=torch.long)]), rows
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            assert got.data_ptr() == logits[rows[0]].data_ptr(), rows


def test_drafts_last_one_step_even_for_a_sequence_the_budget_left_out():
    """Drafts (and multi-step placeholders) are granted for one step: a running sequence that the step's token budget
    did not reach drops them too, so a later step never verifies drafts proposed for an earlier one."""
    from flagdeploy.engine.block_manager import BlockManager
    from flagdeploy.engine.scheduler import Scheduler
    from flagdeploy.engine.sequence import Sequence

    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=2, max_draft_rows=8)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8), 8) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_computed < s.num_tokens for s in seqs):  # the prompts, two tokens a step
        batch = sched.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += n
    for seq in seqs:  # decoding: one token each to compute, drafts for all three
        seq.token_ids.append(7)
        seq.draft_ids = [7, 7]
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and batch.drafts is None  # the budget took two rows, none left for drafts
    assert all(seq.draft_ids == [] for seq in seqs)
