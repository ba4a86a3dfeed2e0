"""The generic backend with the real FlagGems on a CUDA GPU (skipped without one, or without flag_gems).

The native cuda backend is off throughout: the engine runs the generic backend's "nvidia" family
(backends/generic), so each hot op runs the candidate the choice table tuned here picked for its dtype and
row bucket (FlagGems, torch's own op, or the reference). The table is written to $FLAGDEPLOY_TUNE_OUT when
set (the evidence to keep), else to a temporary file. Each model runs eagerly and with its decode step
captured as CUDA graphs, as separate cases: a candidate that reads back to the host (the references of
paged decode attention and of the MoE experts loop) cannot be captured, and the eager case stands alone.
Ran on the H200 (6 of 6, 2026-12-04, before the tuner timed decode-sized calls under graph replay): the
command and the table it wrote are in docs/backends/generic.md.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    os.environ.setdefault("GEMS_VENDOR", "nvidia")
    pytest.importorskip("flag_gems")
    from flagdeploy.backends.generic import choices, make_backend, tune

    be = make_backend("nvidia", "h200")
    # FLAGDEPLOY_TUNE_SHAPES=llama-8b measures at Llama-3-8B's shapes (minutes: FlagGems autotunes mm per bucket
    # and the float64 references of the 128k-row LM head run on the host); default: the tuner's own shapes
    shapes = tune.SHAPES_LLAMA_8B if os.environ.get("FLAGDEPLOY_TUNE_SHAPES") == "llama-8b" else None
    # FLAGDEPLOY_TUNE_QUICK=1: float32 at rows 1 and 16 only, what the tiny models below run (~2 minutes)
    quick = os.environ.get("FLAGDEPLOY_TUNE_QUICK") == "1"
    table = tune.measure(be, "h200", "nvidia", shapes=shapes, dtypes=(torch.float32,) if quick else
                         (torch.float32, torch.bfloat16), **({"buckets": (1, 16)} if quick else {}))
    out = os.environ.get("FLAGDEPLOY_TUNE_OUT") or str(tmp_path_factory.mktemp("tune") / "h200.yaml")
    be.state.load(choices.write(table, out))
    print(tune.summary(table))
    return be, table


def test_the_table_chooses_only_passing_candidates_and_flaggems_somewhere(generic):
    be, table = generic
    assert table["flag_gems"] and table["device"] == "cuda"
    for op, entries in table["ops"].items():
        for k, entry in entries.items():
            assert entry["candidates"][entry["choice"]]["passed"], (op, k)
    passed = [(op, k) for op, es in table["ops"].items() for k, e in es.items() if e["candidates"]["flaggems"]["passed"]]
    assert passed, "no FlagGems candidate passed its check on this GPU"


def test_a_failing_candidate_is_never_chosen_on_the_gpu(generic, monkeypatch):
    """FlagGems' rms_norm made wrong (its output scaled) and measured as the fastest: never the choice."""
    from flagdeploy.backends.generic import candidates, choices, tune
    from flagdeploy.ops import check

    be, _ = generic
    real = candidates.CANDIDATES["rms_norm"]["flaggems"]
    wrong = lambda x, w, eps: real(x, w, eps) * 1.5  # noqa: E731
    monkeypatch.setitem(candidates.CANDIDATES["rms_norm"], "flaggems", wrong)
    monkeypatch.setattr(check, "_time_us", lambda fn, *a, **k: 0.01 if fn is wrong else 100.0)
    table = tune.measure(be, "h200", "nvidia", shapes=tune.SHAPES_LLAMA_8B, ops=["rms_norm"])
    for k, entry in table["ops"]["rms_norm"].items():
        assert not entry["candidates"]["flaggems"]["passed"] and entry["choice"] != "flaggems", k
    assert choices.Choices(table).lookup("rms_norm", torch.bfloat16, 1)[0] != "flaggems"


def _flaggems_chosen(be) -> list[str]:
    """The ops whose float32 one-row calls (a tiny model's decode) run FlagGems under the loaded table."""
    return [op for op in ("rms_norm", "add_rms_norm", "swiglu", "rope", "write_kv_cache", "argmax", "embedding")
            if be.state.choices().lookup(op, torch.float32, 1)[0] == "flaggems"]


def _engine(path, be, **kw):
    from flagdeploy.engine import EngineConfig
    from flagdeploy.engine.replica import build_llm_engine

    cfg = dict(max_model_len=256, block_size=16, kv_cache_memory=64 << 20, dtype=torch.float32)
    cfg.update(kw)
    engine = build_llm_engine(path, "safetensors", EngineConfig(**cfg), chip=be, progress=False)
    from flagdeploy import ops

    assert ops.active_backend() is be and ops.active_backend().name == "generic"  # the cuda backend is off
    return engine


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_llama_through_the_generic_backend_matches_transformers(generic, tmp_path, graphs):
    pytest.importorskip("transformers")
    from conftest import write_tiny_llama

    from flagdeploy.engine import SamplingParams

    be, _ = generic
    ref = write_tiny_llama(tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, max_position_embeddings=512).cuda()
    ids = [5, 17, 42, 99, 3, 150, 7, 8, 9, 11]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]).cuda(), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    engine = _engine(tmp_path, be, cuda_graphs=graphs)
    assert engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0] == want
    print("FlagGems ran:", _flaggems_chosen(be))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_glm5_next_through_the_generic_backend_matches_transformers(generic, tmp_path, graphs):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm5NextForConditionalGeneration"):
        pytest.skip("this transformers has no glm5_next (5.23 ships it)")
    from flagdeploy.engine import SamplingParams
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    be, _ = generic
    src = write_tiny_glm5_next(tmp_path / "glm", index_topk=256)
    ids = torch.randint(2, 64, (40,), generator=torch.Generator().manual_seed(1))
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).float().cuda().eval()
    with torch.no_grad():
        want = hf.generate(ids[None].cuda(), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    engine = _engine(src, be, cuda_graphs=graphs)
    assert engine.generate([ids.tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0] == want
