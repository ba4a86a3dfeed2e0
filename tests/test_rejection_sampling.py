"""Speculative sampling for sampled requests: the acceptance rule emits tokens distributed exactly as the
target's own samples (a chi-square test on a tiny vocabulary, deterministic and non-degenerate drafts), the
processing (temperature, top_k, top_p) is the sampler's own, and through the engine a sampled request
accepts drafts, is reproducible with a seed, and equals its unspeculated output (dense weights)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import make_engine

from flagdeploy.engine import SamplingParams
from flagdeploy.engine.rejection import rejection_sample
from flagdeploy.engine.sampler import probs_for
from flagdeploy.engine.speculative import SpeculativeConfig

# ---- the acceptance rule, on a tiny vocabulary ------------------------------------------------------

V = 5
P = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05],  # p_0: the target after the sequence's last token
                  [0.05, 0.15, 0.50, 0.20, 0.10],  # p_1: after the first draft (d_0 = 1)
                  [0.30, 0.30, 0.10, 0.20, 0.10]])  # p_2: after d_0, d_1 (bonus row when both accepted)
DRAFTS = [1, 3]  # d_0 = 1 (p_0 gives it 0.25), d_1 = 3 (p_1 gives it 0.20)
Q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10],  # non-degenerate draft rows (d_j would be drawn from q_j)
                  [0.20, 0.10, 0.10, 0.50, 0.10]])
ONE_HOT = torch.nn.functional.one_hot(torch.tensor(DRAFTS), V).float()  # q given, but degenerate

def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), closed form for integer df (no scipy here)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    s = math.erfc(math.sqrt(h))
    return s + sum(math.exp(-h + (i - 0.5) * math.log(h) - math.lgamma(i + 0.5)) for i in range(1, (df + 1) // 2))


def _assert_matches(samples: list, expected: dict) -> None:
    """Pearson's chi-square of `samples` against the expected probabilities; fails only at p < 1e-4 (the
    seeds are fixed, so a pass is a pass every time)."""
    counts: dict = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    cells = [c for c, e in expected.items() if e > 0]
    assert set(counts) <= set(cells), f"a token the target gives no mass: {counts}"
    n = len(samples)
    stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    assert _chi2_sf(stat, len(cells) - 1) > 1e-4, (stat, counts)


def _steps(q: torch.Tensor | None, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """n verify steps: (drafts, emitted). Deterministic drafts are DRAFTS; with q, d_j is drawn from q_j
    (as a sampling proposer would: the theorem needs d ~ q)."""
    g = torch.Generator().manual_seed(seed)
    drafts = [DRAFTS] * n if q is None else torch.multinomial(q, n, replacement=True, generator=g).T.tolist()
    return [(d, rejection_sample(P, d, g, q=q)) for d in drafts]


def test_chi2_helper_agrees_with_known_quantiles():
    assert _chi2_sf(3.841, 1) == pytest.approx(0.05, abs=2e-4)
    assert _chi2_sf(9.488, 4) == pytest.approx(0.05, abs=2e-4)
    assert _chi2_sf(23.513, 4) == pytest.approx(1e-4, rel=1e-2)
    assert _chi2_sf(36.415, 24) == pytest.approx(0.05, rel=1e-2)


@pytest.mark.parametrize("q,n", [(None, 20_000), (Q, 12_000), (ONE_HOT, 6_000)],
                         ids=["deterministic", "sampled-q", "one-hot-q-general-path"])
def test_emitted_tokens_are_distributed_as_the_target(q, n):
    steps = _steps(q, n, seed=1234)
    assert all(1 <= len(o) <= 3 and o[:-1] == d[: len(o) - 1] for d, o in steps)  # accepted drafts + one
    # the first token: distributed as p_0
    _assert_matches([o[0] for _, o in steps], {t: float(P[0, t]) for t in range(V)})
    # the second token where it came from the same step (the first was an accepted draft): as p_1
    second = [o[1] for _, o in steps if len(o) > 1]
    assert len(second) > n // 5
    _assert_matches(second, {t: float(P[1, t]) for t in range(V)})
    # the first two tokens of the output, the second drawn by a plain next step where the first was a
    # replacement: jointly p_0(x) p_1(y) over all 25 pairs
    nxt = torch.multinomial(P[1], n, replacement=True, generator=torch.Generator().manual_seed(99)).tolist()
    pairs = [(o[0], o[1] if len(o) > 1 else y) for (_, o), y in zip(steps, nxt)]
    _assert_matches(pairs, {(x, y): float(P[0, x] * P[1, y]) for x in range(V) for y in range(V)})
    # the bonus token after all drafts were accepted: as p_2
    bonus = [o[2] for _, o in steps if len(o) == 3]
    assert len(bonus) > n // 50
    _assert_matches(bonus, {t: float(P[2, t]) for t in range(V)})
    # d_0's acceptance rate is the optimal sum_x min(p_0(x), q_0(x)) (one-hot q: p_0(d_0) = 0.25)
    rate = sum(len(o) > 1 for _, o in steps) / n
    want = float(P[0, DRAFTS[0]]) if q is None else float(torch.minimum(P[0], q[0]).sum())
    assert rate == pytest.approx(want, abs=0.02)


def test_a_seeded_generator_makes_it_reproducible_and_fallback_rows_keep_the_argmax():
    assert _steps(Q, 300, seed=5) == _steps(Q, 300, seed=5)
    assert _steps(None, 300, seed=5) == _steps(None, 300, seed=5)
    bad = P.clone()
    bad[1] = float("nan")  # row 1 has nothing to draw from: the target keeps its argmax there (3 here)
    g = torch.Generator().manual_seed(0)
    for q in (None, Q):
        for _ in range(50):
            o = rejection_sample(bad, DRAFTS, g, q=q, fallback=[0, 3, 0])
            assert o[0] != DRAFTS[0] or o[1] == 3  # d_1 = 3 equals the fallback: always accepted


def test_probs_for_is_the_samplers_processing_row_by_row():
    """One function turns logits into the distribution both paths draw from; a row's result is the same
    alone (what `sample` computes) as among a sequence's 1 + k verify rows (what rejection sampling uses)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
                   SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.0, top_k=50, top_p=0.5)):
        rows = probs_for(logits, params)
        assert torch.allclose(rows.sum(-1), torch.ones(4))
        for r in range(4):
            assert torch.equal(probs_for(logits[r : r + 1], params)[0], rows[r])
        if params.top_k:
            assert int((rows > 0).sum(-1).max()) <= params.top_k
        if params.top_p < 1:  # the smallest set whose mass reaches top_p, the crossing token included
            kept = (rows > 0).sum(-1)
            ref = (logits / params.temperature).softmax(-1)
            if params.top_k:
                kth = ref.topk(params.top_k, -1).values[:, -1:]
                ref = torch.where(ref >= kth, ref, 0)
                ref = ref / ref.sum(-1, keepdim=True)
            need = (ref.sort(-1, descending=True).values.cumsum(-1) < params.top_p).sum(-1) + 1
            assert torch.equal(kept, need)


# ---- through the engine -----------------------------------------------------------------------------

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
EDIT = ("Repeat this sentence exactly, fixing the typo: The quick brown fox jumsp over the lazy dog "
        "and runs into the forest.")


def _ids(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def spec_engine(default_model):
    return make_engine(default_model, "dense", speculative=NGRAM)


def _assert_no_leaks(engine):
    assert not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_sampled_requests_speculate_reproducibly_and_as_without_speculation(spec_engine, llm_engine):
    """Sampled requests on the editing prompt (top_p, top_k, one unseeded) accept drafts; with a seed two
    runs agree; and since drafts are deterministic (one draw per emitted token, the generator consumed as
    without speculation) and dense kernels are batch invariant, a seeded output equals speculation off."""
    spec, plain = spec_engine, llm_engine
    p = _ids(spec, EDIT)
    seeded = [SamplingParams(max_tokens=10, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=30, seed=5, ignore_eos=True)]
    unseeded = SamplingParams(max_tokens=10, temperature=0.5, ignore_eos=True)
    before = spec.stats()
    got = spec.generate([p] * 3, [*seeded, unseeded])
    after = spec.stats()
    assert [len(o) for o in got] == [10] * 3
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"] and accepted > 0
    per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    assert sum(per_pos) == accepted
    assert after["generation_tokens"] - before["generation_tokens"] == 30  # each token counted once
    assert after["steps"] - before["steps"] < 10  # drafts were accepted: fewer steps than tokens
    assert spec.generate([p] * 2, seeded) == got[:2]  # reproducible with seeds
    assert plain.generate([p] * 2, seeded) == got[:2]  # and the same as speculation off
    _assert_no_leaks(spec)


def test_logprobs_requests_still_do_not_speculate(spec_engine):
    spec = spec_engine
    before = spec.stats()["spec_decode_num_drafts"]
    params = SamplingParams(max_tokens=6, temperature=0.5, seed=1, logprobs=2, ignore_eos=True)
    spec.add_request("lp", _ids(spec, EDIT), params)
    outs = []
    while spec.has_work():
        outs.extend(spec.step())
    assert spec.stats()["spec_decode_num_drafts"] == before
    assert sum(len(o.logprobs) for o in outs) == sum(len(o.token_ids) for o in outs) == 6


@pytest.fixture(scope="module")
def sampling_kernels(request, tmp_path_factory):
    """The op namespace of the sampling kernels of `request.param`: "backend", the cpu backend's library as this
    machine builds it; "portable", the plain C++ kernels alone (native.PORTABLE) as a CPU without the others (an
    ARM server, x86 without AVX2) builds them, here under their own namespace."""
    import shutil

    from flagdeploy.backends.cpu import native

    if request.param == "backend":
        if not native.available():
            pytest.skip("the cpu backend's kernels are not built on this machine")
        return torch.ops.flagdeploy_cpu
    if shutil.which(native._cxx()) is None:
        pytest.skip("no C++ compiler here")
    return native.build_beside("portable", tmp_path_factory.mktemp("portable"))


@pytest.mark.parametrize("sampling_kernels", ["backend", "portable"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_sampling_kernels_keep_and_draw_what_the_reference_does(sampling_kernels, dtype):
    """The CPU backend computes `sample_probs` and `draw` in its kernels (csrc/sample.cpp: top_k and top_p
    select among the entries above a bound, no vocabulary sort; rows in parallel); other devices run the torch
    reference. Over a real vocabulary's width, with ties, masked rows and every mask alone and together, both
    keep the same tokens with the same probabilities, float rounding apart: where top_p ends deep in the tail
    (0.999 here, ~20k tokens kept) the float32 running sum of the reference crosses it some tokens of ~1e-7 each
    before the float64 one of the kernel does: as much probability as that sum's rounding, at most half an ulp
    below 1 (2**-24) an add, and torch's vector width sets its order (1.3-1.7e-5 on an AVX2 EPYC). Rows with
    different settings in one call are each what they are alone, and the kernel draws the reference's tokens at
    the same uniforms. The portable build does the same."""
    from flagdeploy.engine.sampler import row_settings
    from flagdeploy.ops import reference

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 49152, generator=g) * 4).to(dtype)
    logits[1, 100:140] = logits[1].max()  # 40 tied likeliest tokens: top_k and top_p break ties as torch does
    logits[2, :] = float("-inf")
    logits[2, 7] = 1.0  # one token left
    every = (SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_p=0.9),
             SamplingParams(temperature=1.2, top_p=0.999), SamplingParams(temperature=0.8, top_k=40),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.05),
             SamplingParams(temperature=0.6, min_p=0.01, top_k=500, top_p=0.95))
    u = torch.rand(3, generator=g, dtype=torch.float64)
    assert torch.equal(sampling_kernels.argmax_rows(logits), logits.float().argmax(1))  # (the first of ties)
    for params in every:
        settings = row_settings([params] * 3, torch.device("cpu"))
        got, want = sampling_kernels.sample_probs(logits, *settings), reference.sample_probs(logits, *settings)
        differ = (got > 0) != (want > 0)
        rounding = (want > 0).sum(-1) * 2.0**-24  # the reference's running sum, one rounding a kept token
        assert bool(((got * differ).sum(-1) + (want * differ).sum(-1) <= rounding).all()), params
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        if params.top_p != 0.999:  # (there the kept sets differ by the tail's tokens above)
            assert torch.equal(sampling_kernels.draw(got, u), reference.draw(want, u)), params
    mixed = [every[i % len(every)] for i in range(7)]  # one call, a different request a row
    rows = logits[torch.arange(7) % 3]
    alone = torch.cat([sampling_kernels.sample_probs(rows[i : i + 1], *row_settings([p], torch.device("cpu")))
                       for i, p in enumerate(mixed)])
    assert torch.equal(sampling_kernels.sample_probs(rows, *row_settings(mixed, torch.device("cpu"))), alone)
    bad = torch.full((2, 10), float("nan"))
    bad[1] = float("-inf")  # every token masked: nothing to draw from either
    once = row_settings([SamplingParams(temperature=1.0)] * 2, torch.device("cpu"))
    probs = sampling_kernels.sample_probs(bad, *once)
    assert probs.isnan().all() and sampling_kernels.draw(probs, u[:2]).tolist() == [-1, -1]


def test_a_cpu_without_the_x86_kernels_still_samples_and_argmaxes_in_kernels(tmp_path):
    """Where the cpu backend's kernels cannot run (another CPU than x86 with AVX2, here forced by
    FLAGDEPLOY_CPU_ISA=portable), the plain C++ ones (argmax, sampling) are built alone and the backend's ops
    use them; the rest stays on torch's kernels."""
    import shutil
    import subprocess
    import sys

    from flagdeploy.backends.cpu import native

    if shutil.which(native._cxx()) is None:
        pytest.skip("no C++ compiler here")
    check = """
import torch
from flagdeploy.backends.cpu import native, ops
from flagdeploy.engine import SamplingParams
from flagdeploy.engine.sampler import row_settings
assert not native.available() and native.portable(), (native.available(), native.portable())
logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))
assert native.samples(logits) and not native.attends(torch.zeros(1, 16, 1, 64))
settings = row_settings([SamplingParams(temperature=0.7, top_p=0.9)] * 4, torch.device("cpu"))
assert torch.equal(ops.sample_probs(logits, *settings), torch.ops.flagdeploy_cpu.sample_probs(logits, *settings))
assert torch.equal(ops.argmax(logits), logits.argmax(1))
"""
    env = {**os.environ, "FLAGDEPLOY_CPU_ISA": "portable", "FLAGDEPLOY_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name.split("-")[1] for p in (tmp_path / "kernels").glob("*.so")] == ["portable"]


def test_draw_follows_the_distribution_and_its_generator():
    """`draw` takes one uniform of the sequence's generator a token: seeded draws repeat, the frequencies are
    the row's probabilities (chi-square), zero-probability tokens never come, and a row with nothing to draw
    from gives None."""
    from flagdeploy.engine.sampler import draw

    probs = torch.zeros(49152)
    probs[[3, 17, 40000, 49151]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(1)
    first = [draw(probs, g) for _ in range(20000)]
    g.manual_seed(1)
    assert [draw(probs, g) for _ in range(20000)] == first
    _assert_matches(first, {3: 0.1, 17: 0.2, 40000: 0.3, 49151: 0.4})
    assert draw(torch.full((10,), float("nan")), g) is None and draw(torch.zeros(10), g) is None
