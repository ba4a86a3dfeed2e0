"""`--compile` for the llama family on the CPU: the paged decode step through torch.compile.

Two graphs serve every decode step up to the batch where the graph stops beating the eager step (measured
at start-up): one for a lone sequence (no padding row) and one for any batch of two or more. With float32
weights they must give transformers' greedy tokens; with 4-bit weights (the way `--weight-format auto`
serves a GGUF) their logits must match the eager step's on both of the cpu backend's kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_llama

from flagdeploy import ops
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.decode_inputs import DecodeInputs
from flagdeploy.engine.llm_engine import LLMEngine
from flagdeploy.engine.replica import build_llm_engine, load_model
from flagdeploy.models.linear import Linear
from flagdeploy.ops.weights import Int4Weight

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99], [3, 150, 7], [8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
CONFIG = dict(max_model_len=64, max_num_seqs=4, block_size=4, compile=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, write_tiny_llama(path, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128)


@pytest.fixture(autouse=True)
def _cold_kernel_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # as on a fresh host


def _counting(engine) -> list[int]:
    """Records the batch size of every step that goes through the compiled graphs."""
    compiled, sizes = engine.runner.compiled, []
    run = compiled.run
    compiled.run = lambda ids, *rest: sizes.append(len(ids)) or run(ids, *rest)
    return sizes


def test_compiled_decode_gives_transformers_tokens(llama_dir, graphs_serve_every_batch):
    """Batches of 3 and of 1, block tables from 1 to 8 blocks: the same greedy tokens as transformers."""
    path, hf = llama_dir
    engine = build_llm_engine(path, "safetensors", EngineConfig(**CONFIG), chip="cpu", progress=False)
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.ready == {1, 2} and compiled.one_row and compiled.max_batch >= 2
    sizes = _counting(engine)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert engine.generate(PROMPTS, params) == want
    assert engine.generate(PROMPTS[1:2], params) == want[1:2]
    assert {1, 3} <= set(sizes)  # both graphs ran


def test_background_compile_serves_eagerly_then_swaps_the_graphs_in(llama_dir, graphs_serve_every_batch):
    """`compile=None` (serve's default): the engine is returned before anything is compiled and serves with
    its eager step while a thread compiles; once done the runner takes the graphs, and the tokens are
    transformers' greedy ones before, during and after. While the compile holds torch's process-wide
    `is_compiling()` flag, the serving thread's ops still see `ops.tracing()` False (their eager forms)."""
    path, hf = llama_dir
    engine = build_llm_engine(path, "safetensors", EngineConfig(**{**CONFIG, "compile": None}), chip="cpu",
                              progress=False)
    runner = engine.runner
    assert runner.compiling is not None
    assert engine.stats()["decode_step_compiled"] == 0  # /metrics: flagdeploy:decode_step_compiled
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    seen = []
    while runner.compiling.is_alive() and len(seen) < 3:  # served eagerly while the graphs compile
        seen.append((runner.compiled is None, torch.compiler.is_compiling(), ops.tracing()))
        assert engine.generate(PROMPTS, params) == want
    runner.compiling.join(timeout=600)
    assert not runner.compiling.is_alive()
    assert seen and seen[0][0], "the first steps ran before any graph was ready"
    assert not any(traced for *_, traced in seen)
    compiled = runner.compiled
    assert compiled is not None and compiled.ready == {1, 2}
    assert (engine.stats()["decode_step_compiled"], engine.stats()["decode_step_compiling"]) == (1, 0)
    sizes = _counting(engine)
    assert engine.generate(PROMPTS, params) == want
    assert engine.generate(PROMPTS[1:2], params) == want[1:2]
    assert {1, 3} <= set(sizes)


def test_background_compile_that_fails_leaves_the_eager_step(llama_dir, monkeypatch, caplog):
    """A compile that raises (or whose graphs lose to the eager step) leaves the runner eager, and says so."""
    from flagdeploy.engine.compiled_step import CompiledDecode

    def broken(self, background=False):
        raise RuntimeError("inductor fell over")

    monkeypatch.setattr(CompiledDecode, "warm_up", broken)
    path, hf = llama_dir
    engine = build_llm_engine(path, "safetensors", EngineConfig(**{**CONFIG, "compile": None}), chip="cpu",
                              progress=False)
    engine.runner.compiling.join(timeout=60)
    assert engine.runner.compiled is None
    assert "compiling the decode step failed; the eager step keeps serving" in caplog.text
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    assert engine.generate(PROMPTS[:1], params) == [want]


def test_no_background_compile_by_default_where_the_frozen_copy_is_large(llama_dir, monkeypatch):
    """A compiled step holds a second copy of dense float weights: past a fraction of the machine's memory
    serve's default leaves the step eager (no compile thread); asking for it still compiles."""
    from flagdeploy.engine import model_runner

    monkeypatch.setattr(model_runner, "BACKGROUND_COMPILE_MAX_FROZEN", 0.0)
    path, _ = llama_dir
    engine = build_llm_engine(path, "safetensors", EngineConfig(**{**CONFIG, "compile": None}), chip="cpu",
                              progress=False)
    assert engine.runner.compiling is None and engine.runner.compiled is None
    assert engine.stats()["decode_step_compiling"] == 0


def _int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    """Round-to-nearest asymmetric 4-bit groups (GGUF Q4_1's form)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(q, scales, lo + 8 * scales, group, n, k)


def test_compiled_decode_runs_packed_4bit_weights_like_the_eager_step(llama_dir, graphs_serve_every_batch, monkeypatch):
    """4-bit linears and an int8 head, as `--weight-format auto` serves a Q4 GGUF: inside the graph each
    linear is one opaque op that picks the packed GEMV (few rows) or the dense copy's oneDNN GEMM (more) at run
    time, like the eager step; the logits match the eager step's within bf16 rounding on both."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    monkeypatch.setitem(cpu_ops.TUNE["linear_w4a16"], "packed_max_m", 4)  # so that 8 rows take the dense copy
    monkeypatch.setitem(cpu_ops.TUNE["linear_w4a16"], "dense_copy", True)
    path, _ = llama_dir
    model, tokenizer = load_model(path, "safetensors", torch.float32, "cpu", progress=False)
    for m in model.modules():
        if isinstance(m, Linear) and m is not model.lm_head:
            m.qweight, m._op, m.weight = ops.prepare_weight("linear_w4a16", _int4(m.weight)), "linear_w4a16", None
    model.lm_head.quantize_int8()
    model.prepare(CONFIG["max_model_len"])
    engine = LLMEngine(model, tokenizer, EngineConfig(**CONFIG))
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.max_batch >= 2
    engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))  # fill some cache
    for n in (1, 3, 8):  # 8 rows: past the packed kernels' rows
        rows = ([7 + i for i in range(n)], [5] * n, [4 * (i + 1) + 1 for i in range(n)], [[i + 1, i + 2] for i in range(n)],
                [6] * n, [0] * n)
        with torch.inference_mode():
            eager = engine.runner._decode(DecodeInputs.build(*rows, "cpu"))
        got = compiled.run(*rows)
        assert got.shape == eager.shape == (n, 211)
        rel = ((got - eager).norm(dim=-1) / eager.norm(dim=-1)).max().item()
        assert rel < 0.02, f"{n} rows: compiled logits {rel:.4f} from the eager step's"
