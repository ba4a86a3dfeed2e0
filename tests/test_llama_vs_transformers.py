"""Our llama family against transformers' LlamaForCausalLM: same weights in, same logits and tokens out."""

from __future__ import annotations

import pytest
import torch
import transformers

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer
from flagdeploy.models.attention import AttentionMetadata

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


def _prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through our model and a scratch region of the paged cache."""
    t = len(ids)
    cu = torch.tensor([0, t], dtype=torch.int32)
    meta = AttentionMetadata(
        positions=torch.arange(t), slot_mapping=torch.arange(t), num_prefill_tokens=t, cu_seqlens_q=cu,
        cu_seqlens_k=cu, prefill_kv_slots=None, block_tables=None, context_lens=None, logits_indices=torch.arange(t),
    )
    caches = [[torch.zeros_like(c) for c in layer] for layer in engine.runner.kv_caches]
    return engine.model(torch.tensor(ids), meta, caches)


@pytest.fixture(scope="module")
def hf_model(default_model):
    # transformers needs `accelerate` (a test extra) to read GGUF files
    path = default_model.path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does for us
    model.generation_config.pad_token_id = 0
    return model.eval()


def _chat_ids(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_prefill_logits_match_transformers(llm_engine, hf_model):
    ids = _chat_ids(llm_engine, PROMPTS[0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = _prefill_logits(llm_engine, ids)
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_continuations_match_transformers(llm_engine, hf_model):
    """32 greedy tokens through our paged decode path equal transformers' generate, for three prompts."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for text in PROMPTS:
        ids = _chat_ids(llm_engine, text)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert llm_engine.generate([ids], params)[0] == ref, text


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_safetensors_checkpoint_prefill_and_decode(tmp_path, model_type):
    """A small random HF checkpoint written as sharded safetensors loads and agrees step by step."""
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    cfg = cfg_cls(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    write_word_tokenizer(tmp_path, 211)
    engine = build_llm_engine(tmp_path, "safetensors", EngineConfig(max_model_len=128, block_size=4,
                                                                   kv_cache_memory=4 << 20), chip="cpu", progress=False)
    ids = [5, 17, 42, 99, 3, 150, 7, 8, 9, 11]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(engine, ids), want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0] == gen[0, len(ids):].tolist()
