"""Prefill-decode disaggregation in the builtin engine (engine/kv_transfer.py), engine to engine.

Two engines in one process, each with its own Mooncake transfer engine on loopback TCP (the real library,
`pip install 'flagdeploy[pd]'`): the prefill engine computes the prompt and stages its caches, the decode
engine pulls them and continues. The decode engine's greedy tokens must equal one engine's alone, for llama
(paged k/v) and for glm5_next (MLA latent and DSA indexer blocks, KDA conv and recurrent state rows, and
with MTP on, the draft layer's rows and last hidden state), without computing any prompt position.
The HTTP side, through vllm-router, is tests/test_pd_serve.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import requires_pd

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.kv_transfer import Arena, KvTransferConfig, KvTransferError
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.engine.speculative import SpeculativeConfig


def _cfg(role: str, **extra) -> KvTransferConfig:
    return KvTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "%s", "kv_buffer_size": %d%s}' % (
        role, 16 << 20, "".join(f', "{k}": {v}' for k, v in extra.items())))


def _engine(path, role: str | None, spec: SpeculativeConfig | None = None, max_num_seqs: int = 4, **extra):
    cfg = EngineConfig(max_model_len=96, block_size=4, max_num_seqs=max_num_seqs, kv_cache_memory=32 << 20,
                       weight_format="dense", kv_transfer=_cfg(role, **extra) if role else None,
                       speculative=spec or SpeculativeConfig())
    return build_llm_engine(path, "safetensors", cfg, chip="cpu", progress=False)


def _run(engine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    outs = []
    while rid in engine.requests or engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _disaggregated(prefill, decode, prompt: list[int], max_tokens: int, rid: str = "r1") -> list[int]:
    outs = _run(prefill, rid, prompt, SamplingParams(max_tokens=1, temperature=0,
                                                     kv_transfer_params={"do_remote_decode": True}))
    ktp = outs[-1].kv_transfer_params
    assert ktp and ktp["do_remote_prefill"] and ktp["remote_block_ids"], ktp
    outs = _run(decode, rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, kv_transfer_params=ktp))
    return [t for o in outs for t in o.token_ids]


def _wait_idle(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.kv_transfer.held and time.monotonic() < deadline:
        time.sleep(0.05)


def test_config_takes_vllms_json_and_refuses_what_it_cannot_run():
    cfg = KvTransferConfig.parse('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}')
    assert cfg.produces and not cfg.consumes
    assert KvTransferConfig.parse('{"kv_connector":"MooncakeConnector","kv_role":"kv_both","kv_port":"20001"}').consumes
    for bad, words in [('{"kv_connector":"Nope","kv_role":"kv_producer"}', "kv_connector"),
                       ('{"kv_connector":"NixlConnector","kv_role":"producer"}', "kv_role"),
                       ('{"kv_connector":"NixlConnector","kv_role":"kv_producer","typo":1}', "typo"),
                       ("not json", "JSON")]:
        with pytest.raises(ValueError, match=words):
            KvTransferConfig.parse(bad)


def test_arena_reuses_freed_regions_and_says_when_full():
    a = Arena(1024)
    x, _ = a.take(100), a.take(500)
    a.give(x, 100)
    assert a.take(64) == x and a.in_use == 64 + 512
    with pytest.raises(KvTransferError, match="kv_buffer_size"):
        a.take(2048)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from conftest import write_tiny_llama

    path = tmp_path_factory.mktemp("pd_llama")
    write_tiny_llama(path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=128)
    return path


def test_llama_greedy_through_prefill_transfer_decode_equals_one_instance(llama):
    requires_pd()
    prompt = [5, 17, 42, 99, 3, 150, 7, 8, 9, 11, 12, 13, 14]
    want = _engine(llama, None).generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    prefill, decode = _engine(llama, "kv_producer"), _engine(llama, "kv_consumer")
    got = _disaggregated(prefill, decode, prompt, 12)
    assert got[:len(want)] == want
    p, d = prefill.stats(), decode.stats()
    assert p["kv_transfer_sent_requests"] == 1 and p["kv_transfer_sent_blocks"] == 4 and p["kv_transfer_sent_bytes"] > 0
    assert d["kv_transfer_received_requests"] == 1 and d["kv_transfer_received_bytes"] == p["kv_transfer_sent_bytes"]
    assert d["kv_transfer_received_prompt_tokens"] == len(prompt)
    assert d["prompt_tokens"] == len(prompt) and decode.num_steps == 11  # 11 decode steps, no prefill step
    _wait_idle(prefill)
    assert prefill.stats()["kv_transfer_held"] == 0 and prefill.stats()["kv_transfer_buffer_bytes_in_use"] == 0
    assert decode.blocks.num_free == decode.blocks.num_blocks and prefill.blocks.num_free == prefill.blocks.num_blocks
    # the prefill side's prefix cache still serves a repeated prompt
    _disaggregated(prefill, decode, prompt, 3, rid="r2")
    assert prefill.blocks.prefix_hit_tokens >= 12


def test_a_failed_transfer_fails_its_request_alone_and_frees_what_it_took(llama):
    requires_pd()
    prefill, decode = _engine(llama, "kv_producer"), _engine(llama, "kv_consumer")
    prompt = [5, 17, 42, 99, 3, 150, 7]
    outs = _run(prefill, "a", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                     kv_transfer_params={"do_remote_decode": True}))
    ktp = dict(outs[-1].kv_transfer_params, remote_port=1)  # a prefill instance that is gone
    with pytest.raises(KvTransferError, match="prefill instance"):
        decode.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0, kv_transfer_params=ktp))
    assert decode.blocks.num_free == decode.blocks.num_blocks and not decode.requests
    assert decode.stats()["kv_transfer_failed"] == 1
    # the decode engine still serves, and the prefill side frees the region it held at its abort timeout
    assert len(decode.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]) == 3
    short = _engine(llama, "kv_producer", kv_connector_extra_config='{"abort_timeout": 0.3}')
    _run(short, "b", prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}))
    assert short.kv_transfer.held
    _wait_idle(short)
    assert short.stats()["kv_transfer_expired"] == 1 and short.stats()["kv_transfer_buffer_bytes_in_use"] == 0


def test_a_layout_mismatch_is_refused_with_what_to_do(llama, tmp_path):
    requires_pd()
    prefill = _engine(llama, "kv_producer")
    prompt = [5, 17, 42, 99, 3]
    ktp = _run(prefill, "m", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                    kv_transfer_params={"do_remote_decode": True}))[-1].kv_transfer_params
    ktp["flagdeploy"]["layout"] = "something else"
    decode = _engine(llama, "kv_consumer")
    with pytest.raises(KvTransferError, match="same options"):
        decode.add_request("m", prompt, SamplingParams(max_tokens=2, temperature=0, kv_transfer_params=ktp))


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_glm5_next_state_indexer_and_mtp_travel(tmp_path, mtp):
    requires_pd()
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    path = write_tiny_glm5_next(tmp_path / "glm", mtp=mtp, seed=3)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2) if mtp else None
    prompt = torch.randint(2, 60, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = _engine(path, None).generate([prompt], params)[0]
    prefill, decode = _engine(path, "kv_producer", spec), _engine(path, "kv_consumer", spec)
    got = _disaggregated(prefill, decode, prompt, 10)
    assert got == want
    assert decode.stats()["kv_transfer_received_prompt_tokens"] == len(prompt)
    if mtp:  # the decode instance drafts: without the MTP state (cache rows, last hidden row) its first observed
        # position would be a gap, and a sequence with a gap never drafts (engine/mtp.py)
        assert decode.stats()["spec_decode_num_drafts"] >= 6


def test_a_decode_instance_without_a_free_state_row_computes_the_prompt_itself(tmp_path):
    """glm5_next holds a state row per sequence; received caches that find none free are not taken (the prompt
    is computed here instead), and every answer is still one instance's."""
    requires_pd()
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    path = write_tiny_glm5_next(tmp_path / "glm", seed=3)
    prompts = [torch.randint(2, 60, (20 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = [_engine(path, None).generate([p], params)[0] for p in prompts]
    prefill, decode = _engine(path, "kv_producer"), _engine(path, "kv_consumer", max_num_seqs=1)
    handed = [_run(prefill, f"r{i}", p, SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={
        "do_remote_decode": True}))[-1].kv_transfer_params for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        decode.add_request(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                      kv_transfer_params=handed[i]))
    got = {f"r{i}": [] for i in range(2)}
    while decode.has_work():
        for out in decode.step():
            got[out.request_id] += out.token_ids
    assert [got["r0"], got["r1"]] == want
    assert decode.stats()["kv_transfer_received_prompt_tokens"] == len(prompts[0])
