"""The cuda backend on a real GPU (skipped without one): every override against the reference, and the
engine on the GPU against transformers on the same GPU, for a tiny random glm5_next and a llama.

Run on the H200 through the device tool (see docs/backends/cuda.md for the command and the results)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_every_cuda_override_matches_the_reference():
    from flagdeploy import ops
    from flagdeploy.ops.check import check_backend

    be = ops.get_backend("cuda")
    llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336}
    results = check_backend(be) + check_backend(be, dtypes=(torch.bfloat16,), config=llama)
    bad = [r for r in results if not r.passed]
    assert not bad, bad
    assert {r.op for r in results if r.impl == "native"} >= set(be.overrides) - {"moe_experts"}


def test_grouped_gemm_experts_match_the_reference():
    from flagdeploy import ops

    g = torch.Generator().manual_seed(0)
    e, h, i, t = 16, 256, 128, 64
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(t)])
    routing = torch.zeros(t, e).scatter_(1, ids, torch.rand(t, 4, generator=g)).to(torch.bfloat16)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(torch.bfloat16)
    want = ops.OPS["moe_experts"].reference(x.double(), routing.double(), gate_up.double(), down.double(), 7.0)
    got = ops.get_backend("cuda").overrides["moe_experts"](x.cuda(), routing.cuda(), gate_up.cuda(), down.cuda(), 7.0)
    torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)


def _engine(path, **kw):
    from flagdeploy.engine import EngineConfig
    from flagdeploy.engine.replica import build_llm_engine

    cfg = dict(max_model_len=256, block_size=16, kv_cache_memory=64 << 20, dtype=torch.float32)
    cfg.update(kw)
    return build_llm_engine(path, "safetensors", EngineConfig(**cfg), chip="cuda", progress=False)


def _tiny_llama(path):
    """The 3-layer random llama of this file's llama tests (tests/conftest.py `write_tiny_llama`)."""
    pytest.importorskip("transformers")
    from conftest import write_tiny_llama

    return write_tiny_llama(path, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=8, max_position_embeddings=512)


def test_glm5_next_on_the_gpu_matches_transformers_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm5NextForConditionalGeneration"):
        pytest.skip("this transformers has no glm5_next (5.23 ships it)")
    from flagdeploy.engine import SamplingParams
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    src = write_tiny_glm5_next(tmp_path / "glm", index_topk=256)
    ids = torch.randint(2, 64, (40,), generator=torch.Generator().manual_seed(1))
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).float().cuda().eval()
    with torch.no_grad():
        want = hf(input_ids=ids[None].cuda()).logits[0].float()
    engine = _engine(src)
    assert next(engine.model.parameters()).device.type == "cuda"
    got = engine.model.score(ids.cuda())
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    with torch.no_grad():
        ref = hf.generate(ids[None].cuda(), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert engine.generate([ids.tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0] == ref


def test_glm5_next_decode_graphs_match_eager_and_transformers(tmp_path):
    """glm5_next's decode step replayed as CUDA graphs (KDA state rows, DSA top-k selection over the
    block tables, MoE dispatch sized by top_k) gives the eager engine's and transformers' greedy tokens,
    padded batches included, with contexts long enough for the indexer to select."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm5NextForConditionalGeneration"):
        pytest.skip("this transformers has no glm5_next (5.23 ships it)")
    from flagdeploy.engine import SamplingParams
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    src = write_tiny_glm5_next(tmp_path / "glm")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graphed, eager = _engine(src, max_num_seqs=4, block_size=4), _engine(src, cuda_graphs=False, block_size=4)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    got = graphed.generate(prompts, params)
    assert got == eager.generate(prompts, params)
    assert graphed.generate(prompts[:1], params) == [got[0]]
    assert {b for b, _ in graphed.runner.graphs.graphs} == {1, 4}  # batch buckets (one table width here)
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for p, tokens in zip(prompts, got):
            ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
            assert tokens == ref


def test_llama_on_the_gpu_matches_transformers_on_the_gpu(tmp_path):
    from flagdeploy.engine import SamplingParams

    ref = _tiny_llama(tmp_path).cuda()
    engine = _engine(tmp_path)
    ids = [5, 17, 42, 99, 3, 150, 7, 8, 9, 11]
    with torch.no_grad():
        want = ref(torch.tensor([ids]).cuda()).logits[0].float()
    torch.testing.assert_close(engine.model.score(torch.tensor(ids).cuda()), want, atol=1e-3, rtol=1e-3)
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]).cuda(), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0] == gen[0, len(ids):].tolist()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fp8_block_linear_on_fp8_tensor_cores(rows):
    """The override against the reference at GLM-5.3-Flash's q_b shape, on the FP8 path (not its fallback)."""
    from flagdeploy import ops
    from flagdeploy.backends.cuda import ops as cuda_ops
    from flagdeploy.ops.weights import Fp8BlockWeight, to_device

    g = torch.Generator().manual_seed(rows)
    w = Fp8BlockWeight.quantize(torch.randn(16384, 1536, generator=g) * 1536 ** -0.5)
    x = torch.randn(rows, 1536, generator=g).to(torch.bfloat16)
    want = ops.OPS["linear_fp8_block"].reference(x.double(), w)
    got = cuda_ops.linear_fp8_block(x.cuda(), to_device(w, "cuda"))
    assert cuda_ops._FP8_NATIVE["ok"], "the blockwise FP8 GEMM fell back to the reference"
    assert got.dtype == torch.bfloat16
    # Hopper's FP8 tensor cores accumulate with less than float32 precision: on the H200 one output in a
    # million (rows=64) landed at 0.034 from the float64 reference, past the op's bf16 tolerance of 0.03
    torch.testing.assert_close(got.double().cpu(), want, atol=5e-2, rtol=3e-2)


def test_fp8_glm5_next_keeps_fp8_weights_on_the_gpu(tmp_path):
    """An FP8 checkpoint on an FP8 GPU: the MLA projections and the routed experts stay FP8, the logits
    stay near the dequantised model's (the activations are quantised to FP8 too), and decoding through
    the CUDA graphs (FP8 experts in the Triton kernels) gives the eager engine's tokens."""
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next
    from flagdeploy.ops.weights import Fp8BlockWeight

    src = write_tiny_glm5_next(tmp_path / "fp8", fp8=True, index_topk=256)
    ids = torch.randint(2, 64, (60,), generator=torch.Generator().manual_seed(0)).cuda()
    fp8 = _engine(src)
    assert isinstance(fp8.model.layers[1].attn.latent_proj.qweight, Fp8BlockWeight)
    banks = [layer.mlp.experts for layer in fp8.model.layers if hasattr(layer.mlp, "experts")]
    assert banks and all(isinstance(b.gate_up, Fp8BlockWeight) and isinstance(b.down, Fp8BlockWeight) for b in banks)
    dense = _engine(src, weight_format="dense")
    a, b = fp8.model.score(ids), dense.model.score(ids)
    assert (a - b).norm() / b.norm() < 0.1
    from flagdeploy.engine import SamplingParams

    prompts, params = [ids[:37].tolist(), ids[:9].tolist()], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert fp8.runner.graphs is not None
    assert fp8.generate(prompts, params) == _engine(src, cuda_graphs=False).generate(prompts, params)


def test_cuda_graph_decode_matches_eager(tmp_path):
    """Decode steps replayed as CUDA graphs give the eager engine's tokens, padded batches included."""
    from flagdeploy.engine import SamplingParams

    _tiny_llama(tmp_path)
    prompts = [[5, 17, 42, 99], [3, 150, 7], [8, 9, 11, 12, 13, 14, 15]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    graphed, eager = _engine(tmp_path, max_num_seqs=4), _engine(tmp_path, cuda_graphs=False)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert graphed.generate(prompts, params) == eager.generate(prompts, params)
    assert graphed.generate(prompts[:1], params) == eager.generate(prompts[:1], params)
    assert {b for b, _ in graphed.runner.graphs.graphs} == {1, 4}  # batch buckets (one table width here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mtp_speculation_on_the_gpu_is_exact_and_accepts_an_agreeing_layer(tmp_path, dtype):
    """Greedy MTP speculation with the verify and draft steps replayed as CUDA graphs: a random draft layer
    gives speculation off's tokens (batched, one prompt long enough to chunk), and a layer built to agree
    with its target (tests/conftest.py `agreeing_mtp_layer`) has nearly every draft accepted."""
    from conftest import agreeing_mtp_layer

    from flagdeploy.engine import SamplingParams
    from flagdeploy.engine.speculative import SpeculativeConfig
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    src = write_tiny_glm5_next(tmp_path / "glm", mtp=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    mtp3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    opts = dict(max_num_seqs=4, block_size=4, dtype=dtype)
    off, on = _engine(src, **opts), _engine(src, speculative=mtp3, **opts)
    assert on.runner.verify_graphs is not None and on.proposer.graphs is not None
    assert on.generate(prompts, params) == off.generate(prompts, params)
    assert on.stats()["spec_decode_num_draft_tokens"] > 0
    assert on.runner.verify_graphs.graphs and on.proposer.graphs.graphs
    for engine in (off, on):
        agreeing_mtp_layer(engine.model)
    before = on.stats()
    assert on.generate(prompts, params) == off.generate(prompts, params)
    after = on.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted / drafted > 0.9


def test_ngram_speculation_on_the_gpu_is_exact(tmp_path):
    """Prompt-lookup drafts on a llama, verify rows through the decode graphs: speculation off's tokens."""
    from flagdeploy.engine import SamplingParams
    from flagdeploy.engine.speculative import SpeculativeConfig

    _tiny_llama(tmp_path)
    loop = [5, 17, 42, 99, 3, 150, 7, 8]
    prompts = [loop * 4, [3, 150, 7], loop * 2 + [8, 9, 11]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    off, on = _engine(tmp_path, max_num_seqs=4), _engine(tmp_path, max_num_seqs=4, speculative=ngram)
    assert on.runner.graphs is not None
    assert on.generate(prompts, params) == off.generate(prompts, params)
    assert on.stats()["spec_decode_num_draft_tokens"] > 0


def test_penalties_and_logit_bias_on_the_gpu(tmp_path):
    """The logits adjustments run on the GPU's logits (graphed decode steps): a +100 bias forces its token,
    penalties change the greedy tokens, and a request without them keeps its tokens beside one with them."""
    from flagdeploy.engine import SamplingParams

    _tiny_llama(tmp_path)
    engine = _engine(tmp_path, max_num_seqs=4)
    assert engine.runner.graphs is not None
    prompt, greedy = [5, 17, 42, 99, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = engine.generate([prompt], greedy)[0]
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={7: 100.0})
    penalized = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                               repetition_penalty=1.5)
    out = engine.generate([prompt, prompt, prompt], [forced, penalized, greedy])
    assert out[0] == [7, 7, 7, 7] and out[2] == plain and out[1] != plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dsa_indexer_decode_kernel_keeps_the_lower_pool_at_ties_eager_and_graphed(dtype):
    """The Triton decode indexer at exact ties on the top-k cut (the op check's inputs, flagdeploy/ops/glm.py
    `_tied_pools`), rows padded to several widths (NaN padding): eager and replayed from a CUDA graph, the
    masks are the CPU reference's (of equal scores the lower pool index)."""
    from flagdeploy import ops

    spec = ops.OPS["dsa_indexer_topk_decode"]
    kernel = ops.get_backend("cuda").overrides["dsa_indexer_topk_decode"]
    (q, w, keys, gate, ape, lengths, topk, tail), _ = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(0))
    want = spec.reference(q, w, keys, gate, ape, lengths, topk, tail)
    s = keys.shape[1]
    for extra in (0, 3, 600):
        pad = lambda x: torch.cat([x, torch.full((x.shape[0], extra, x.shape[2]), float("nan"), dtype=dtype)], 1)  # noqa: E731
        args = [x.cuda() for x in (q, w, pad(keys), pad(gate), ape, lengths)]
        eager = kernel(*args, topk, tail)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kernel(*args, topk, tail)  # (compiles the kernels outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = kernel(*args, topk, tail)
        graphed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got in (eager, graphed):
            assert torch.equal(got[:, :s].cpu(), want) and not got[:, s:].any()


def test_greedy_tokens_at_indexer_ties_on_the_gpu_graphed_eager_and_the_cpu(tmp_path):
    """tests/test_mtp.py's tie test on the GPU: a checkpoint whose indexer meets exact ties at its top-k cut,
    greedy requests alone, in batches of 2 and 4 beside prompts of other lengths and all together, with
    speculation off / ngram K=4 / mtp K=3, through the CUDA graphs (decode, verify, draft) and eagerly:
    every arrangement and mode gives the CPU engine's tokens (float32; the reference ops there)."""
    from conftest import TIED_INDEXER, greedy_in_every_arrangement

    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine
    from flagdeploy.engine.speculative import SpeculativeConfig
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    src = write_tiny_glm5_next(tmp_path / "glm", mtp=True, **TIED_INDEXER)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    opts = dict(max_model_len=96, block_size=4, max_num_seqs=4)
    cpu = build_llm_engine(src, "safetensors", EngineConfig(weight_format="dense", kv_cache_memory=64 << 20, **opts),
                           chip="cpu", progress=False)
    want = greedy_in_every_arrangement(cpu, params)["alone"]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    for spec in (None, ngram, SpeculativeConfig(method="mtp", num_speculative_tokens=3)):
        for graphs in (True, False):
            engine = _engine(src, cuda_graphs=graphs, speculative=spec or SpeculativeConfig(), **opts)
            assert (engine.runner.graphs is not None) == graphs
            for arrangement, got in greedy_in_every_arrangement(engine, params).items():
                assert got == want, (spec and spec.method, "graphed" if graphs else "eager", arrangement)
