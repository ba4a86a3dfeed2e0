"""Prefill-decode disaggregation over HTTP: two `flagdeploy serve` instances behind vLLM's own router.

A prefill instance (`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'`) and a
decode instance (`kv_consumer`) of the same model, and `vllm-router --vllm-pd-disaggregation` (PyPI, in its
default mode: the prefill-first two-step that vLLM's NixlConnector speaks) in front; the `openai` SDK talks to
the router. Every greedy answer must equal the decode instance's own answer to the same request sent to it
directly (one instance computing everything), and the decode instance's /metrics must show that it received
those prompts rather than computed them. Models: the default SmolLM2-135M GGUF (llama), and a tiny glm5_next
with its MTP layer (KDA state, DSA indexer cache and the draft layer's rows travel). Failures: a prefill
instance that is gone (the client gets an error, the decode instance is untouched), and staged caches that no
decode instance collects (freed at the abort timeout, gauges back to idle).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import requires_pd
from test_cli import _free_port, wait_ready
from test_cli import _serve as _serve_cli

PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
            "kv_buffer_size": 64 << 20, "kv_connector_extra_config": {"abort_timeout": 4}}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_size": 64 << 20}
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--weight-format", "dense"]


@pytest.fixture(scope="module", autouse=True)
def _needs_pd():
    requires_pd("vllm_router")


class Pair:
    """A prefill and a decode instance of one model, and vllm-router in front of them."""

    def __init__(self, model_args: list[str], name: str):
        self.procs: list[subprocess.Popen] = []
        ports = [_free_port() for _ in range(4)]
        try:
            for port, cfg in zip(ports, (PRODUCER, CONSUMER)):
                self.procs.append(_serve_cli(*model_args, "--served-model-name", name, "--port", str(port), *SMALL,
                                             "--kv-transfer-config", json.dumps(cfg)))
            self.prefill, self.decode = (wait_ready(p, port, timeout=240) for p, port in zip(self.procs, ports))
            router = subprocess.Popen(
                [sys.executable, "-c", "import sys; from vllm_router.launch_router import main; sys.exit(main())",
                 "--host", "127.0.0.1", "--port", str(ports[2]), "--vllm-pd-disaggregation",
                 "--prefill", self.prefill, "--decode", self.decode, "--prefill-policy", "round_robin",
                 "--decode-policy", "round_robin", "--prometheus-port", str(ports[3])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.procs.append(router)
            self.router = f"http://127.0.0.1:{ports[2]}"
            deadline = time.time() + 60
            while True:
                assert router.poll() is None, router.stderr.read()
                try:
                    if httpx.get(f"{self.router}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.time() < deadline, "vllm-router never became healthy"
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.router}/v1", api_key="none", max_retries=0, timeout=120)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(f"flagdeploy:{name} ") or line.startswith(f"flagdeploy:{name}_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no flagdeploy:{name} in {url}/metrics")


def wait_metric(url: str, name: str, want: float, timeout: float = 15) -> None:
    deadline = time.time() + timeout
    while metric(url, name) != want:
        assert time.time() < deadline, f"{name} stayed at {metric(url, name)}, not {want}"
        time.sleep(0.2)


PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]


@pytest.fixture(scope="module")
def smollm(default_model):
    pair = Pair(["--model", str(default_model.path)], "smollm2")
    yield pair
    pair.close()


def test_llama_answers_through_the_router_equal_one_instance(smollm):
    direct, routed = smollm.client(smollm.decode), smollm.client()

    def chat(client, prompt, **kw):
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=16, temperature=0, **kw)

    want = {p: chat(direct, p).choices[0].message.content for p in PROMPTS}
    received, prompt_tokens = (metric(smollm.decode, n) for n in ("kv_transfer_received_prompt_tokens", "prompt_tokens"))
    got = {p: chat(routed, p).choices[0].message.content for p in PROMPTS}
    assert got == want
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(routed, PROMPTS[0], stream=True) if c.choices)
    assert streamed == want[PROMPTS[0]]
    # every routed prompt token arrived from the prefill instance: the decode instance computed none of them
    new_prompts = metric(smollm.decode, "prompt_tokens") - prompt_tokens
    assert new_prompts > 0 and metric(smollm.decode, "kv_transfer_received_prompt_tokens") - received == new_prompts
    assert metric(smollm.prefill, "kv_transfer_sent_requests") == len(PROMPTS) + 1
    assert metric(smollm.prefill, "kv_transfer_sent_bytes") == metric(smollm.decode, "kv_transfer_received_bytes")
    # both sides back to idle: staged regions collected, blocks free
    wait_metric(smollm.prefill, "kv_transfer_held", 0)
    wait_metric(smollm.prefill, "kv_transfer_buffer_bytes_in_use", 0)
    for url in (smollm.prefill, smollm.decode):
        assert metric(url, "kv_cache_blocks_free") == metric(url, "kv_cache_blocks_total")
    # the prefill instance's prefix cache still serves a repeated prompt
    hits = metric(smollm.prefill, "prefix_cache_hits")
    chat(routed, PROMPTS[0])
    assert metric(smollm.prefill, "prefix_cache_hits") > hits


def test_staged_caches_nobody_collects_are_freed(smollm):
    """A decode instance that never comes (it died between the two steps): the prefill instance frees the
    staged region at its abort timeout (4 s here), and says so in /metrics."""
    expired = metric(smollm.prefill, "kv_transfer_expired")
    r = httpx.post(f"{smollm.prefill}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["do_remote_prefill"] is True
    assert metric(smollm.prefill, "kv_transfer_held") == 1
    wait_metric(smollm.prefill, "kv_transfer_held", 0, timeout=20)
    assert metric(smollm.prefill, "kv_transfer_expired") == expired + 1
    assert metric(smollm.prefill, "kv_transfer_buffer_bytes_in_use") == 0


def test_a_decode_request_whose_prefill_instance_is_gone_fails_clearly(smollm):
    """kv_transfer_params pointing at a transfer engine that is not there: a 5xx naming the prefill
    instance, and the decode instance frees what it took and keeps serving."""
    r = httpx.post(f"{smollm.prefill}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "The sea is", "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = dict(r.json()["kv_transfer_params"], remote_port=1)
    r = httpx.post(f"{smollm.decode}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "The sea is", "max_tokens": 4, "temperature": 0, "kv_transfer_params": params})
    assert r.status_code >= 500 and "prefill instance" in r.text
    assert metric(smollm.decode, "kv_cache_blocks_free") == metric(smollm.decode, "kv_cache_blocks_total")
    assert metric(smollm.decode, "kv_transfer_failed") >= 1
    ok = smollm.client(smollm.decode).completions.create(model="smollm2", prompt="The sea is", max_tokens=4,
                                                          temperature=0)
    assert ok.choices[0].text


def test_glm5_next_with_mtp_through_the_router_equals_one_instance(tmp_path_factory):
    from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next

    path = write_tiny_glm5_next(tmp_path_factory.mktemp("pd_glm") / "ckpt", mtp=True, seed=3)
    pair = Pair(["--model", str(path), "--speculative", "mtp", "--num-speculative-tokens", "2",
                 "--block-size", "4"], "glm")
    try:
        prompts = [" ".join(f"w{(7 * i + j) % 50 + 2}" for j in range(29 + i)) for i in range(3)]

        def complete(client, prompt):
            return client.completions.create(model="glm", prompt=prompt, max_tokens=10, temperature=0).choices[0].text

        want = [complete(pair.client(pair.decode), p) for p in prompts]
        drafts = metric(pair.decode, "spec_decode_num_drafts")
        assert [complete(pair.client(), p) for p in prompts] == want
        assert metric(pair.decode, "kv_transfer_received_requests") == len(prompts)
        assert metric(pair.decode, "spec_decode_num_drafts") > drafts  # MTP drafted from the received state
        wait_metric(pair.prefill, "kv_transfer_held", 0)
        # a prefill instance that is gone: the client gets an error from the router, the decode one stays idle
        pair.procs[0].terminate()
        pair.procs[0].wait(timeout=20)
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
            complete(pair.client(), prompts[0])
        assert metric(pair.decode, "kv_cache_blocks_free") == metric(pair.decode, "kv_cache_blocks_total")
        assert metric(pair.decode, "num_requests_running") == 0
    finally:
        pair.close()
