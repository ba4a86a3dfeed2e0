"""The OpenAI-compatible server, driven by the real `openai` SDK (and raw httpx where the SDK would
hide the wire) against a real uvicorn on loopback, in front of the real engine on the default model.

Outputs are kept to a few tokens: every token costs CPU time.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flagdeploy.net import free_port as _free_port
from flagdeploy.server import create_app, make_server
from flagdeploy.server.openai import ContentChunks
from flagdeploy.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    DeltaMessage,
)

API_KEY = "sk-flagdeploy-test-key"
NAMES = ["smollm2-135m-instruct", "smollm2"]
MAX_MODEL_LEN = 1024
CHAT = [{"role": "user", "content": "Say hello."}]


@dataclass
class LiveServer:
    """A uvicorn server on a loopback port in a thread of the test process (shared by the server,
    Anthropic, bench, edge and gateway tests)."""

    url: str
    server: object
    thread: threading.Thread
    app: object = None
    observed: dict = field(default_factory=dict)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _serve(app) -> LiveServer:
    port = _free_port()
    server = make_server(app, "127.0.0.1", port, "warning")
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", server, thread, app)


def _wait_ready(url: str, timeout: float = 180) -> httpx.Response:
    """/ready once it answers 200, or says the load failed, or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/ready", timeout=5)
        failed = r.headers.get("content-type", "").startswith("application/json") and r.json().get("status") == "failed"
        if r.status_code == 200 or failed or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def start_observed(load_engine, what: str = "engine") -> LiveServer:
    """A live server whose engine (`load_engine()`) is built only once the server has been looked at
    while loading (/ready, a chat, /health: in `observed`), so that state is seen without a second
    model load."""
    go = threading.Event()

    def gated():
        go.wait(60)
        return load_engine()

    srv = _serve(create_app(gated, NAMES, api_key=API_KEY))
    auth = {"Authorization": f"Bearer {API_KEY}"}
    srv.observed["ready"] = httpx.get(f"{srv.url}/ready")
    srv.observed["chat"] = httpx.post(f"{srv.url}/v1/chat/completions", headers=auth,
                                      json={"model": NAMES[0], "messages": CHAT})
    srv.observed["health"] = httpx.get(f"{srv.url}/health")
    go.set()
    return _loaded(srv, what)


def serve_loaded(app, what: str = "engine", timeout: float = 180) -> LiveServer:
    """A live server for `app`, returned once its engine has loaded."""
    return _loaded(_serve(app), what, timeout)


def _loaded(srv: LiveServer, what: str, timeout: float = 180) -> LiveServer:
    ready = _wait_ready(srv.url, timeout)
    if ready.status_code != 200:
        srv.stop()
        pytest.fail(f"the {what} did not load: {ready.text}")
    return srv


@pytest.fixture(scope="module")
def live() -> LiveServer:
    """One server for the module, observed while it loads."""
    from flagdeploy.engine import build_engine

    srv = start_observed(lambda: build_engine(max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 << 20))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _still_serving(client: openai.OpenAI) -> None:
    """An error must not take the server (or the engine) down."""
    r = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")


def _running(http: httpx.Client) -> int:
    metrics = {family.name: family.samples[0].value
               for family in text_string_to_metric_families(http.get("/metrics").text) if family.samples}
    return int(metrics["flagdeploy:num_requests_running"]) + int(metrics["flagdeploy:num_requests_waiting"])


# ---- lifecycle -----------------------------------------------------------------------------------


def test_503_while_loading_then_ready(live: LiveServer, http: httpx.Client) -> None:
    assert live.observed["health"].status_code == 200
    assert live.observed["ready"].status_code == 503
    loading = live.observed["chat"]
    assert loading.status_code == 503
    assert loading.headers["retry-after"] == "5"
    assert loading.json()["error"]["type"] == "service_unavailable_error"
    assert loading.json()["error"]["code"] == "model_loading"
    assert http.get("/ready").json() == {"status": "ready"}
    assert http.get("/health").json() == {"status": "ok"}


def test_failed_load_keeps_health_and_reports_the_cause() -> None:
    def load_engine():
        raise RuntimeError("weights file is truncated")

    srv = _serve(create_app(load_engine, NAMES))
    try:
        assert _wait_ready(srv.url, timeout=10).status_code == 503
        assert httpx.get(f"{srv.url}/health").status_code == 200
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": NAMES[0], "messages": CHAT})
        assert r.status_code == 503
        assert "weights file is truncated" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models][0] == NAMES[0]
    assert {m.id for m in models} == set(NAMES)
    assert models[0].owned_by == "flagdeploy"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=8)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == NAMES[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_greedy_capital_of_france(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=NAMES[0], temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=NAMES[0], messages=CHAT, max_tokens=8, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    body, last = chunks[:-1], chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text
    assert last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8


def test_stream_wire_framing(live: LiveServer, http: httpx.Client) -> None:
    """What Dify parses: LF-only `data:` events split on a blank line, no `event:` lines, [DONE]."""
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": NAMES[0], "messages": CHAT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert "\r" not in raw
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)  # only sent when asked for
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1


@pytest.mark.parametrize("include_usage", [False, True])
def test_content_chunks_are_the_models_bytes(include_usage: bool) -> None:
    """The stream's per-token fast path writes what serialising the chunk models writes, byte for byte."""
    cid, model = 'chatcmpl-1%d"{x}', "org/model %s"
    fast = ContentChunks(cid, 1733000000, model, include_usage)
    for index, text in [(0, "Paris"), (3, ' é "q"\n\t\\ \x01 \u2028 😀 </s> %d {}')]:
        body = ChatCompletionChunk(id=cid, created=1733000000, model=model, choices=[
            ChatChunkChoice(index=index, delta=DeltaMessage(content=text))])
        assert fast(index, text) == f"data: {body.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"


def test_max_completion_tokens_is_honoured(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_lenient_messages(client: openai.OpenAI) -> None:
    """LangChain sends assistant `content: null`, o-series clients `developer`, others content parts
    and fields we do not know."""
    r = client.chat.completions.create(
        model=NAMES[0], max_tokens=4,
        messages=[{"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "Again."}],
        user="someone", extra_body={"parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


def test_context_suffix_and_case_resolve_to_canonical(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="SmolLM2 [1m]", messages=CHAT, max_tokens=1)
    assert r.model == NAMES[0]


def test_n_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    def ask():
        return client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=6, n=2, seed=1234,
                                              temperature=1.0)

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    single = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=1)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once
    assert 2 <= first.usage.completion_tokens <= 12  # outputs are counted per choice


def test_stream_n2_finishes_each_choice_once(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=4, n=2, seed=3,
                                                 stream=True))
    finishes = [ch.index for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert sorted(finishes) == [0, 1]


# ---- completions ---------------------------------------------------------------------------------


def test_completions_non_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=NAMES[1], prompt="The capital of France is", max_tokens=4, temperature=0,
                                  echo=True)
    assert r.object == "text_completion" and r.model == NAMES[0]
    assert r.choices[0].text.startswith("The capital of France is")
    assert len(r.choices[0].text) > len("The capital of France is")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=NAMES[0], prompt="1, 2, 3,", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_completions_token_id_prompt(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.completions.create(model=NAMES[0], prompt=[504, 3575, 282], max_tokens=2)
    assert r.usage.prompt_tokens == 3
    bad = http.post("/v1/completions", json={"model": NAMES[0], "prompt": [10 ** 9], "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


# ---- errors --------------------------------------------------------------------------------------


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    err = info.value.body
    assert err["code"] == "model_not_found"
    assert err["message"] == "The model `gpt-4o` does not exist or you do not have access to it."
    _still_serving(client)


def test_wrong_or_missing_api_key_is_401(live: LiveServer, client: openai.OpenAI) -> None:
    bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=1)
    assert info.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{live.url}/v1/models").status_code == 401
    assert httpx.get(f"{live.url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(f"{live.url}/health").status_code == 200  # never behind the key
    assert httpx.head(f"{live.url}/").status_code == 200  # Claude Code's connectivity probe, key or not
    _still_serving(client)


def test_bad_json_is_400_with_envelope(http: httpx.Client, client: openai.OpenAI) -> None:
    r = http.post("/v1/chat/completions", content=b'{"model": "smollm2", "messages": [',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("We could not parse the JSON body of your request")
    _still_serving(client)


@pytest.mark.parametrize("field, value", [("temperature", "hot"), ("temperature", 3), ("top_p", 0), ("n", 0),
                                          ("max_tokens", 0), ("messages", [])])
def test_invalid_field_is_400_never_422(http: httpx.Client, field: str, value) -> None:
    body = {"model": NAMES[0], "messages": CHAT, "max_tokens": 1, field: value}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_prompt_too_long_is_400_context_length_exceeded(client: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAMES[0], messages=long, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "messages"
    assert "prompt is too long" in info.value.message  # how LangChain recognises a context overflow
    with pytest.raises(openai.BadRequestError) as info:  # streaming still answers with a status, not an event
        client.chat.completions.create(model=NAMES[0], messages=long, max_tokens=4, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"
    _still_serving(client)


def test_unknown_route_is_404_envelope(http: httpx.Client) -> None:
    r = http.post("/v1/nothing-here", json={})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


# ---- disconnects ---------------------------------------------------------------------------------


def _wait_idle(http: httpx.Client, timeout: float = 5) -> int:
    deadline = time.monotonic() + timeout
    while (n := _running(http)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_stream_disconnect_aborts_generation(http: httpx.Client, client: openai.OpenAI) -> None:
    body = {"model": NAMES[0], "messages": CHAT, "max_tokens": 800, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    assert _wait_idle(http) == 0
    _still_serving(client)


def test_non_stream_disconnect_aborts_generation(live: LiveServer, http: httpx.Client) -> None:
    body = {"model": NAMES[0], "messages": CHAT, "max_tokens": 800, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert _wait_idle(http) == 0


def test_langchain_chat_openai_invoke_and_stream(live: LiveServer):
    """LangChain's ChatOpenAI with only base_url changed: invoke, stream with usage, the Paris answer."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, model=NAMES[0], temperature=0, max_tokens=16,
                      max_retries=0, stream_usage=True)
    msg = llm.invoke("What is the capital of France?")
    assert "Paris" in msg.content
    assert msg.usage_metadata["output_tokens"] > 0  # LangChain sent max_completion_tokens; usage came back
    chunks = list(llm.stream("What is the capital of France?"))
    assert "Paris" in "".join(c.content for c in chunks)
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks) == msg.usage_metadata["output_tokens"]
