"""The gateway: external engines behind our endpoint.

Unit tests run the normaliser on chunk shapes recorded from real engines, the balancer and the
serve.yaml parser. The integration tests put the real third-party engine, llama-cpp-python's OpenAI
server on the default GGUF model, behind a real uvicorn running the gateway on loopback, and drive
it with the `openai` SDK and raw httpx: attached upstreams, two replicas balanced, a supervised engine
killed and restarted, a builtin model and an upstream one on one port.

llama-cpp-python is the `gateway` extra. Without it the integration tests skip locally, and fail
when FLAGDEPLOY_REQUIRE_LLAMA_CPP=1 (CI sets it, so a broken install cannot pass as a skip).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from test_server import LiveServer, _free_port, _serve, _wait_ready

from flagdeploy.gateway import ConfigError, ModelPool, build_gateway, parse_config
from flagdeploy.gateway.app import Gateway
from flagdeploy.gateway.balancer import Balancer, affinity_key
from flagdeploy.gateway.launch import launch_plan
from flagdeploy.gateway.normalize import (
    StreamNormalizer,
    normalize_response,
    prepare_request,
    upstream_error,
)
from flagdeploy.gateway.proxy import Timeouts
from flagdeploy.gateway.supervisor import AttachedUpstream, Backoff, Supervisor

API_KEY = "sk-gateway-test"


# ---- normalisation on recorded chunk shapes --------------------------------------------------------

# vLLM >= 0.12 with --reasoning-parser: `reasoning` (not reasoning_content), `usage: null` on every chunk
# once include_usage is asked, then a `choices: []` usage chunk.
VLLM_STREAM = [
    {"id": "chatcmpl-9f", "object": "chat.completion.chunk", "created": 1761000000, "model": "zai-org/GLM-5.3-Flash",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "usage": None},
    {"id": "chatcmpl-9f", "object": "chat.completion.chunk", "created": 1761000000, "model": "zai-org/GLM-5.3-Flash",
     "choices": [{"index": 0, "delta": {"reasoning": "The user greets."}, "logprobs": None, "finish_reason": None}],
     "usage": None},
    {"id": "chatcmpl-9f", "object": "chat.completion.chunk", "created": 1761000000, "model": "zai-org/GLM-5.3-Flash",
     "choices": [{"index": 0, "delta": {"content": "Hello!"}, "logprobs": None, "finish_reason": "stop"}],
     "usage": None},
    {"id": "chatcmpl-9f", "object": "chat.completion.chunk", "created": 1761000000, "model": "zai-org/GLM-5.3-Flash",
     "choices": [], "usage": {"prompt_tokens": 9, "total_tokens": 14, "completion_tokens": 5}},
]


def _run(normalizer: StreamNormalizer, chunks: list, done: bool = True) -> list:
    out = []
    for chunk in chunks:
        out += normalizer.event(json.dumps(chunk))
    out += normalizer.event("[DONE]") if done else normalizer.end()
    return [o if o == "[DONE]" else json.loads(o) for o in out]


def test_vllm_reasoning_is_mirrored_and_model_renamed():
    out = _run(StreamNormalizer("glm", wants_usage=True), VLLM_STREAM)
    assert out[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in out[:-2]]
    assert deltas[1] == {"reasoning": "The user greets.", "reasoning_content": "The user greets."}
    assert {c["model"] for c in out[:-1]} == {"glm"}
    assert all(c["usage"] is None for c in out[:-2])
    assert out[-2]["choices"] == [] and out[-2]["usage"]["completion_tokens"] == 5


def test_usage_chunk_dropped_when_not_asked():
    out = _run(StreamNormalizer("glm", wants_usage=False), VLLM_STREAM)
    assert out[-1] == "[DONE]" and len(out) == 4
    assert all(c["choices"] and "usage" not in c for c in out[:-1])


def test_usage_counted_when_upstream_sends_none():
    """llama-cpp-python ignores stream_options: the client that asked still gets one usage chunk."""
    chunks = [{**c, "usage": None} for c in VLLM_STREAM[:3]]
    out = _run(StreamNormalizer("glm", wants_usage=True), chunks, done=False)
    usage = out[-2]["usage"]
    assert out[-2]["choices"] == [] and usage["completion_tokens"] == 2 and usage["estimated"] is True


def test_request_always_asks_usage_in_streams():
    body, wants = prepare_request({"model": "ours", "stream": True, "messages": []}, "theirs")
    assert body["model"] == "theirs" and body["stream_options"] == {"include_usage": True} and not wants
    body, wants = prepare_request({"model": "ours", "stream": True, "stream_options": {"include_usage": True}}, None)
    assert wants and body["model"] == "ours"
    body, _ = prepare_request({"model": "m", "stream": False, "stream_options": {"include_usage": True}}, None)
    assert "stream_options" not in body


def _tool_chunk(calls: list) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]}


def test_tool_calls_without_index_get_one():
    """An engine that omits `index` (LangChain would drop the call): the id opens a call, fragments continue it."""
    chunks = [_tool_chunk([{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
              _tool_chunk([{"function": {"arguments": '{"city": '}}]),
              _tool_chunk([{"function": {"arguments": '"Paris"}'}}]),
              _tool_chunk([{"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}])]
    out = _run(StreamNormalizer("m", False), chunks)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in out[:-1]]
    assert [c["index"] for c in calls] == [0, 0, 0, 1]
    assert calls[0] == {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert calls[3]["id"] == "call_b" and calls[3]["function"]["name"] == "get_time"


def test_repeated_tool_names_sent_once():
    """An engine that repeats id and name in every delta (LangChain would concatenate the names)."""
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
    again = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": 'ty": 1}'}}
    out = _run(StreamNormalizer("m", False), [_tool_chunk([first]), _tool_chunk([again])])
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in out[:-1]]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert calls[1] == {"index": 0, "function": {"arguments": 'ty": 1}'}}
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": 1}


def test_non_stream_response_normalised():
    body = {"id": "x", "object": "chat.completion", "model": "/models/glm", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": "think"},
         "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    out = normalize_response(body, "glm")
    assert out["model"] == "glm" and out["choices"][0]["message"]["reasoning"] == "think"


@pytest.mark.parametrize("status, body, want_status, want_code", [
    # vLLM >= 0.9: OpenAI envelope, HTTP status number in `code`
    (400, {"error": {"message": "This model's maximum context length is 4096 tokens. However, you requested "
                                "5000 tokens.", "type": "BadRequestError", "param": None, "code": 400}},
     400, "context_length_exceeded"),
    # vLLM < 0.9 / SGLang: ErrorResponse at the top level
    (404, {"object": "error", "message": "The model `x` does not exist.", "type": "NotFoundError", "param": None,
           "code": 404}, 404, None),
    # FastAPI request validation (llama-cpp-python, SGLang): 422 {"detail": [...]}
    (422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int_parsing"}]},
     400, None),
    # an engine crash: plain text 500
    (500, "Internal Server Error", 503, "upstream_error"),
])
def test_upstream_error_bodies(status, body, want_status, want_code):
    err = upstream_error(status, body)
    assert err.status == want_status and err.code == want_code
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    if status == 422:
        assert err.param == "max_tokens" and "valid integer" in err.message
    if want_status == 503:
        assert err.headers == {"Retry-After": "5"}


def test_midstream_error_event_kept_in_envelope():
    out = StreamNormalizer("m", True).event(json.dumps({"object": "error", "message": "boom", "type": "InternalError"}))
    assert json.loads(out[0]) == {"error": {"message": "boom", "type": "InternalError", "param": None, "code": None}}


# ---- balancer ----------------------------------------------------------------------------------------


def test_least_outstanding_among_ready():
    b = Balancer(["http://a", "http://b", "http://c"], slack=0)
    b.replicas[0].outstanding, b.replicas[1].outstanding, b.replicas[2].outstanding = 3, 1, 0
    assert b.pick(None).url == "http://c"
    assert b.pick(None, ready={"http://a", "http://b"}).url == "http://b"
    assert b.pick(None, ready=set()) is None


def test_prefix_affinity_within_slack():
    b = Balancer(["http://a", "http://b", "http://c"], slack=2)
    key = affinity_key({"messages": [{"role": "system", "content": "You are terse." * 10},
                                     {"role": "user", "content": "hi"}]})
    preferred = b.pick(key)
    assert all(b.pick(key) is preferred for _ in range(5))  # same prefix, same replica
    preferred.outstanding = 2
    assert b.pick(key) is preferred  # 2 above the minimum: still within the slack
    preferred.outstanding = 3
    assert b.pick(key) is not preferred  # too busy: load wins
    keys = {b.pick(affinity_key({"prompt": f"document {i}: ..."})).url for i in range(30) if not
            setattr(preferred, "outstanding", 0)}
    assert len(keys) == 3  # different prefixes spread


def test_affinity_key_reads_the_opening():
    long = {"messages": [{"role": "system", "content": "x" * 2000}, {"role": "user", "content": "a"}]}
    other = {"messages": [{"role": "system", "content": "x" * 2000}, {"role": "user", "content": "b"}]}
    assert affinity_key(long) == affinity_key(other)  # the shared long prefix decides
    assert affinity_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) == "user:hi\x00"
    assert affinity_key({}) is None


# ---- serve.yaml ----------------------------------------------------------------------------------------


def test_serve_yaml_parses(tmp_path):
    from flagdeploy.gateway import load_config

    path = tmp_path / "serve.yaml"
    path.write_text("""
port: 9000
api_key: sk-x
models:
  - names: [smollm2, SmolLM2-135M]
    engine: builtin
    args: {max_model_len: 1024, kv_cache_memory: 256MiB}
  - names: [glm-5.3-flash]
    engine: vllm
    model: zai-org/GLM-5.3-Flash
    chip: h200
    replicas: 2
    args: {tp: 4, devices: 4, max_model_len: 65536}
  - names: [qwen]
    engine: upstream
    upstreams: [http://10.0.0.5:8000/v1, "http://10.0.0.6:8000/"]
""")
    cfg = load_config(path)
    assert cfg.port == 9000 and [m.engine for m in cfg.models] == ["builtin", "vllm", "upstream"]
    assert cfg.models[2].upstreams == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    first, second = (launch_plan(cfg.models[1], 8100 + i, i) for i in range(2))
    assert first.argv[:3] == ["vllm", "serve", "zai-org/GLM-5.3-Flash"]
    assert "--tensor-parallel-size" in first.argv and first.argv[first.argv.index("--port") + 1] == "8100"
    assert first.argv[first.argv.index("--served-model-name") + 1] == "glm-5.3-flash"
    assert first.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and second.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


@pytest.mark.parametrize("models, message", [
    ([{"engine": "upstream"}], "needs `upstreams"),
    ([{"engine": "vllm", "model": "m"}], "needs `chip`"),
    ([{"engine": "builtin"}, {"engine": "builtin"}], "at most one model may use engine 'builtin'"),
    ([{"names": ["a"], "engine": "upstream", "upstreams": ["http://x"]},
      {"names": ["A[1m]"], "engine": "upstream", "upstreams": ["http://y"]}], "given to two models"),
    ([{"engine": "upstream", "upstreams": ["10.0.0.5:8000"]}], "is not a URL"),
    ([{"engine": "tgi"}], "models.0.engine"),
    ([{"engine": "builtin", "tp": 2}], "Extra inputs"),
])
def test_serve_yaml_errors_say_what_to_fix(models, message):
    with pytest.raises(ConfigError, match="serve.yaml") as exc:
        parse_config({"models": models})
    assert message in str(exc.value)


def test_serve_cli_refuses_bad_gateway_options(tmp_path):
    from click.testing import CliRunner

    from flagdeploy.cli import main

    out = CliRunner().invoke(main, ["serve", "--engine", "vllm", "--model", "org/m"])
    assert out.exit_code == 1 and "needs `chip`" in out.output
    out = CliRunner().invoke(main, ["serve", "--engine", "sglang", "--upstream", "http://h:1"])
    assert out.exit_code == 1 and "use one of them" in out.output
    bad = tmp_path / "serve.yaml"
    bad.write_text("models:\n  - engine: upstream\n")
    out = CliRunner().invoke(main, ["serve", "--config", str(bad)])
    assert out.exit_code == 1 and "needs `upstreams" in out.output


def test_llama_cpp_launch(default_model):
    cfg = parse_config({"models": [{"names": ["tiny"], "engine": "llama.cpp", "max_model_len": 512,
                                    "args": {"n_threads": 1}}]})
    plan = launch_plan(cfg.models[0], 8123)
    assert plan.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert plan.argv[plan.argv.index("--model") + 1] == str(default_model.path)
    assert plan.argv[plan.argv.index("--n_ctx") + 1] == "512" and "--n_threads" in plan.argv
    assert plan.argv[plan.argv.index("--interrupt_requests") + 1] == "false"  # queue, do not cut streams


# ---- live servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp_available():
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
        why = ("llama-cpp-python[server] is not installed; install it with "
               "`pip install 'llama-cpp-python[server]>=0.3'` (the `gateway` extra)")
        if os.environ.get("FLAGDEPLOY_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)


def _start_llama_cpp(model_path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "512", "--n_threads", "1", "--verbose", "false",
                             "--interrupt_requests", "false"],  # as the gateway launches it (docs/gateway.md)
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


@pytest.fixture(scope="module")
def llama_servers(llama_cpp_available, default_model):
    """Two llama-cpp-python OpenAI servers on the default GGUF: the engines attached with --upstream."""
    ports = [_free_port(), _free_port()]
    procs = [_start_llama_cpp(default_model.path, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for proc, url in zip(procs, urls):
            deadline = time.monotonic() + 90
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama_cpp.server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
                try:
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server on {url} did not answer in 90 s")
                time.sleep(0.2)
        yield urls
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _attached(urls: list[str], names: list[str], slack: int = 2, model: str | None = None) -> Gateway:
    pool = ModelPool(names, [AttachedUpstream(u, interval=0.5) for u in urls], slack=slack, model=model)
    return Gateway([pool], api_key=API_KEY, timeouts=Timeouts(connect=2.0, read=60.0))


@pytest.fixture(scope="module")
def attached(llama_servers, default_model):
    """Gateway -> one attached llama.cpp server, served as `tiny-llama`, its GGUF known (serve.yaml's
    `model:`) so that its chat template is read for counting prompt tokens."""
    live = _serve(_attached(llama_servers[:1], ["tiny-llama", "TinyAlias"], model=str(default_model.path)))
    assert _wait_ready(live.url).status_code == 200
    yield live
    live.stop()


def _sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_sdk_chat_through_llama_cpp(attached):
    client = _sdk(attached)
    msgs = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(model="tinyalias[1m]", messages=msgs, max_tokens=8)
    assert out.model == "tiny-llama"  # ours, not the GGUF path llama.cpp reports
    assert out.choices[0].message.content and out.usage.prompt_tokens > 0

    chunks = list(client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert {c.model for c in chunks} == {"tiny-llama"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text

    plain = list(client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=4, stream=True))
    assert all(c.choices for c in plain)  # not asked: no usage chunk


def test_wire_framing_and_completions(attached):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{attached.url}/v1/completions", headers=auth, timeout=60,
                      json={"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert "\r" not in raw and events[-2] == "data: [DONE]" and events[-1] == ""
    first = json.loads(events[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and first["model"] == "tiny-llama"

    models = httpx.get(f"{attached.url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama", "TinyAlias"]
    assert httpx.get(f"{attached.url}/v1/models").status_code == 401
    bad = httpx.post(f"{attached.url}/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                     json={"model": "tiny-llama", "messages": []})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


def test_upstream_errors_reach_the_client_in_our_shape(attached):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{attached.url}/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    long = "the quick brown fox " * 400  # far past n_ctx 512
    r = httpx.post(f"{attached.url}/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": "tiny-llama", "messages": [{"role": "user", "content": long}], "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{attached.url}/v1/messages/count_tokens", headers=auth,
                   json={"model": "tiny-llama", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"  # checked as /v1/messages would be
    r = httpx.post(f"{attached.url}/v1/messages", headers=auth, json={"model": "tiny-llama", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's shape on the Anthropic route
    r = httpx.post(f"{attached.url}/v1/responses", headers=auth, json={"model": "tiny-llama", "input": "hi",
                                                                       "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(f"{attached.url}/v1/chat/completions", headers=auth, json={"model": "nope", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    deep = '{"model": "tiny-llama", "messages": ' + "[" * 10_000 + "]" * 10_000 + "}"
    r = httpx.post(f"{attached.url}/v1/chat/completions", headers=auth, content=deep)
    assert r.status_code == 400, r.text  # not the parser's RecursionError as a 500


def test_anthropic_and_responses_through_llama_cpp(attached):
    """Claude Code's and Codex's protocols reach an engine that speaks neither, through its chat
    completions: the SDKs parse the answers and streams as they would from the real APIs."""
    claude = anthropic.Anthropic(base_url=attached.url, api_key=API_KEY, max_retries=0, timeout=60)
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    msg = claude.messages.create(model="tiny-llama[1m]", max_tokens=8, messages=ask)
    assert msg.model == "tiny-llama" and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.input_tokens > 0
    with claude.messages.stream(model="tiny-llama", max_tokens=8, messages=ask) as stream:
        final = stream.get_final_message()
    assert final.content[0].text and final.usage.output_tokens > 0

    client = _sdk(attached)
    r = client.responses.create(model="tiny-llama", instructions="Be brief.", input="Say hello.", max_output_tokens=8)
    assert r.model == "tiny-llama" and r.output_text and r.usage.input_tokens > 0
    events = list(client.responses.create(model="tiny-llama", input="Say hello.", max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        events[-1].response.output[0].content[0].text


ASK = {"system": "Be brief.", "messages": [{"role": "user", "content": "Name three colours."}]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_prompt_tokens_are_the_engines_own_count(attached):
    """Claude Code's count_tokens, and the input_tokens of a stream's message_start (llama.cpp sends
    no usage in streams), equal the prompt tokens llama.cpp itself reports for the same request: its
    chat template over the system prompt, the messages and the tools."""
    claude = _claude(attached)
    for extra in ({}, {"tools": TOOLS}):
        counted = claude.messages.count_tokens(model="tiny-llama", **ASK, **extra).input_tokens
        made = claude.messages.create(model="tiny-llama", max_tokens=1, **ASK, **extra)
        assert counted == made.usage.input_tokens > 10  # the engine's usage.prompt_tokens
        with claude.messages.stream(model="tiny-llama", max_tokens=4, **ASK, **extra) as stream:
            start = next(iter(stream))
            final = stream.get_final_message()
        assert start.type == "message_start" and start.message.usage.input_tokens == counted
        assert final.usage.input_tokens == counted and final.usage.output_tokens > 0


def test_prompt_tokens_approximated_without_model_files(llama_servers):
    """An attached engine whose files the gateway does not know, and which cannot render its own
    template (llama-cpp-python): ChatML stands in for the template, counted by the engine."""
    live = _serve(_attached(llama_servers[:1], ["tiny-bare"]))
    try:
        assert _wait_ready(live.url).status_code == 200
        claude = _claude(live)
        counted = claude.messages.count_tokens(model="tiny-bare", **ASK).input_tokens
        exact = claude.messages.create(model="tiny-bare", max_tokens=1, **ASK).usage.input_tokens
        assert abs(counted - exact) <= 2 + exact // 10, (counted, exact)
    finally:
        live.stop()


def test_stop_sequences_through_llama_cpp(attached):
    """A stop sequence the model reaches ends the answer with stop_reason "stop_sequence" and the
    sequence, streamed and not (llama.cpp does not say which stop hit: the gateway matches), with
    the text before it, as the same greedy answer without stops shows."""
    claude = _claude(attached)
    ask = {"model": "tiny-llama", "max_tokens": 24, "extra_body": {"temperature": 0},  # the SDK has no argument
           "messages": [{"role": "user", "content": "Count from one to ten in words."}]}
    free = claude.messages.create(**ask)
    text = free.content[0].text
    stop = text.split()[len(text.split()) // 2]  # a word from the middle of what it says unprompted
    before = text[:text.index(stop)]

    made = claude.messages.create(**ask, stop_sequences=["never said", stop])
    assert (made.stop_reason, made.stop_sequence) == ("stop_sequence", stop)
    assert made.content[0].text == before and made.usage.input_tokens == free.usage.input_tokens
    with claude.messages.stream(**ask, stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == before and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.usage.input_tokens == free.usage.input_tokens

    unmatched = claude.messages.create(**ask, stop_sequences=["never said"])
    assert unmatched.content[0].text == text and unmatched.stop_sequence is None
    assert unmatched.stop_reason == free.stop_reason


def test_client_disconnect_closes_the_upstream_stream(attached):
    """EOS is banned, so the engine would generate 480 tokens (many seconds on one thread);
    llama-cpp-python serves one request at a time, so a quick next answer proves the upstream
    stream was closed when the client left."""
    replica = attached.app.pools[0].balancer.replicas[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    served = replica.served
    with httpx.stream("POST", f"{attached.url}/v1/chat/completions", headers=auth, timeout=60,
                      json={"model": "tiny-llama", "stream": True, "max_tokens": 480, "temperature": 0,
                            "logit_bias": {"0": -100, "2": -100},
                            "messages": [{"role": "user", "content": "Tell a long story."}]}) as r:
        assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
    assert replica.served == served + 1
    deadline = time.monotonic() + 3
    while replica.outstanding and time.monotonic() < deadline:
        time.sleep(0.02)
    assert replica.outstanding == 0
    started = time.monotonic()
    r = httpx.post(f"{attached.url}/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and time.monotonic() - started < 4


def test_two_upstreams_balanced(llama_servers):
    live = _serve(_attached(llama_servers, ["tiny-llama"], slack=0))
    try:
        assert _wait_ready(live.url).status_code == 200
        client = _sdk(live)
        msgs = [{"role": "user", "content": "Count to three."}]

        def ask(_):
            return client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=24).model

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == ["tiny-llama"] * 4
        served = [r.served for r in live.app.pools[0].balancer.replicas]
        assert sum(served) == 4 and min(served) >= 1, served  # concurrent requests spread by load
        before = list(served)
        for _ in range(3):  # one at a time, same prefix: the same replica (its prefix cache is warm)
            ask(None)
        grown = [r.served - b for r, b in zip(live.app.pools[0].balancer.replicas, before)]
        assert sorted(grown) == [0, 3], grown
    finally:
        live.stop()


def test_unreachable_upstream_is_a_quick_503():
    live = _serve(_attached([f"http://127.0.0.1:{_free_port()}"], ["ghost"]))
    try:
        r = httpx.get(f"{live.url}/ready")
        assert r.status_code == 503 and r.headers["retry-after"]
        started = time.monotonic()
        r = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] and time.monotonic() - started < 2
        assert r.json()["error"]["code"] == "upstream_unavailable"
        r = httpx.post(f"{live.url}/v1/messages/count_tokens", headers={"x-api-key": API_KEY}, timeout=10,
                       json={"model": "ghost", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert httpx.get(f"{live.url}/health").status_code == 200
    finally:
        live.stop()


def test_supervised_llama_cpp_killed_and_restarted(llama_cpp_available, tmp_path):
    cfg = parse_config({"api_key": API_KEY, "log_dir": str(tmp_path), "connect_timeout": 2,
                        "models": [{"names": ["tiny-llama"], "engine": "llama.cpp", "max_model_len": 512,
                                    "startup_timeout": 120, "args": {"n_threads": 1}}]})
    gateway = build_gateway(cfg, supervisor_options={"poll_interval": 0.2, "health_interval": 0.5,
                                                     "backoff": Backoff(initial=0.5)})
    live = _serve(gateway)
    sup: Supervisor = gateway.pools[0].upstreams[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        assert _wait_ready(live.url).status_code == 200
        first_pid = sup.pid
        assert _sdk(live).chat.completions.create(**body).model == "tiny-llama"

        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (r := httpx.get(f"{live.url}/ready")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["models"]["tiny-llama"]["state"] == "restarting"

        started = time.monotonic()
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=auth, json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] and time.monotonic() - started < 2

        assert _wait_ready(live.url, 90).status_code == 200
        assert sup.restarts == 1 and sup.pid not in (None, first_pid)
        assert _sdk(live).chat.completions.create(**body).choices[0].message.content is not None
        assert "launch:" in (tmp_path / "tiny-llama-0.log").read_text()
    finally:
        pid = sup.pid
        live.stop()
    assert pid is not None
    with pytest.raises(ProcessLookupError):  # stopping the server stopped the engine
        os.kill(pid, 0)


def test_builtin_and_upstream_on_one_port(llama_servers):
    cfg = parse_config({"api_key": API_KEY, "models": [
        {"names": ["smollm2"], "engine": "builtin", "args": {"max_model_len": 512, "kv_cache_memory": "64MiB"}},
        {"names": ["tiny-llama"], "engine": "upstream", "upstreams": llama_servers[:1]}]})
    live = _serve(build_gateway(cfg))
    try:
        r = _wait_ready(live.url)
        assert r.status_code == 200, r.text
        assert set(r.json()["models"]) == {"smollm2", "tiny-llama"}
        client = _sdk(live)
        msgs = [{"role": "user", "content": "Say hello."}]
        for name in ("smollm2", "tiny-llama"):
            out = client.chat.completions.create(model=name, messages=msgs, max_tokens=4)
            assert out.model == name and out.choices[0].message.content
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"smollm2", "tiny-llama"} and cards["smollm2"].max_model_len == 512
        auth = {"x-api-key": API_KEY}
        r = httpx.post(f"{live.url}/v1/messages", headers=auth, timeout=60,
                       json={"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["type"] == "message"  # replayed to the builtin app
        r = httpx.post(f"{live.url}/v1/messages", json={"model": "smollm2", "max_tokens": 4, "messages": []})
        assert r.status_code == 401 and r.json()["type"] == "error"

        # This server as a replica of the builtin engine (what --dp launches): a translated stream's
        # message_start is counted by the replica's own engine, as its count_tokens is.
        pool = ModelPool(["smollm2"], [AttachedUpstream(live.url, API_KEY, interval=0.5)], engine="builtin")
        front = _serve(Gateway([pool], api_key=API_KEY, timeouts=Timeouts(connect=2.0, read=60.0)))
        try:
            assert _wait_ready(front.url).status_code == 200
            claude = _claude(front)
            counted = claude.messages.count_tokens(model="smollm2", **ASK).input_tokens
            with claude.messages.stream(model="smollm2", max_tokens=4, **ASK) as stream:
                start = next(iter(stream))
                final = stream.get_final_message()
            assert start.message.usage.input_tokens == counted == final.usage.input_tokens > 0
        finally:
            front.stop()
    finally:
        live.stop()


# ---- protocol translation, on a recorded engine stream -----------------------------------------------

TOOL_STREAM = [  # what the normaliser hands on for a vLLM stream that thinks, then calls a tool
    {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "Need the weather."}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": ""}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                  "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}},
]


def _replay_frames(dialect) -> list[dict]:
    import asyncio

    async def payloads():
        for chunk in TOOL_STREAM:
            yield json.dumps(chunk)
        yield "[DONE]"

    async def run():
        return [frame async for frame in dialect.frames(payloads())]

    out = []
    for frame in asyncio.run(run()):
        lines = dict(line.split(": ", 1) for line in frame.decode().strip().split("\n"))
        out.append(json.loads(lines["data"]))
    return out


def test_anthropic_translation_of_a_tool_stream():
    from flagdeploy.gateway.translate import AnthropicDialect

    events = _replay_frames(AnthropicDialect("glm-5.3-flash"))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use"] and starts[1]["name"] == "get_weather"
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 7


def test_responses_translation_of_a_tool_stream():
    from flagdeploy.gateway.translate import ResponsesDialect

    dialect = ResponsesDialect("glm-5.3-flash")
    dialect.chat_request({"input": "weather in Paris?", "stream": True})
    events = _replay_frames(dialect)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["usage"]["output_tokens"] == 7
    items = final["response"]["output"]
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[1]["call_id"] == "call_1" and json.loads(items[1]["arguments"]) == {"city": "Paris"}


# ---- Claude Code on an external engine: stop sequences and prompt tokens, on recorded shapes ---------

def _stream(*deltas: dict, finish: dict | None = None) -> list[dict]:
    """Chat chunks carrying `deltas`, the last one finished with `finish` (finish_reason and the
    engine's stop key, as each engine sends them)."""
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    if finish is not None:
        chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {}} | finish]})
    return chunks


def _frames(dialect, chunks: list[dict]) -> list[dict]:
    import asyncio

    async def payloads():
        for chunk in chunks:
            yield json.dumps(chunk)
        yield "[DONE]"

    async def run():
        return [frame async for frame in dialect.frames(payloads())]

    return [json.loads(frame.decode().split("data: ", 1)[1]) for frame in asyncio.run(run())]


@pytest.mark.parametrize("finish, want", [
    ({"finish_reason": "stop", "stop_reason": "###"}, ("stop_sequence", "###")),  # vLLM: the stop string
    ({"finish_reason": "stop", "stop_reason": 128009}, ("end_turn", None)),        # vLLM: a stop token id
    ({"finish_reason": "stop", "matched_stop": "###"}, ("stop_sequence", "###")),  # SGLang
    ({"finish_reason": "stop", "stop_reason": None}, ("end_turn", None)),          # EOS
    ({"finish_reason": "length", "stop_reason": None}, ("max_tokens", None)),
])
def test_engine_stop_signal_becomes_stop_sequence(finish, want):
    """An engine that says which stop sequence ended the answer is sent them, and its word is mapped,
    streamed (message_delta) and not."""
    from flagdeploy.gateway.translate import AnthropicDialect

    request = {"model": "glm", "max_tokens": 50, "stop_sequences": ["###", "END"], "stream": True,
               "messages": [{"role": "user", "content": "hi"}]}
    dialect = AnthropicDialect("glm", engine_says_stop=True)
    chat = dialect.chat_request(request)
    assert chat["stop"] == ["###", "END"] and chat["stream"] and dialect.client_stream
    delta = [e for e in _frames(dialect, _stream({"content": "Answer: 42"}, finish=finish))
             if e["type"] == "message_delta"][0]
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == want

    dialect.chat_request(request | {"stream": False})
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Answer: 42"}} | finish],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    message = dialect.answer(body)
    assert (message["stop_reason"], message["stop_sequence"]) == want and message["usage"]["input_tokens"] == 9


def test_stop_sequences_matched_here_for_an_engine_that_does_not_say():
    """llama-cpp-python and llama.cpp's OpenAI routes end a stop sequence with a bare "stop": the
    gateway keeps the sequences, streams from the engine, holds back text that could grow into one,
    cuts at the match and reports it; a held-back prefix that does not grow is sent on."""
    from flagdeploy.gateway.translate import AnthropicDialect

    def dialect():
        made = AnthropicDialect("tiny")
        chat = made.chat_request({"model": "tiny", "max_tokens": 50, "stop_sequences": ["Paris."], "stream": False,
                                  "messages": [{"role": "user", "content": "Capital of France?"}]})
        assert "stop" not in chat and chat["stream"] and made.client_stream is False and made.wants_prompt_count
        made.input_tokens = 21  # counted before sending (the engine sends no usage in a stream)
        return made

    chunks = _stream({"role": "assistant", "content": "It is P"}, {"content": "ar"}, {"content": "t of "},
                     {"content": "Paris"}, {"content": ". More"}, {"content": " text"},
                     finish={"finish_reason": "length"})
    events = _frames(dialect(), chunks)
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    delta = [e for e in events if e["type"] == "message_delta"][0]
    assert text == "It is Part of "  # "P", "Par" held back, then sent on; cut before "Paris."
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Paris."}
    assert delta["usage"] == {"input_tokens": 21, "output_tokens": 5}  # chunks counted: the engine's usage never came
    assert events[0]["message"]["usage"]["input_tokens"] == 21

    import asyncio

    async def payloads():
        for chunk in chunks:
            yield json.dumps(chunk)
        yield "[DONE]"

    message = asyncio.run(dialect().collected(payloads()))  # the non-streamed answer, from the engine's stream
    assert message["content"] == [{"type": "text", "text": "It is Part of "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "Paris.")
    assert message["usage"]["input_tokens"] == 21


def test_stop_matcher_flushes_held_text_at_the_end():
    from flagdeploy.gateway.normalize import StopMatcher

    matcher = StopMatcher(["</done>"])
    out = matcher.chunk(_stream({"content": "all </do"})[0])
    assert out[0]["choices"][0]["delta"]["content"] == "all " and not matcher.done
    assert matcher.end()[0]["choices"][0]["delta"]["content"] == "</do"  # the stream ended: not a stop after all


class _Engine:
    """The token-counting routes of an engine, in the shapes each one documents and answers (vLLM
    and SGLang: protocol.py's TokenizeRequest/Response; llama.cpp: tools/server; llama-cpp-python:
    llama_cpp/server/app.py), as an httpx transport. Text is "tokenized" by words."""

    def __init__(self, kind: str):
        self.kind = kind
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content)
        self.seen.append((path, body))
        answer = getattr(self, f"_{self.kind}")(path, body)
        return answer if isinstance(answer, httpx.Response) else httpx.Response(200, json=answer)

    @staticmethod
    def _words(text: str) -> list[int]:
        return [1] * len(text.split())

    def _vllm(self, path, body):
        if path != "/tokenize":
            return httpx.Response(404, json={"detail": "Not Found"})
        tokens = self._words(json.dumps(body["messages"])) if "messages" in body else self._words(body["prompt"])
        return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}

    def _sglang(self, path, body):
        if path != "/tokenize":
            return httpx.Response(404, json={"detail": "Not Found"})
        if "prompt" not in body:
            return httpx.Response(400, json={"object": "error", "message": "prompt: Field required", "code": 400})
        tokens = self._words(body["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    def _llama_server(self, path, body):
        if path == "/v1/chat/completions/input_tokens":
            return {"input_tokens": 17, "object": "response.input_tokens"}
        if path == "/tokenize":  # without `content` it answers no tokens
            return {"tokens": self._words(body.get("content", ""))}
        return httpx.Response(404, text="File Not Found")

    def _old_llama_server(self, path, body):
        if path == "/apply-template":
            return {"prompt": "<|user|> " + " ".join(m["content"] for m in body["messages"]) + " <|assistant|>"}
        return self._llama_server(path, body) if path == "/tokenize" else httpx.Response(404, text="File Not Found")

    def _llama_cpp_python(self, path, body):
        if path == "/extras/tokenize/count":
            return {"count": 1 + len(self._words(body["input"]))}  # it always adds BOS
        return httpx.Response(404, json={"detail": "Not Found"})

    def _mindie(self, path, body):
        return httpx.Response(404, text="Not Found")


CHAT = {"model": "m", "stream": True,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]}


@pytest.mark.parametrize("kind, found_by, then", [
    ("vllm", ["/tokenize"], ["/tokenize"]),
    ("llama_server", ["/tokenize", "/v1/chat/completions/input_tokens"], ["/v1/chat/completions/input_tokens"]),
    ("old_llama_server", ["/tokenize", "/v1/chat/completions/input_tokens", "/apply-template", "/tokenize"],
     ["/v1/chat/completions/input_tokens", "/apply-template", "/tokenize"]),
    ("sglang", ["/tokenize", "/v1/chat/completions/input_tokens", "/apply-template", "/tokenize", "/tokenize"],
     ["/tokenize"]),
    ("llama_cpp_python", ["/tokenize", "/v1/chat/completions/input_tokens", "/apply-template", "/tokenize",
                          "/extras/tokenize/count", "/extras/tokenize/count"], ["/extras/tokenize/count"]),
])
def test_prompt_counted_by_each_engines_own_route(kind, found_by, then):
    """The first route an engine answers in its shape is found once, then used alone. Engines that
    render the chat count it themselves; for the others the template is rendered here (ChatML
    without model files) and what the route adds to any text (llama-cpp-python's BOS) taken off."""
    import asyncio

    from flagdeploy.gateway.tokens import CHATML, TokenCounter

    engine = _Engine(kind)
    counter = TokenCounter(None)
    want = {"vllm": len(json.dumps(CHAT["messages"]).split()), "llama_server": 17,
            "old_llama_server": len("<|user|> Be brief. Say hello. <|assistant|>".split())
            }.get(kind, len(CHATML.render(CHAT).split()))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            return [await counter.count(client, AttachedUpstream("http://engine"), CHAT) for _ in range(2)]

    assert asyncio.run(run()) == [want, want]
    assert [path for path, _ in engine.seen] == found_by + then
    if kind == "vllm":
        assert engine.seen[0][1] == {"model": "m", "messages": CHAT["messages"], "add_generation_prompt": True,
                                     "add_special_tokens": False}


def test_an_engine_without_a_counting_route_is_a_clear_400():
    import asyncio

    from flagdeploy.gateway.tokens import TokenCounter
    from flagdeploy.server.errors import APIError

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_Engine("mindie"))) as client:
            return await TokenCounter(None).count(client, AttachedUpstream("http://engine"), CHAT)

    with pytest.raises(APIError) as exc:
        asyncio.run(run())
    assert exc.value.status == 400 and "no route that counts tokens" in exc.value.message


def test_translations_check_a_request_as_the_builtin_routes_do():
    """What the builtin /v1/responses and /v1/messages refuse, the translation to an upstream refuses with the
    same 400 (it skipped the item, role and tool checks, and a text that was no string became a 500)."""
    from flagdeploy.gateway.translate import AnthropicDialect, ResponsesDialect
    from flagdeploy.server.errors import APIError

    cases = [(ResponsesDialect, {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
              "input[0].content[0].text"),
             (ResponsesDialect, {"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice.name"),
             (AnthropicDialect, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 5}, "messages.0.role"),
             (AnthropicDialect, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                 "tool_choice": {"type": "weird"}}, "tool_choice.type")]
    for dialect, body, where in cases:
        with pytest.raises(APIError) as exc:
            dialect("m").chat_request(body)
        assert exc.value.status == 400 and where in exc.value.message, exc.value.message


def test_a_gateway_in_front_of_flagdeploy_answers_as_flagdeploy_does():
    """`serve --upstream` to a builtin server (and --dp replicas, which are the same): what the second hostile
    pass found there. Claude Code's max_tokens 32000 is served with what fits (it was the chat route's 400);
    a lone surrogate is a 400 in the route's shape (the upstream request failed to encode: a plain 500);
    a wrong method is a 405, a compressed body a 415, as the builtin app answers."""
    from flagdeploy.engine import build_engine
    from flagdeploy.server import create_app

    upstream = _serve(create_app(lambda: build_engine(max_model_len=512, max_num_seqs=2, kv_cache_memory=32 << 20),
                                 ["smollm2"]))
    gateway = None
    try:
        assert _wait_ready(upstream.url, timeout=180).status_code == 200
        gateway = _serve(_attached([upstream.url], ["smollm2"]))
        assert _wait_ready(gateway.url).status_code == 200
        claude = anthropic.Anthropic(base_url=gateway.url, api_key=API_KEY, max_retries=0)
        with claude.messages.stream(model="smollm2[1m]", max_tokens=32000,
                                    messages=[{"role": "user", "content": "Hi"}]) as stream:
            answer = stream.get_final_message()
        assert answer.content and answer.usage.output_tokens < 512
        # prompt tokens counted by the upstream's own /tokenize (vLLM's route), as on vLLM: exact
        ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}
        counted = httpx.post(f"{gateway.url}/v1/messages/count_tokens", json=ask, headers={"x-api-key": API_KEY})
        direct = httpx.post(f"{upstream.url}/v1/messages/count_tokens", json=ask)
        assert counted.status_code == 200 and counted.json() == direct.json(), counted.text
        auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
        for route, body in (("/v1/chat/completions", '{"model":"smollm2","messages":[{"role":"user","content":"\\ud800"}]}'),
                            ("/v1/messages", '{"model":"smollm2","max_tokens":5,"messages":[{"role":"user","content":"\\ud800"}]}')):
            r = httpx.post(f"{gateway.url}{route}", content=body, headers=auth)
            assert r.status_code == 400 and "surrogate" in r.text, r.text
            assert ("type" in r.json()) == route.startswith("/v1/messages")  # Anthropic's shape there
        assert httpx.get(f"{gateway.url}/v1/chat/completions", headers=auth).status_code == 405
        r = httpx.get(f"{gateway.url}/v1/messages", headers=auth)
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"\x1f\x8b", headers=auth | {"content-encoding": "gzip"})
        assert r.status_code == 415
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()
