"""The gateway runs the prefill-decode two-step itself: `flagdeploy serve --upstream DECODE --prefill-upstream
PREFILL` (serve.yaml: `prefill_upstreams` beside `upstreams`) in front of a prefill and a decode instance of
the builtin engine (tests/test_pd_serve.py starts the same pair behind vllm-router).

Unit tests: serve.yaml's prefill_upstreams and the CLI's --prefill-upstream are checked. Integration tests:
the default SmolLM2 GGUF on a `kv_producer` and a `kv_consumer` `flagdeploy serve`, a third `flagdeploy serve`
as the gateway, driven by the openai SDK (chat, streamed and not, completions) and the anthropic SDK
(messages): every greedy answer equals the decode instance's own answer to the same request sent to it
directly, the decode instance received every prompt token rather than computing it, the gateway counts the
prefill requests apart in /metrics, and a prefill instance that is gone is a clear 503 for the client. They
need the Mooncake transfer engine (not vllm): skipped without it, failed when FLAGDEPLOY_REQUIRE_PD=1.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner
from conftest import requires_pd
from test_cli import _free_port, wait_ready
from test_cli import _serve as _serve_cli

from flagdeploy.cli import main
from flagdeploy.gateway import ConfigError, build_gateway, parse_config
from flagdeploy.gateway.proxy import REMOTE_DECODE, Proxy
from flagdeploy.gateway.supervisor import State

PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_size": 64 << 20}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_size": 64 << 20}
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--weight-format", "dense"]
PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]


# ---- serve.yaml and the command line ---------------------------------------------------------------


def _pd_entry(**extra):
    return {"names": ["pd"], "engine": "upstream", "upstreams": ["http://10.0.0.8:8000/v1/"],
            "prefill_upstreams": ["http://10.0.0.7:8000/", "http://10.0.0.9:8000/v1"]} | extra


def test_prefill_upstreams_are_urls_of_an_upstream_model():
    entry = parse_config({"models": [_pd_entry()]}).models[0]
    assert entry.upstreams == ["http://10.0.0.8:8000"]
    assert entry.prefill_upstreams == ["http://10.0.0.7:8000", "http://10.0.0.9:8000"]
    assert parse_config({"models": [_pd_entry(prefill_upstreams=[])]}).models[0].prefill_upstreams == []
    with pytest.raises(ConfigError, match="prefill upstream '10.0.0.7:8000' is not a URL"):
        parse_config({"models": [_pd_entry(prefill_upstreams=["10.0.0.7:8000"])]})
    with pytest.raises(ConfigError, match="`prefill_upstreams` is only for engine 'upstream'"):
        parse_config({"models": [{"names": ["pd"], "engine": "llama.cpp", "prefill_upstreams": ["http://a:1"]}]})
    with pytest.raises(ConfigError, match="in both `upstreams`"):
        parse_config({"models": [_pd_entry(prefill_upstreams=["http://10.0.0.8:8000"])]})
    with pytest.raises(ConfigError, match="upstreams"):  # prefill instances alone are no pair
        parse_config({"models": [{"names": ["pd"], "engine": "upstream", "prefill_upstreams": ["http://a:1"]}]})


def test_a_pair_is_ready_with_its_decode_replicas_and_one_prefill_instance():
    pool = build_gateway(parse_config({"models": [_pd_entry()]})).pools[0]
    assert [u.url for u in pool.upstreams] == ["http://10.0.0.8:8000"]
    assert [u.url for u in pool.prefill] == ["http://10.0.0.7:8000", "http://10.0.0.9:8000"]
    decode, (p1, p2) = pool.upstreams[0], pool.prefill
    decode.state = State.READY
    assert not pool.ready and pool.state() == "starting"
    p1.state, p2.state = State.READY, State.DOWN
    assert pool.ready and pool.state() == "degraded"
    assert pool.pick_prefill(None)[1] is p1 and pool.pick_prefill(None, exclude={p1.url}) is None
    p2.state = State.READY
    assert pool.state() == "ready"
    status = pool.status()
    assert [r["url"] for r in status["replicas"]] == [decode.url]
    assert [r["url"] for r in status["prefill"]] == [p1.url, p2.url]
    decode.state = State.DOWN
    assert not pool.ready
    p1.state = p2.state = State.DOWN
    decode.state = State.READY
    assert not pool.ready and pool.state() == "down"
    assert "no prefill instance is ready" in pool.unavailable_prefill().message
    assert "http://10.0.0.7:8000" in pool.unavailable_prefill().message
    # a pool without prefill instances is as before
    plain = build_gateway(parse_config({"models": [{"names": ["x"], "engine": "upstream",
                                                    "upstreams": ["http://a:1"]}]})).pools[0]
    assert plain.prefill == [] and "prefill" not in plain.status()


def test_prefill_upstream_needs_upstream():
    r = CliRunner().invoke(main, ["serve", "--prefill-upstream", "http://127.0.0.1:9"])
    assert r.exit_code != 0 and "--prefill-upstream" in r.output and "--upstream" in r.output
    r = CliRunner().invoke(main, ["serve", "--upstream", "http://127.0.0.1:9", "--prefill-upstream", "nowhere"])
    assert r.exit_code != 0 and "prefill upstream 'nowhere' is not a URL" in r.output


# ---- the two steps, against recorded engines (httpx.MockTransport) -----------------------------------

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1", "remote_block_ids": [0],
          "remote_host": "127.0.0.1", "remote_port": 4242}


def _run_gateway(entry: dict, engines: dict, requests: list[tuple[str, str]], path: str = "/v1/chat/completions",
                 body: dict | None = None) -> list[httpx.Response]:
    """Send `requests` ((path, body) pairs) through a gateway for `entry` whose engines are `engines` (URL ->
    function(body) -> httpx.Response, or an exception to raise); each engine's received bodies are recorded in
    engines[url + "#seen"]."""
    gateway = build_gateway(parse_config({"models": [entry]}))
    pool = gateway.pools[0]
    for u in pool.all_upstreams:
        u.state = State.READY

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        got = json.loads(request.content)
        engines.setdefault(url + "#seen", []).append((request.url.path, got))
        answer = engines[url]
        if isinstance(answer, Exception):
            raise answer
        return answer(got)

    async def go() -> list[httpx.Response]:
        gateway.proxy = Proxy()
        gateway.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as client:
            return [await client.post(p, json=b) for p, b in requests]

    return asyncio.run(go())


def _chat_answer(body: dict) -> httpx.Response:
    return httpx.Response(200, json={"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": "Paris."}}],
                                     "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}})


def _prefill_answer(params):
    def answer(body: dict) -> httpx.Response:
        out = _chat_answer(body).json() | ({"kv_transfer_params": params} if params is not None else {})
        return httpx.Response(200, json=out)
    return answer


ASK = {"model": "pd", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 20,
       "stream_options": {"include_usage": True}, "stream": False}
DECODE, P1, P2 = "http://10.0.0.8:8000", "http://10.0.0.7:8000", "http://10.0.0.9:8000"


def test_prefill_then_decode_with_the_returned_params():
    calls = []

    def first_refuses(body):  # whichever prefill instance the balancer picks first cannot be reached
        calls.append(body)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return _prefill_answer(PARAMS)(body)

    engines = {P1: first_refuses, P2: first_refuses, DECODE: _chat_answer}
    ask = {k: v for k, v in ASK.items() if k != "stream_options"} | {"max_completion_tokens": 20}
    (r,) = _run_gateway(_pd_entry(), engines, [("/v1/chat/completions", ask)])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris."
    assert len(engines[P1 + "#seen"]) == len(engines[P2 + "#seen"]) == 1  # one refused, the other one prefilled
    assert len(calls) == 2
    assert {path for path, _ in engines[P1 + "#seen"] + engines[P2 + "#seen"]} == {"/v1/chat/completions"}
    prefill = calls[1]
    assert prefill["max_tokens"] == 1 and prefill["max_completion_tokens"] == 1 and prefill["min_tokens"] == 1
    assert prefill["stream"] is False and prefill["kv_transfer_params"] == REMOTE_DECODE
    assert prefill["messages"] == ASK["messages"]
    ((_, decode),) = engines[DECODE + "#seen"]
    assert decode["kv_transfer_params"] == PARAMS and decode["max_completion_tokens"] == 20
    assert "min_tokens" not in decode and decode["messages"] == ASK["messages"]


def test_no_reachable_prefill_instance_is_a_503_naming_them():
    engines = {P1: httpx.ConnectError("refused"), P2: httpx.ConnectError("refused"), DECODE: _chat_answer}
    (r,) = _run_gateway(_pd_entry(), engines, [("/v1/completions", {"model": "pd", "prompt": "Hi", "max_tokens": 4})])
    assert r.status_code == 503 and r.headers.get("retry-after")
    message = r.json()["error"]["message"]
    assert "no prefill instance could be reached" in message and P1 in message and P2 in message
    assert DECODE + "#seen" not in engines  # decode never asked


def test_without_kv_transfer_params_decode_computes_the_prompt():
    engines = {P1: _prefill_answer(None), P2: _prefill_answer(None), DECODE: _chat_answer}
    completion = {"model": "pd", "prompt": "Hi", "max_tokens": 4, "kv_transfer_params": {"do_remote_prefill": True}}
    responses = _run_gateway(_pd_entry(), engines, [("/v1/completions", completion),
                                                    ("/v1/messages", {"model": "pd", "max_tokens": 8, "messages": [
                                                        {"role": "user", "content": "Hi"}]}),
                                                    ("/v1/responses", {"model": "pd", "input": "Hi"})])
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert responses[1].json()["type"] == "message" and responses[2].json()["object"] == "response"
    seen = engines[DECODE + "#seen"]
    assert [p for p, _ in seen] == ["/v1/completions", "/v1/chat/completions", "/v1/chat/completions"]
    assert all("kv_transfer_params" not in b for _, b in seen)  # not even the client's own
    prefills = engines.get(P1 + "#seen", []) + engines.get(P2 + "#seen", [])
    # the Anthropic and Responses requests are prefilled as the chat requests they become
    assert sorted(p for p, _ in prefills) == ["/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]


def test_a_prefill_error_goes_to_the_client_and_plain_pools_have_no_prefill_step():
    def refuse(body):
        return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 512 tokens",
                                                   "type": "BadRequestError", "code": 400}})

    engines = {P1: refuse, P2: refuse, DECODE: _chat_answer}
    (r,) = _run_gateway(_pd_entry(), engines, [("/v1/chat/completions", ASK)])
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert DECODE + "#seen" not in engines
    engines = {DECODE: _chat_answer}
    (r,) = _run_gateway({"names": ["pd"], "engine": "upstream", "upstreams": [DECODE]}, engines,
                        [("/v1/chat/completions", ASK)])
    assert r.status_code == 200
    ((_, decode),) = engines[DECODE + "#seen"]
    assert "kv_transfer_params" not in decode and decode["max_tokens"] == 20


# ---- a real pair behind the gateway ----------------------------------------------------------------


@pytest.fixture(scope="module")
def _needs_pd():
    requires_pd()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


class GatewayPair:
    """A prefill and a decode instance of the default model, and `flagdeploy serve --upstream` in front."""

    def __init__(self, model: str):
        self.procs: list[subprocess.Popen] = []
        ports = [_free_port() for _ in range(3)]
        try:
            for port, cfg in zip(ports, (PRODUCER, CONSUMER)):
                self.procs.append(_serve_cli("--model", model, "--served-model-name", "smollm2", "--port", str(port),
                                             *SMALL, "--kv-transfer-config", json.dumps(cfg)))
            self.prefill, self.decode = (wait_ready(p, port, timeout=240) for p, port in zip(self.procs, ports))
            self.procs.append(_serve_cli("--upstream", self.decode, "--prefill-upstream", self.prefill,
                                         "--served-model-name", "smollm2", "--port", str(ports[2])))
            self.url = wait_ready(self.procs[2], ports[2], timeout=60)
        except BaseException:
            _stop(self.procs)
            raise

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def claude(self, url: str | None = None) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url or self.url, api_key="none", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"flagdeploy:{name} ") \
                or line.startswith(f"flagdeploy:{name}_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {url}/metrics")


@pytest.fixture(scope="module")
def pair(_needs_pd, default_model):
    p = GatewayPair(str(default_model.path))
    yield p
    _stop(p.procs)


def _chat(client: openai.OpenAI, prompt: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=16, temperature=0, **kw)


def test_openai_answers_through_the_gateway_equal_the_decode_instance(pair):
    direct, gateway = pair.client(pair.decode), pair.client()
    want = {p: _chat(direct, p).choices[0].message.content for p in PROMPTS}
    want_text = direct.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    received, prompt_tokens = (metric(pair.decode, n) for n in ("kv_transfer_received_prompt_tokens", "prompt_tokens"))
    sent = metric(pair.prefill, "kv_transfer_sent_requests")

    assert {p: _chat(gateway, p).choices[0].message.content for p in PROMPTS} == want
    chunks = list(_chat(gateway, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[PROMPTS[1]]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    text = gateway.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    assert text == want_text

    # every prompt token the gateway's requests brought arrived from the prefill instance: decode computed none
    new_prompts = metric(pair.decode, "prompt_tokens") - prompt_tokens
    assert new_prompts > 0 and metric(pair.decode, "kv_transfer_received_prompt_tokens") - received == new_prompts
    assert metric(pair.prefill, "kv_transfer_sent_requests") - sent == len(PROMPTS) + 2
    # the gateway counts the prefill requests apart from the decode ones
    lines = httpx.get(f"{pair.url}/metrics", timeout=30).text.splitlines()
    prefill_line = f'flagdeploy_upstream_requests_total{{model="smollm2",url="{pair.prefill}",role="prefill"}}'
    decode_line = f'flagdeploy_upstream_requests_total{{model="smollm2",url="{pair.decode}",role="decode"}}'
    assert any(line.startswith(prefill_line + " ") for line in lines), lines
    assert any(line.startswith(decode_line + " ") for line in lines), lines
    ready = httpx.get(f"{pair.url}/ready", timeout=10).json()
    assert ready["models"]["smollm2"]["prefill"][0]["url"] == pair.prefill
    assert [m.id for m in gateway.models.list().data] == ["smollm2"]


def test_anthropic_messages_through_the_gateway_equal_the_decode_instance(pair):
    ask = {"model": "smollm2", "max_tokens": 16, "extra_body": {"temperature": 0},  # greedy (this SDK has no
           "messages": [{"role": "user", "content": PROMPTS[0]}]}                     # temperature argument)
    want = pair.claude(pair.decode).messages.create(**ask)
    received, prompt_tokens = (metric(pair.decode, n) for n in ("kv_transfer_received_prompt_tokens", "prompt_tokens"))
    got = pair.claude().messages.create(**ask)
    assert got.content[0].text == want.content[0].text and got.stop_reason == want.stop_reason
    assert got.usage.input_tokens == want.usage.input_tokens
    with pair.claude().messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == want.content[0].text
    new_prompts = metric(pair.decode, "prompt_tokens") - prompt_tokens
    assert new_prompts == 2 * want.usage.input_tokens
    assert metric(pair.decode, "kv_transfer_received_prompt_tokens") - received == new_prompts


def test_a_prefill_instance_that_is_gone_is_a_clear_error(pair):
    """Last in the module: it stops the prefill instance. The gateway's next request cannot reach it (503
    naming it), later ones find it down (503 saying no prefill instance is ready); the decode instance is
    untouched and idle."""
    pair.procs[0].terminate()
    pair.procs[0].wait(timeout=20)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as exc:
            _chat(pair.client(), PROMPTS[0])
        assert exc.value.status_code == 503
        assert "prefill instance" in exc.value.message and pair.prefill in exc.value.message
    with pytest.raises(anthropic.APIStatusError) as exc:
        pair.claude().messages.create(model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.status_code == 503 and "prefill instance" in exc.value.message
    assert httpx.get(f"{pair.url}/ready", timeout=10).status_code == 503
    assert metric(pair.decode, "kv_cache_blocks_free") == metric(pair.decode, "kv_cache_blocks_total")
    assert metric(pair.decode, "num_requests_running") == 0
    # the decode instance itself still answers
    assert _chat(pair.client(pair.decode), PROMPTS[0]).choices[0].message.content
