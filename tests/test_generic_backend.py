"""The generic accelerator backend (backends/generic) on the CPU, through the FlagGems stand-in.

The stand-in (tests/standins/flag_gems) implements FlagGems' documented signatures in plain torch; it is
put in sys.modules as `flag_gems` only for this module (the `gems` fixture) and removed afterwards. The backend runs on the
"host" family (device cpu) here: the dispatch, the tuner's choice rule and the table are what is tested; the
real library on a GPU is tests/test_flaggems_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from flagdeploy import ops
from flagdeploy.backends.generic import candidates, choices, families, make_backend, tune
from flagdeploy.cli import main

STANDINS = str(Path(__file__).parent / "standins")
SMALL = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 300, "experts": 4,
         "expert_inter": 32, "top_k": 2, "swiglu_limit": None}


@pytest.fixture(scope="module")
def gems():
    """The stand-in as `flag_gems` in sys.modules (not tests/standins on sys.path: transformers would then find
    the torch_npu stand-in there too), removed afterwards."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flag_gems", Path(STANDINS) / "flag_gems" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["flag_gems"] = module
    candidates.reset()
    try:
        yield module
    finally:
        del sys.modules["flag_gems"]
        candidates.reset()


@pytest.fixture
def fresh(gems):
    gems.CALLS.clear()
    gems.BROKEN.clear()
    yield gems
    gems.BROKEN.clear()
    ops.use_backend("cpu")


def _flaggems_fastest(monkeypatch):
    """Time every FlagGems candidate as near-free and the rest as slow: the choice then rests on the check."""
    from flagdeploy.ops import check

    gems_fns = {fn for c in candidates.CANDIDATES.values() for n, fn in c.items() if n == "flaggems"}
    monkeypatch.setattr(check, "_time_us", lambda fn, *a, **k: 0.01 if fn in gems_fns else 100.0)


def test_registered_and_a_family_chip_resolves_to_it():
    assert "generic" in ops.backends()
    be = ops.get_backend("c500")  # MetaX: the catalog's backend "metax" has no plugin; the generic one runs it
    assert (be.name, be.vendor, be.device_type, be.collective) == ("generic", "metax", "cuda", "nccl")
    mlu = ops.get_backend("mlu590")
    assert (mlu.device_type, mlu.collective, mlu.graph) == ("mlu", "cncl", "torch.mlu.MLUGraph")
    assert ops.get_backend("h200").name == "cuda"  # a chip with its own backend keeps it
    from flagdeploy.chips import all_chips

    installed = set(ops.backends())
    for chip in all_chips():
        if chip.backend not in installed:
            assert chip.backend in families(), f"{chip.id}: family {chip.backend} missing from families.yaml"
    for name, fam in families().items():
        assert {"device_type", "collective", "graph", "source", "confidence"} <= set(fam), name


def test_ops_list_names_the_generic_backend_for_a_metax_chip():
    r = CliRunner().invoke(main, ["ops", "list", "--chip", "c500"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("backend: generic (metax, device cuda, collectives nccl)")
    assert "rms_norm" in r.output and "no choice table" in r.output


def test_flag_gems_is_imported_by_nothing_until_an_op_runs_a_flaggems_candidate():
    code = ("import sys; from flagdeploy import ops; be = ops.get_backend('c500'); ops.use_backend(be); "
            "from flagdeploy.cli import main; import flagdeploy.backends.generic.tune; "
            "assert 'flag_gems' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_choose_never_picks_a_failed_candidate():
    assert choices.choose({"flaggems": {"time_us": 0.1, "passed": False}, "torch": {"time_us": 9.0, "passed": True},
                           "reference": {"time_us": 5.0, "passed": True}}) == "reference"
    assert choices.choose({"flaggems": {"time_us": None, "passed": False},
                           "reference": {"time_us": 5.0, "passed": False}}) == "reference"


def test_where_decode_steps_are_captured_a_capturable_candidate_wins(fresh, monkeypatch):
    """A candidate that passed but cannot be captured loses to one that can; without any that can, the
    fastest passing one; a failed candidate stays out either way."""
    assert choices.choose({"flaggems": {"time_us": 1.0, "passed": True, "capturable": True},
                           "reference": {"time_us": 0.5, "passed": True, "capturable": False}}) == "flaggems"
    assert choices.choose({"flaggems": {"time_us": 1.0, "passed": True, "capturable": False},
                           "reference": {"time_us": 2.0, "passed": True, "capturable": False}}) == "flaggems"
    assert choices.choose({"flaggems": {"time_us": 0.1, "passed": False},
                           "reference": {"time_us": 2.0, "passed": True, "capturable": False}}) == "reference"
    be = make_backend("host")
    _flaggems_fastest(monkeypatch)
    ref_fn = ops.OPS["rms_norm"].reference
    monkeypatch.setattr(tune, "replay_us", lambda be, fn, a, k: (False, None) if fn is candidates.g_rms_norm else (True, 5.0))
    table = tune.measure(be, "host", "host", shapes=SMALL, buckets=(1,), dtypes=(torch.float32,), ops=["rms_norm"])
    entry = table["ops"]["rms_norm"]["float32/m1"]
    assert entry["candidates"]["flaggems"]["capturable"] is False and entry["choice"] == "torch"
    assert ref_fn is ops.OPS["rms_norm"].reference


def test_captured_candidates_are_compared_by_their_time_under_graph_replay():
    """A library whose calls cost host overhead eagerly but little in a replayed graph (FlagGems: 35-140 us
    a call eagerly) wins where the engine replays graphs; a failed one stays out however fast it replays."""
    slow_eager_fast_replay = {"flaggems": {"time_us": 60.0, "passed": True, "capturable": True, "replay_us": 3.0},
                              "torch": {"time_us": 12.0, "passed": True, "capturable": True, "replay_us": 6.0},
                              "reference": {"time_us": 40.0, "passed": True, "capturable": True, "replay_us": 20.0}}
    assert choices.choose(slow_eager_fast_replay) == "flaggems"
    # no graph on this device or bucket (no replay_us): eager time decides
    eager = {n: {k: v for k, v in r.items() if k not in ("capturable", "replay_us")}
             for n, r in slow_eager_fast_replay.items()}
    assert choices.choose(eager) == "torch"
    broken = {**slow_eager_fast_replay, "flaggems": {**slow_eager_fast_replay["flaggems"], "passed": False}}
    assert choices.choose(broken) == "torch"


def test_tuner_never_chooses_a_failing_candidate_even_when_fastest(fresh, monkeypatch):
    be = make_backend("host")
    _flaggems_fastest(monkeypatch)
    kw = dict(shapes=SMALL, buckets=(1, 4), dtypes=(torch.float32,), ops=["rms_norm", "swiglu"])
    good = tune.measure(be, "host", "host", **kw)
    assert {e["choice"] for op in good["ops"].values() for e in op.values()} == {"flaggems"}
    fresh.BROKEN.add("rms_norm")  # its FlagGems kernel now answers wrong, still "fastest"
    bad = tune.measure(be, "host", "host", **kw)
    for k, entry in bad["ops"]["rms_norm"].items():
        gems_result = entry["candidates"]["flaggems"]
        assert not gems_result["passed"] and gems_result["time_us"] < 1 and "outside" in gems_result["why"], k
        assert entry["choice"] != "flaggems" and entry["candidates"][entry["choice"]]["passed"]
    assert {e["choice"] for e in bad["ops"]["swiglu"].values()} == {"flaggems"}
    # a table edited by hand to choose the failed candidate is not obeyed either
    bad["ops"]["rms_norm"]["float32/m1"]["choice"] = "flaggems"
    loaded = choices.Choices(bad, "edited")
    assert loaded.lookup("rms_norm", torch.float32, 1)[0] == "reference"


def test_every_flaggems_candidate_passes_on_the_standin(fresh, monkeypatch):
    """Each adapter maps the op onto the documented FlagGems call correctly (the stand-in computes what the
    documentation says), at every bucket, float32 and bf16."""
    be = make_backend("host")
    table = tune.measure(be, "host", "host", shapes=SMALL, buckets=(1, 5), dtypes=(torch.float32, torch.bfloat16))
    failed = [(op, k, e["candidates"]["flaggems"]) for op, es in table["ops"].items() for k, e in es.items()
              if not e["candidates"]["flaggems"]["passed"]]
    assert not failed, failed
    clamped = tune.measure(be, "host", "host", shapes={**SMALL, "swiglu_limit": 7.0}, buckets=(1, 5),
                           dtypes=(torch.float32,), ops=["moe_experts"])
    assert all(e["candidates"]["torch"]["passed"] and e["candidates"]["flaggems"]["passed"]  # (the reference, clamped)
               for e in clamped["ops"]["moe_experts"].values())
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "reshape_and_cache_flash",
                 "flash_attn_varlen_func", "argmax", "embedding", "mm", "outplace_fused_experts"):
        assert fresh.CALLS[name] > 0, name


def test_table_round_trips_and_dispatch_follows_it_per_bucket(fresh, tmp_path, monkeypatch):
    be = make_backend("host", "host")
    _flaggems_fastest(monkeypatch)
    table = tune.measure(be, "host", "host", shapes=SMALL, buckets=(1, 16), dtypes=(torch.float32,), ops=["rms_norm"])
    table["ops"]["rms_norm"]["float32/m16"]["choice"] = "torch"  # a passing candidate, per bucket
    path = choices.write(table, tmp_path / "t" / "host.yaml")
    assert not list(path.parent.glob("*.tmp"))
    assert choices.read(path) == table
    be.state.load(path)
    ops.use_backend(be)
    x, w = torch.randn(1, 64), torch.randn(64)
    fresh.CALLS.clear()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.OPS["rms_norm"].reference(x, w, 1e-6))
    assert fresh.CALLS["rms_norm"] == 1  # 1 row: bucket m1, FlagGems
    ops.rms_norm(torch.randn(9, 64), w, 1e-6)
    assert fresh.CALLS["rms_norm"] == 1  # 9 rows: bucket m16, torch's op
    ops.rms_norm(torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16(), 1e-6)
    assert fresh.CALLS["rms_norm"] == 1  # no bf16 entry: the reference
    assert be.explain("rms_norm") == "float32/m1 flaggems, float32/m16 torch"


def test_ops_tune_writes_the_table_the_backend_loads(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tune, "SHAPES", SMALL)
    monkeypatch.setattr(choices, "BUCKETS", (1, 4))
    monkeypatch.setattr(tune, "TUNED_DTYPES", (torch.float32,))
    monkeypatch.setattr(tune.measure, "__defaults__", (None, (1, 4), (torch.float32,), ["rms_norm", "argmax"]))
    # the command loads the table into the registered backend: give it back its own afterwards, or later tests
    # would dispatch to the stand-in's kernels after the stand-in is gone (whenever this host timed it fastest)
    monkeypatch.setattr(ops.get_backend("generic").state, "_choices", None)
    r = CliRunner().invoke(main, ["ops", "tune", "--chip", "generic"])
    assert r.exit_code == 0, r.output
    path = tmp_path / "flagdeploy" / "generic" / "host.yaml"
    assert f"wrote {path}" in r.output and "rms_norm" in r.output
    table = yaml.safe_load(path.read_text())
    assert set(table["ops"]) == {"rms_norm", "argmax"} and table["flag_gems"] == "5.0.2+standin"
    assert make_backend("host").state.choices().source == str(path)  # a fresh backend finds it there


def test_tiny_llama_end_to_end_through_flaggems_matches_transformers(fresh, tmp_path, monkeypatch, one_thread):
    pytest.importorskip("transformers")
    from conftest import write_tiny_llama

    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    ref = write_tiny_llama(tmp_path / "llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256)
    be = make_backend("host", "tiny")
    _flaggems_fastest(monkeypatch)
    table = tune.measure(be, "tiny", "host", shapes=SMALL, buckets=(1, 16), dtypes=(torch.float32,))
    be.state.load(choices.write(table, tmp_path / "tiny.yaml"))
    engine = build_llm_engine(tmp_path / "llama", "safetensors", EngineConfig(max_model_len=128, block_size=4,
                              kv_cache_memory=4 << 20, compile=False), chip=be, progress=False)
    assert ops.active_backend() is be and engine.config.device == "cpu"
    ids = [5, 17, 42, 99, 3, 150, 7, 8, 9, 11]
    fresh.CALLS.clear()
    got = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == want[0, len(ids):].tolist()
    for name in ("rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "reshape_and_cache_flash", "flash_attn_varlen_func"):
        assert fresh.CALLS[name] > 0, name


def test_flaggems_prefill_attention_takes_the_engines_k_and_v_as_they_come(fresh):
    """FlagGems' varlen attention asserts k.stride() == v.stride(); in the engine k is roped (a new tensor) while v
    is still a view of the fused qkv projection: the adapter makes them agree (the H200 run met this first)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 16, generator=gen)
    qkv = torch.randn(12, 2 * 2 * 16 + 4 * 16, generator=gen)
    k = qkv[:, 64:96].reshape(12, 2, 16).clone()  # contiguous, as after rope
    v = qkv[:, 96:].view(12, 2, 16)  # a strided view
    assert k.stride() != v.stride()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = candidates.g_attention_prefill(q, k, v, cu, cu, 0.25)
    want = ops.OPS["attention_prefill"].reference(q, k, v, cu, cu, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
