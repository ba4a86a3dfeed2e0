"""The builtin engine on the default model: batching, prefix caching, chunking and preemption change no token."""

from __future__ import annotations

import asyncio

import pytest

from conftest import make_engine

from flagdeploy.engine import AsyncEngine, SamplingParams
from flagdeploy.errors import PromptTooLongError

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Explain in one sentence why the sky is blue, please, and keep it short and simple for a child.",
    "2+2=",
    "Tell me a fact about cats.",
    "Translate 'good morning' to Spanish.",
    "What is photosynthesis? Answer briefly, in a few words only.",
    "Say hello.",
]


def _ids(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def llm_engine(default_model):
    """Dequantised float32 weights: every kernel here gives a row the same result whatever the batch,
    so batching must not change a single token. (weight_format="auto" switches kernels by batch size,
    which can flip near-ties; tests/test_quantized_weights.py holds it to its own bounds.)"""
    return make_engine(default_model, "dense")


@pytest.fixture(scope="module")
def alone(llm_engine):
    """Each question's greedy output when it runs by itself."""
    return [llm_engine.generate([_ids(llm_engine, q)], GREEDY)[0] for q in QUESTIONS]


def test_concurrent_batch_gives_the_same_tokens_as_alone(llm_engine, alone):
    prompts = [_ids(llm_engine, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 4  # different lengths in one batch
    assert llm_engine.generate(prompts, GREEDY) == alone


def test_prefix_cache_hit_gives_the_same_tokens(llm_engine, alone):
    before = llm_engine.stats()["prefix_cache_hit_tokens"]
    ids = _ids(llm_engine, QUESTIONS[2])
    assert llm_engine.generate([ids], GREEDY)[0] == alone[2]
    hit = llm_engine.stats()["prefix_cache_hit_tokens"] - before
    assert hit >= (len(ids) - 1) // 16 * 16 > 0  # every full block of the prompt came from the cache


def test_chunked_prefill_and_preemption_give_the_same_tokens(default_model, llm_engine, alone):
    # Tiny budget (prompts arrive in chunks of 7) and a cache too small for all eight at once.
    tight = make_engine(default_model, "dense", max_model_len=80, max_num_batched_tokens=7,
                        block_size=4, max_num_seqs=8, kv_cache_memory=24 * 4 * 46080)
    prompts = [_ids(tight, q) for q in QUESTIONS]
    assert tight.generate(prompts, GREEDY) == alone
    assert tight.stats()["preemptions"] > 0


def test_seed_reproduces_and_sampling_varies(llm_engine):
    ids = _ids(llm_engine, "Write a short poem.")
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=123, ignore_eos=True)
    a, b = llm_engine.generate([ids, ids], [p, p])
    assert a == b
    others = llm_engine.generate([ids] * 3, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True)
                                              for s in (1, 2, 3)])
    assert len({tuple(o) for o in others}) > 1


def test_stop_strings_token_ids_and_max_tokens(llm_engine):
    ids = _ids(llm_engine, "What is the capital of France?")
    full = llm_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    text = llm_engine.tokenizer.decode(full)
    assert "Paris" in text
    llm_engine.add_request("stop-str", ids, SamplingParams(max_tokens=12, temperature=0, stop=["Paris"]))
    outs = []
    while "stop-str" in llm_engine.requests:
        outs += [o for o in llm_engine.step() if o.request_id == "stop-str"]
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == text[: text.index("Paris")]
    assert llm_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[full[2]]))[0] == full[:3]
    assert len(llm_engine.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]) == 3


def test_prompt_too_long_is_rejected(llm_engine):
    with pytest.raises(PromptTooLongError, match="max-model-len"):
        llm_engine.add_request("long", list(range(5, 1029)), GREEDY)
    assert "long" not in llm_engine.requests


def test_async_engine_streams_and_aborts(llm_engine):
    engine = AsyncEngine(llm_engine)

    async def run():
        ids = _ids(llm_engine, "Count from one to fifty.")
        got = [o async for o in engine.generate(ids, SamplingParams(max_tokens=8, temperature=0), "a1")]
        assert got[-1].finished and sum(len(o.token_ids) for o in got) == got[-1].num_output_tokens
        stream = engine.generate(ids, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), "a2")
        await stream.__anext__()
        await stream.aclose()  # what a client disconnect does
        for _ in range(100):
            if "a2" not in llm_engine.requests:
                break
            await asyncio.sleep(0.05)
        assert "a2" not in llm_engine.requests

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_out_of_vocabulary_prompt_is_rejected_before_it_can_break_a_batch(llm_engine):
    with pytest.raises(ValueError, match="token ids"):
        llm_engine.add_request("oov", [1, 2, llm_engine.model.cfg.vocab_size], GREEDY)
    assert "oov" not in llm_engine.requests


def test_tiny_temperatures_are_greedy(llm_engine):
    """A temperature of 1e-300 would make logits infinite and the softmax NaN: it decodes greedily
    (found by the schema fuzzer, where it took the whole batch's step down)."""
    ids = llm_engine.tokenizer.encode("The capital of France is")
    tiny = SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm_engine.generate([ids], tiny) == llm_engine.generate([ids], greedy)


# ---- penalties, logit_bias, min_p (OpenAI's and vLLM's logits adjustments) ----------------------------------

def test_penalties_and_bias_change_the_logits_as_vllm_does():
    """One row by hand: repetition over prompt + output, then frequency and presence over the output, then
    logit_bias; a row without any of them is the same tensor."""
    import torch

    from flagdeploy.engine.sampler import adjust_logits
    from flagdeploy.engine.sequence import Sequence

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: -10.0})
    seq = Sequence("a", [0, 1], p, 8)  # prompt: tokens 0 and 1
    seq.token_ids += [3, 3]  # output: token 3 twice
    plain = Sequence("b", [0], SamplingParams(), 8)
    got = adjust_logits(logits, [seq, plain])
    want = torch.tensor([2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 2 * 0.5 - 0.25, 1.0 - 10.0])
    torch.testing.assert_close(got[0], want)
    assert torch.equal(got[1], logits[1])
    assert adjust_logits(logits, [plain, plain]) is logits


def test_min_p_keeps_what_is_likely_enough():
    import torch

    from flagdeploy.engine.sampler import probs_for

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_for(logits, SamplingParams(temperature=1.0, min_p=0.25))[0]  # keeps p >= 0.125
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_logit_bias_and_penalties_steer_greedy_decoding(llm_engine):
    ids = _ids(llm_engine, "Count from one to ten in words.")
    plain = llm_engine.generate([ids], GREEDY)[0]
    forced = llm_engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, logit_bias={plain[0]: -100.0,
                                                                                                   7: 100.0}))[0]
    assert forced == [7, 7, 7, 7]
    banned = llm_engine.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                       logit_bias={plain[0]: -100.0}))[0]
    assert banned[0] != plain[0]
    fresh = llm_engine.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                      presence_penalty=2.0, frequency_penalty=2.0))[0]
    assert len(set(fresh)) > len(set(plain))  # the penalties make it repeat itself less
    with pytest.raises(ValueError, match="logit_bias takes token ids"):
        llm_engine.add_request("bias-oov", ids, SamplingParams(logit_bias={llm_engine.model.cfg.vocab_size: 1.0}))
    assert not llm_engine.has_work()


def test_incremental_text_is_the_whole_decode_and_the_fast_decode_is_transformers(llm_engine):
    """The detokenizer's deltas add up to the output's decode (multi-byte characters held back until whole), and
    the tokenizer's decode, which goes straight to the `tokenizers` library where transformers adds nothing,
    gives transformers' text: special tokens kept or skipped; a tokenizer that cleans up spaces keeps
    transformers' decode."""
    from flagdeploy.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = llm_engine.tokenizer
    ids = tok.encode("Déjà vu: 日本語 ☕, \"quotes\" and  spaces.") + [tok.hf.eos_token_id] + tok.encode(" end")
    assert tok._rust_decode is not None  # the default model's fast BPE tokenizer
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tok.hf.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas)
    tok.hf.clean_up_tokenization_spaces = True
    try:
        assert Tokenizer(tok.hf)._rust_decode is None
    finally:
        tok.hf.clean_up_tokenization_spaces = False
