"""A replica split over two CPU processes (gloo) answers exactly as one process does: the llama family
under tensor parallelism, GLM-5.3-Flash (glm5_next) under tensor and expert parallelism.

The split covers every sharded piece: query heads, key/value heads (an equal share, and a single KV
head replicated on both ranks), qkv bias, the MLP, an odd vocabulary (padded on the last rank), tied
and untied heads; and every engine path: batched prefill, chunked prefill, decode, prompt logprobs.
transformers is the oracle for the split model's logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from flagdeploy import parallel
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next, write_word_tokenizer

PROMPTS = [[5, 17, 42, 99, 3, 150, 7, 8, 9, 11], [200, 1, 33], list(range(40, 75))]
# The same agreement over NCCL where two GPUs are lent (skipped elsewhere); float32 matmuls on a GPU
# sum in another order, hence the looser tolerance there.
CHIPS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                               reason="needs two CUDA devices (NCCL)"))]
TOL = {"cpu": 1e-4, "cuda": 1e-3}


def _checkpoint(path, kv_heads: int, tied: bool):
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, attention_bias=True,
                                   max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(kv_heads)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # a visible qkv bias (qwen2-style): zeros would hide one added on the wrong rows
        for name, p in ref.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.1)
    ref.save_pretrained(path)
    write_word_tokenizer(path, 211)
    return ref


def _engine(path, tp: int, chip: str = "cpu"):
    # 16 tokens per step: the 35-token prompt is prefilled in chunks that read the cache back
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                          tp=tp)
    return build_llm_engine(path, "safetensors", config, chip=chip, progress=False)


def _run(engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = engine.generate(PROMPTS, params)
    logits = engine.runner.score(PROMPTS[0]).cpu()
    return tokens, logits


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("kv_heads,tied", [(2, False), (1, True)], ids=["kv-split", "kv-replicated-tied"])
def test_two_ranks_match_one_and_transformers(tmp_path, kv_heads, tied, chip):
    ref = _checkpoint(tmp_path, kv_heads, tied)
    one = _engine(tmp_path, 1, chip)
    want_tokens, want_logits = _run(one)
    two = _engine(tmp_path, 2, chip)
    try:
        assert parallel.tp_size() == 2
        # this rank holds half the heads, half the MLP and 106 of the 211 vocabulary rows
        layer = two.model.layers[0]
        assert layer.heads == 2 and layer.kv_heads == max(kv_heads // 2, 1)
        assert two.model.embed_tokens.shape[0] == 106
        tokens, logits = _run(two)
        stats = two.stats()
    finally:
        two.close()
    assert parallel.tp_size() == 1  # the group is gone: later models in this process are whole again
    assert not any(p.is_alive() for p in two.runner.workers.procs)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=TOL[chip], rtol=TOL[chip])
    with torch.no_grad():
        oracle = ref(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(logits, oracle, atol=TOL[chip], rtol=TOL[chip])
    assert stats["preemptions"] == 0 and stats["generation_tokens"] == 36


def test_a_split_that_does_not_divide_is_refused_before_workers_start(tmp_path):
    _checkpoint(tmp_path, 2, False)
    with pytest.raises(Exception, match="--tp 3"):
        _engine(tmp_path, 3)
    assert parallel.tp_size() == 1


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_glm5_next_split_engine_matches_one_process(tmp_path, tp, ep, chip):
    """KDA state, MLA latent pools and routed experts split; a 5-token step budget chunks the prefills
    across the KDA state; every rank frees a finished sequence's state."""
    path = write_tiny_glm5_next(tmp_path / "glm5")
    prompts = [[5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19, 23], [12, 14, 16], [33, 35, 37, 39, 41, 43, 45]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def engine(tp: int, ep: int):
        config = EngineConfig(max_model_len=40, max_num_batched_tokens=5, block_size=4, kv_cache_memory=1 << 20,
                              tp=tp, ep=ep)
        return build_llm_engine(path, "safetensors", config, chip=chip, progress=False)

    want = engine(1, 1).generate(prompts, params)
    split = engine(tp, ep)
    try:
        got = split.generate(prompts, params)
        assert split.runner.state_rows == {}  # every finished sequence gave its state rows back
    finally:
        split.close()
    assert got == want


def test_a_rank_that_fails_to_load_is_reported_not_waited_for(tmp_path):
    """A worker whose checkpoint is unreadable reports why; rank 0 raises it instead of hanging."""
    from flagdeploy.engine import lockstep
    from flagdeploy.errors import ModelLoadError

    _checkpoint(tmp_path, 2, False)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    config = EngineConfig(max_model_len=128, kv_cache_memory=4 << 20, tp=2)
    workers = lockstep.start(tmp_path, "safetensors", config, "cpu")
    try:
        with pytest.raises(ModelLoadError, match="rank 1 failed while starting"):
            workers.wait("loaded")
    finally:
        workers.close(force=True)
        parallel.shutdown()
    assert not any(p.is_alive() for p in workers.procs)


def test_glm5_next_image_prompt_split_engine_matches_one_process(tmp_path):
    """An image prompt under --tp 2: rank 0 encodes the image and its rows travel to rank 1 inside the step;
    chunked prefill splits the placeholder run; the tokens are one process's."""
    import json

    from PIL import Image

    from flagdeploy.engine.multimodal import MediaItem
    from flagdeploy.models.glm5_next.processor import Glm5MediaProcessor

    path = write_tiny_glm5_next(tmp_path / "glm5", media=True)
    processor = Glm5MediaProcessor.from_checkpoint(path, json.loads((path / "config.json").read_text()))
    pixels = torch.randint(0, 256, (60, 90, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    inputs = processor.image_inputs(Image.fromarray(pixels.numpy()))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(tp: int) -> list[int]:
        config = EngineConfig(max_model_len=64, max_num_batched_tokens=5, block_size=4, kv_cache_memory=1 << 20, tp=tp)
        engine = build_llm_engine(path, "safetensors", config, chip="cpu", progress=False)
        try:
            text = processor.expand(f"w5 w9 {processor.placeholder('image')} w13", [(inputs, None)])
            ids = engine.tokenizer.encode(text)
            (where,) = processor.positions(ids, [(inputs, None)])
            engine.add_request("r", ids, params, media=[MediaItem("image", "k", where, inputs.pixel_values,
                                                                  inputs.grid_thw)])
            out = []
            while engine.has_work():
                out += [t for o in engine.step() for t in o.token_ids]
            assert engine.stats()["mm_items_encoded"] == 1
            return out
        finally:
            engine.close()

    assert run(2) == run(1)
