"""Speculation on a sequence-state model (tiny glm5_next: KDA recurrent state + MLA/DSA per-token rows):
rejected drafts leave nothing in the KDA state (one state row per draft position, the next step starts from
the row of the last accepted token), so greedy output equals speculation off token for token — with every
acceptance length from 0 to K, batched, under preemption and with an abort mid-run — and every state row and
block goes back."""

from __future__ import annotations

import pytest
from conftest import generate_with_an_abort, graphs_on_the_cpu
from test_glm5_engine import glm_dir  # noqa: F401  (the module-scoped tiny checkpoint)

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.engine.speculative import Proposer, SpeculativeConfig

PROMPTS = [[5, 9, 13, 22, 7, 5, 9, 13, 22, 7, 5, 9], [12, 14, 16, 12, 14], [33, 35, 37, 39, 41, 33, 35, 37, 2]]
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
K = 3


class ScriptedProposer(Proposer):
    """Drafts the known greedy continuation, spoiled at a position that cycles through 0..K (K: none), so
    the verify steps see every acceptance length; a test-only stand-in for a drafter with known accuracy."""

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations, self.calls = continuations, 0

    def propose(self, seqs, limits):
        out = []
        for seq, k in zip(seqs, limits):
            self.calls += 1
            want = self.continuations.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [1] * 64)
            done = seq.num_output_tokens
            drafts = list(want[done : done + k])
            spoil = self.calls % (K + 1)
            if spoil < len(drafts):
                drafts[spoil] = (drafts[spoil] + 1) % 64
            out.append(drafts)
        return out


def _engine(path, spec: bool, **kw):
    config = {"max_model_len": 48, "block_size": 4, "kv_cache_memory": 8 << 20}
    config.update(kw)
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=K) if spec else SpeculativeConfig()
    return build_llm_engine(path, "safetensors", EngineConfig(speculative=speculative, **config), chip="cpu",
                            progress=False)


@pytest.fixture(scope="module")
def reference(glm_dir):  # noqa: F811
    path, _ = glm_dir
    return _engine(path, False).generate(PROMPTS, GREEDY)


def _assert_released(engine):
    assert not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    runner = engine.runner
    assert runner.state_rows == {} and runner.verified == {}
    assert len(runner.free_rows) == engine.config.max_num_seqs * (1 + K)


@pytest.mark.parametrize("mode", ["batched", "preempted", "graphed"])
def test_every_acceptance_length_gives_the_tokens_of_speculation_off(glm_dir, reference, mode, monkeypatch):  # noqa: F811
    path, _ = glm_dir
    tight = mode == "preempted"
    kw = {"max_num_batched_tokens": 8} if tight else {}
    if tight:  # room for about two sequences' blocks: the scheduler preempts mid-verification
        probe = _engine(path, True)
        per_block = probe.runner.bytes_per_block(probe.model, 4)
        kw["kv_cache_memory"] = probe.runner.state_bytes(probe.model, 16, K) + 12 * per_block
    engine = _engine(path, True, **kw)
    if mode == "graphed":
        graphs_on_the_cpu(engine, monkeypatch)
    engine.proposer = ScriptedProposer({tuple(p): r for p, r in zip(PROMPTS, reference)})
    assert generate_with_an_abort(engine, PROMPTS, GREEDY, [40, 41, 42, 43, 44, 45], abort_at=3) == reference
    stats = engine.stats()
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert stats["spec_decode_num_drafts"] > 0 and all(n > 0 for n in per_pos)  # lengths 1..K all occurred
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # and rejections
    if tight:
        assert stats["preemptions"] > 0
    if mode == "graphed":  # the steps went through the graphs: decode and verify, several batch buckets
        assert len(engine.runner.verify_graphs.graphs) > 1 and engine.runner.graphs.graphs
    _assert_released(engine)
