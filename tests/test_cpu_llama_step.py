"""The cpu backend's C++ decode step for the llama family (backends/cpu/llama_step.py, csrc/llama_step.cpp).

It must compute exactly what the eager step computes (the same kernels in the same order), serve only the
steps the eager step would run on those kernels, and take the place of the background compile by default.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_engine
from flagdeploy.backends.cpu import native

from flagdeploy import ops
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.decode_inputs import DecodeInputs
from flagdeploy.engine.llm_engine import LLMEngine
from flagdeploy.engine.replica import load_model
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer
from flagdeploy.models.linear import Linear
from flagdeploy.ops.weights import Int4Weight

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not native.available(), reason="the cpu backend's kernels are not built here")

VOCAB = 256


def _checking(runner) -> list[int]:
    """Makes every step the C++ step serves run eagerly too and compare logits bit for bit; returns the row
    counts of the steps it served (so a test can see it served some)."""
    served, step = [], runner.native
    run = step.run

    def both(ids, positions, slots, tables, ctx, verify=False, logits_rows=None):
        got = run(ids, positions, slots, tables, ctx, verify=verify, logits_rows=logits_rows)
        # the same k/v rewritten to the same slots; a verify step (or a prompt's rows) in the eager step's verify mode
        with torch.inference_mode(), ops.verify_step() if verify else contextlib.nullcontext():
            eager = runner._decode(DecodeInputs.build(ids, positions, slots, tables, ctx, None, "cpu"))
        eager = eager if logits_rows is None else eager[logits_rows]
        assert torch.equal(got, eager), f"{len(ids)} rows: the C++ step's logits differ from the eager step's"
        served.append(len(ids))
        return got

    step.run = both
    return served


def test_the_default_model_decodes_bit_for_bit_as_the_eager_step_and_compiles_nothing(default_model):
    """The embedded Q4_1 GGUF as serve loads it: batched, lone, with prefix-cache hits; and serve's default
    (compile=None) starts no background compile for a model the C++ step serves."""
    engine = make_engine(default_model, "auto", compile=None, max_num_seqs=4, max_model_len=256, num_scheduler_steps=1)
    runner = engine.runner
    assert runner.native is not None and runner.compiling is None and runner.compiled is None
    served = _checking(runner)
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):", "1, 2, 3, 4,")]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = engine.generate(prompts + [prompts[0]], greedy)  # the repeat hits the prefix cache
    alone = engine.generate([prompts[1]], greedy)
    assert batched[1] == alone[0] and batched[0] == batched[3]
    assert 1 in served and 4 in served and len(served) >= 20
    # the prompts ran there too, as rows (the AVX2 table keeps no dense copy: backends/cpu/tune.yaml prompt_max_keys)
    assert served[0] == sum(map(len, prompts)) + len(prompts[0]) or runner.native.prompt_max_keys == 0


def test_a_bf16_residual_stream_decodes_bit_for_bit_as_the_eager_step(default_model):
    """The default model loaded in bfloat16 (embedding, norms and residual stream in bf16: the step's other
    workspace) through the C++ step: every served step's logits are the eager step's."""
    engine = make_engine(default_model, "auto", dtype=torch.bfloat16, max_num_seqs=4, max_model_len=256,
                         num_scheduler_steps=1)
    runner = engine.runner
    assert runner.native is not None and runner.model.embed_tokens.dtype == torch.bfloat16
    served = _checking(runner)
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):")]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert 2 in served and len(served) >= 7  # the two decoding together, step after step


def test_speculative_verify_steps_run_in_the_cpp_step_and_keep_greedy_output_exact(default_model):
    """A verify step (a sequence's last token and its drafts) runs in the C++ step too, every row's logits those of
    the eager step's verify mode bit for bit, its head on the packed kernel at any row count (as a plain decode row
    takes it): greedy output with ngram speculation equals greedy output without, token for token."""
    on, _, _ = _speculating_as_without(default_model)
    assert on.stats()["spec_decode_num_accepted_tokens"] > 0


def _speculating_as_without(default_model, **options):
    """(on, off, prompt): engines of the default model with ngram speculation (K = 4) and without, `options` for
    both; asserts that greedy output on a repeating prompt is the same token for token, every step the C++ step
    served being the eager step's bit for bit (`_checking`), among them a verify step of 1 + 4 rows."""
    from flagdeploy.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    small = dict(compile=None, max_num_seqs=2, max_model_len=512, **options)
    on = make_engine(default_model, "auto", speculative=spec, **small)
    off = make_engine(default_model, "auto", **small)
    served = _checking(on.runner)
    tok = on.tokenizer
    text = "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}]))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert on.generate([ids], greedy) == off.generate([ids], greedy)
    assert 5 in served, f"the C++ step served no verify step of 1 + 4 rows (one sequence): {served}"
    return on, off, ids


def test_q8_activations_decode_bit_for_bit_as_the_eager_step_and_speculate_exactly(default_model):
    """`serve --q8-activations`: every 4-bit linear of the default model and its int8 LM head take one int8
    activation part (the C++ step is built with it), the C++ step's logits are still the eager step's bit for bit,
    speculation stays exact, and the answers' log-probabilities move (it is not the default's arithmetic)."""
    from flagdeploy.backends.cpu import llama_step

    on, off, ids = _speculating_as_without(default_model, q8_activations=True)
    default = make_engine(default_model, "auto", compile=None, max_num_seqs=2, max_model_len=512)
    bundles = [b.prepared for m in on.runner.model.modules() if isinstance(m, Linear) for b in m.bundles()
               if isinstance(b.prepared, dict) and ("nib" in b.prepared or "w8" in b.prepared)]
    assert len(bundles) == 121 and all(p["parts"] == 1 for p in bundles)
    assert "w8" in on.runner.model.lm_head.qweight.prepared
    assert llama_step.dims(on.runner.model)[4] == 1 and llama_step.dims(default.runner.model)[4] == 2
    lp = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    q8, full = ([o.logprobs[0].logprob for o in _outputs(e, [("a", ids)], lp)] for e in (off, default))
    assert len(q8) == len(full) == 4 and q8 != full


def test_q8_activations_say_when_they_change_nothing(default_model, caplog):
    """Dense weights (`--weight-format dense`) have no int4 kernel to give its finer activations up: a warning says
    so rather than the flag passing unnoticed."""
    with caplog.at_level("WARNING", logger="flagdeploy.engine.model_loading"):
        load_model(default_model.path, default_model.format, torch.float32, "cpu", progress=False,
                   weight_format="dense", q8_activations=True)
    assert "--q8-activations changes nothing here" in caplog.text


def _counting_calls(runner) -> list[list[int]]:
    """The step counts of each multi-step call the C++ step serves."""
    calls, run_steps = [], runner.native.run_steps

    def counted(ids, positions, ctx, counts, *rest):
        calls.append(list(counts))
        return run_steps(ids, positions, ctx, counts, *rest)

    runner.native.run_steps = counted
    return calls


def test_several_steps_in_one_call_give_the_tokens_of_one_step_at_a_time(default_model):
    """--num-scheduler-steps: a call of the C++ step decodes several steps, each row's token chosen inside it as the
    sampler chooses it; greedy, seeded sampled (EOS honoured), stop strings that end a sequence inside a call and
    max_tokens that are no multiple of the steps all give the tokens of one step at a time."""
    one = make_engine(default_model, "auto", compile=None, max_num_seqs=4, max_model_len=256, num_scheduler_steps=1)
    many = make_engine(default_model, "auto", compile=None, max_num_seqs=4, max_model_len=256, num_scheduler_steps=4)
    assert one.multi_step == 1 and many.multi_step == 4
    calls = _counting_calls(many.runner)
    tok = one.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in ("Write a haiku about the sea.", "What is 2 + 2?", "Name a colour.", "def fib(n):")]
    cases = [[SamplingParams(max_tokens=13 + i, temperature=0, ignore_eos=True) for i in range(4)],
             [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=s) for s in range(4)],
             SamplingParams(max_tokens=24, temperature=0, stop=[" the", "4"])]
    for params in cases:
        assert many.generate(prompts, params) == one.generate(prompts, params)
    assert calls and max(max(c) for c in calls) == 4
    assert any(len(set(c)) > 1 for c in calls), "no call with sequences of different step counts"


def test_multi_step_yields_to_arrivals_and_to_a_full_cache(default_model):
    """A request that arrives while others decode is admitted before the next call (that step runs one token a
    sequence); a cache too small for every sequence's next four slots grants what it can, and preempts; a batch the
    runner does not take as several steps runs as one, its placeholders' slots given back: the tokens stay those of
    one step at a time, and no block is lost."""
    one = make_engine(default_model, "auto", compile=None, max_num_seqs=4, max_model_len=128, num_scheduler_steps=1)
    tok = one.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def f(x):")]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = one.generate(prompts, greedy)
    block = one.runner.bytes_per_block(one.runner.model, one.config.block_size)
    # 8 blocks of 16: fewer than four sequences of ~46 tokens take; a budget of 3 tokens a step: fewer than the
    # sequences, so a step leaves one out (its placeholders must not outlive the step)
    for memory, refused, budget in ((512 << 20, False, 256), (8 * block, False, 256), (512 << 20, True, 256),
                                    (512 << 20, False, 3)):
        many = make_engine(default_model, "auto", compile=None, max_num_seqs=4, max_model_len=128,
                           num_scheduler_steps=4, kv_cache_memory=memory, max_num_batched_tokens=budget)
        if refused:
            many.runner.takes_steps = lambda batch: False
        calls = _counting_calls(many.runner)
        got = {i: [] for i in range(len(prompts))}
        many.add_request("r0", prompts[0], greedy)
        pending, steps = list(range(1, len(prompts))), 0
        while many.has_work() or pending:
            if pending and steps % 3 == 2:  # the others arrive one by one, each while earlier ones decode
                i = pending.pop(0)
                many.add_request(f"r{i}", prompts[i], greedy)
            for out in many.step():
                got[int(out.request_id[1:])].extend(out.token_ids)
            steps += 1
        case = f"cache of {memory} bytes, refused: {refused}, budget {budget}"
        assert [got[i] for i in range(len(prompts))] == want, case
        assert bool(calls) != refused or budget < 4, case
        assert many.blocks.num_free == many.blocks.num_blocks, case
        assert many.spec_num_drafts == 0, f"{case}: placeholders verified as drafts"
        assert many.scheduler.num_preemptions > 0 or memory > 8 * block, case


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) whose shapes the packed kernels tile."""
    path = tmp_path_factory.mktemp("qwen2")
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # random init leaves biases at zero, which would test nothing
    hf.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


def _int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(q, scales, lo + 8 * scales, group, n, k)


def _int4_engine(path) -> LLMEngine:
    """An engine over the tiny Qwen2 at `path`: its linears 4-bit, its head int8, laid out by the tune table as
    it stands (tests patch it first), blocks of 4 tokens, one step a call."""
    model, tokenizer = load_model(path, "safetensors", torch.float32, "cpu", progress=False)
    for m in model.modules():
        if isinstance(m, Linear) and m is not model.lm_head:
            m.qweight, m._op, m.weight = ops.prepare_weight("linear_w4a16", _int4(m.weight)), "linear_w4a16", None
    model.lm_head.quantize_int8()
    model.prepare(64)
    return LLMEngine(model, tokenizer, EngineConfig(max_model_len=64, max_num_seqs=8, block_size=4, num_scheduler_steps=1))


def test_biases_an_int8_head_and_the_eager_steps_row_limit(qwen2_dir, monkeypatch):
    """4-bit linears with biases and an int8 head: bit for bit the eager step's logits; at more rows than the
    packed kernels take (`packed_max_m`), and past the native attention's keys, the eager step serves (its
    dense copies and other attention forms round differently)."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    monkeypatch.setitem(cpu_ops.TUNE["linear_w4a16"], "packed_max_m", 4)
    monkeypatch.setitem(cpu_ops.TUNE["linear_w4a16"], "dense_copy", True)
    monkeypatch.setitem(cpu_ops.TUNE["paged_attention_decode"], "native_max_keys", 32)
    monkeypatch.setitem(cpu_ops.TUNE["paged_attention_decode"], "prompt_max_keys", 0)  # prompts: a prefill
    engine = _int4_engine(qwen2_dir)
    assert engine.runner.model.layers[0].qkv_proj.bias is not None
    step = engine.runner.native
    assert step is not None and step.max_rows == 4
    assert step.serves(4, 8) and not step.serves(5, 1) and not step.serves(1, 9)
    served = _checking(engine.runner)
    prompts = [[5 + i, 17, 42, 99 - i] for i in range(6)]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # 34 tokens: past 32 keys
    engine.generate(prompts, greedy)  # 6 rows: the eager step
    assert served == []
    engine.generate(prompts[:3], greedy)  # 3 rows: the C++ step until the tables pass 32 keys (8 blocks of 4)
    assert served == [3] * 28  # contexts of 5 to 32 tokens; the 29th decode step reads 33


def test_prompt_rows_beside_dense_copies(qwen2_dir, monkeypatch):
    """Where the linears keep a dense copy (the AVX-512 tables' bf16 for oneDNN) and the table gives a
    `prompt_max_keys`, a short prompt's tokens run as rows of the C++ step however many there are (past the
    `packed_max_m` that bounds plain decode steps), bit for bit the eager step's verify mode; a longer prompt, or
    any prompt on a table without the setting, is a prefill on the copies, as before."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    for op in ("linear_w4a16", "linear_w8a16"):
        monkeypatch.setitem(cpu_ops.TUNE[op], "packed_max_m", 4)
        monkeypatch.setitem(cpu_ops.TUNE[op], "dense_copy", True)
    monkeypatch.setitem(cpu_ops.TUNE["paged_attention_decode"], "prompt_max_keys", 12)
    engine = _int4_engine(qwen2_dir)
    step = engine.runner.native
    assert step.max_rows == 4 and step.prompt_max_keys == 12
    assert step.serves(10, 3, verify=True) and not step.serves(10, 3)
    served = _checking(engine.runner)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    short = [5, 17, 42, 99, 3, 8, 61, 23, 14, 77]
    rows = engine.generate([short], greedy)[0]
    assert served == [10, 1, 1]  # the prompt's 10 rows, then two decode steps
    served.clear()
    engine.generate([short + [9, 10, 11]], greedy)  # 13 tokens: past prompt_max_keys, a prefill
    assert served == [1, 1]
    served.clear()
    step.prompt_max_keys = 0  # a table without the setting: the same prompt as a prefill on the dense copies
    prefill = engine.generate([[6] + short[1:]], greedy)[0]
    assert served == [1, 1] and len(prefill) == len(rows) == 3
    # a sequence's decode rows in a step beside another's prefill take the kernel they take alone: its tokens'
    # logprobs, bit for bit, whether or not a prompt arrived while it decoded
    lp = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    alone = [o.logprobs[0].logprob for o in _outputs(engine, [("a", [8, 3, 44])], lp)]
    beside = [o.logprobs[0].logprob for o in _outputs(engine, [("b", [8, 3, 44]), ("c", short)], lp) if o.request_id == "b"]
    assert beside == alone


def _outputs(engine, requests, params):
    """Every output of the requests, the first added alone and each later one after the engine's next step."""
    engine.add_request(*requests[0], params)
    outs = engine.step()
    for rid, ids in requests[1:]:
        engine.add_request(rid, ids, params)
        outs += engine.step()
    while engine.has_work():
        outs += engine.step()
    return outs


def test_a_dense_model_keeps_the_eager_step(llm_engine):
    """float32 weights (`--weight-format dense`, transformers' numbers) never take the C++ step."""
    assert llm_engine.runner.native is None


@pytest.fixture
def prompt_rows(monkeypatch):
    """The AVX2 table's choices whatever this CPU is: no dense copies beside the packed kernels, and prompts as
    decode rows up to a `prompt_max_keys` (tune.yaml; 1024 here, far past the test's prompts)."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    for op in ("linear_w4a16", "linear_w8a16"):
        monkeypatch.setitem(cpu_ops.TUNE[op], "dense_copy", False)
    monkeypatch.setitem(cpu_ops.TUNE["paged_attention_decode"], "prompt_max_keys", 1024)


def test_a_prompt_runs_as_rows_and_computes_the_same_whole_chunked_or_cached(default_model, prompt_rows):
    """A prompt's tokens as decode rows in the C++ step, each row bit for bit the eager step's: its first tokens'
    logprobs the same when the prompt arrives whole, in chunks of 16 (a step's token budget shared with others
    decides where a chunk ends) and after a prefix-cache hit leaves its last few tokens; a prompt longer than
    `prompt_max_keys` is an eager prefill, as before."""
    tok_ids = None
    got = []
    for budget in (256, 16):
        engine = make_engine(default_model, "auto", max_num_batched_tokens=budget, max_num_seqs=4)
        assert engine.runner.native.prompt_max_keys == 1024
        served = _checking(engine.runner)
        tok = engine.tokenizer
        tok_ids = tok_ids or tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}]))
        params = SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)
        for rid in ("cold", "cached"):
            engine.add_request(rid, tok_ids, params)
            lps = []
            while rid in engine.requests:
                lps += [lp.logprob for out in engine.step() if out.request_id == rid for lp in out.logprobs or []]
            got.append(lps)
        n, bs = len(tok_ids), engine.runner.block_size
        cold = [min(budget, n - i) for i in range(0, n, budget)]
        assert [m for m in served if m > 1] == cold + [n - (n - 1) // bs * bs]  # then the cached prompt's tail
    assert len(got[0]) == 3 and all(g == got[0] for g in got), got
    # prompt logprobs (`echo`, one scoring pass) take the same rows: the first token's logprob exactly as generated
    first = engine.generate([tok_ids], SamplingParams(max_tokens=1, temperature=0))[0]
    scored = engine._prompt_logprobs(tok_ids + first, 0)[-1]
    assert scored.logprob == got[0][0]
    engine.runner.native.prompt_max_keys = len(tok_ids) - 1  # now too long: the eager prefill's step
    served.clear()
    engine.generate([[7] + tok_ids[1:]], SamplingParams(max_tokens=2, temperature=0))
    assert served == [1]
