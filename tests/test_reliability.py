"""A hostile client and a bursty load against a real server on loopback (issue 34): limits that hold for
any arrival pattern, 4xx (never 5xx) for bad input on every route, and refusals that say why.

The server runs the real engine on the default model with two sequence slots and two waiting places.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from test_server import API_KEY, LiveServer, _serve, _wait_ready, serve_loaded

from flagdeploy.server import create_app
from flagdeploy.server.errors import APIError
from flagdeploy.server.pipeline import ServerSettings, make_jobs
from flagdeploy.server.protocol import SamplingFields

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
MAX_NUM_SEQS, MAX_WAITING = 2, 2
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live() -> LiveServer:
    from flagdeploy.engine import build_engine

    app = create_app(lambda: build_engine(max_model_len=1024, max_num_seqs=MAX_NUM_SEQS, kv_cache_memory=64 << 20),
                     [MODEL], api_key=API_KEY, max_waiting=MAX_WAITING)
    srv = serve_loaded(app)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(live: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        yield c


def _gauges(http: httpx.Client) -> tuple[int, int]:
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(http.get("/metrics").text) if f.samples}
    return int(values["flagdeploy:num_requests_running"]), int(values["flagdeploy:num_requests_waiting"])


def _wait_idle(live: LiveServer, http: httpx.Client, timeout: float = 60) -> None:
    engine = live.app.state.engine_slot.engine
    deadline = time.monotonic() + timeout
    while (_gauges(http) != (0, 0) or engine.in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauges(http) == (0, 0) and engine.in_flight() == 0, "the engine did not return to idle"


# ---- 1, 2: admission ------------------------------------------------------------------------------

LONG = {"max_tokens": 256, "ignore_eos": True, "stream": True}
BURST_ROUTES = [
    ("/v1/chat/completions", {"messages": HI, **LONG}, 429),
    ("/v1/completions", {"prompt": "Once upon a time", **LONG}, 429),
    ("/v1/messages", {"messages": HI, **LONG}, 529),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 256, "stream": True}, 429),
]


async def _burst(url: str, engine: Any, n: int) -> tuple[list[tuple[int, int, str | None]], int]:
    """`n` streamed requests over the four routes, all sent at once. Admitted ones are held (a client
    reads nothing) until every request is either refused or in flight in the engine, watching the
    in-flight count all along; then all hang up, which aborts them. Returns (status, expected overload
    status, Retry-After) of each refused request, and the largest in-flight count seen."""
    refused: list[tuple[int, int, str | None]] = []
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as c:
        async def one(i: int) -> None:
            route, body, overload = BURST_ROUTES[i % len(BURST_ROUTES)]
            async with c.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    refused.append((r.status_code, overload, r.headers.get("retry-after")))
                    return
                await asyncio.Event().wait()  # held open until cancelled

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        most = 0
        deadline = time.monotonic() + 120
        while len(refused) + engine.in_flight() < n and time.monotonic() < deadline:
            most = max(most, engine.in_flight())
            await asyncio.sleep(0.005)
        most = max(most, engine.in_flight())
        assert len(refused) + engine.in_flight() == n, "the burst was not answered in time"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return refused, most


def test_max_waiting_holds_for_a_burst_on_every_route(live: LiveServer, http: httpx.Client) -> None:
    """Thirty requests at once, five times over: never more in flight than the slots plus the waiting
    places, every other request refused with its route's overload status and Retry-After."""
    engine = live.app.state.engine_slot.engine
    for _ in range(5):
        _wait_idle(live, http)
        refused, most = asyncio.run(_burst(live.url, engine, 30))
        assert most == MAX_NUM_SEQS + MAX_WAITING and len(refused) == 30 - most, (most, refused)
        assert all(status == overload and retry == "1" for status, overload, retry in refused), refused
    _wait_idle(live, http)


async def _held_streams(n: int, tasks: list[asyncio.Task], client: httpx.AsyncClient, max_tokens: int) -> list[int]:
    """Start `n` long streamed chat requests that stay open (their tasks go to `tasks`); returns once each
    has its status: the statuses."""
    statuses: list[int] = []
    got = asyncio.Event()
    body = {"messages": HI, **LONG, "max_tokens": max_tokens}

    async def one() -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            statuses.append(r.status_code)
            if len(statuses) == n:
                got.set()
            if r.status_code == 200:
                await asyncio.Event().wait()

    tasks += [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.wait_for(got.wait(), 120)
    return statuses


def test_max_waiting_holds_when_the_kv_cache_is_the_limit() -> None:
    """Eight sequence slots but a KV cache for about two long answers: once the cache is full, requests held
    back by it count as waiting, so a burst finds about the places --max-waiting leaves (before, the server
    counted eight running places and queued six more while the cache ran four)."""
    from flagdeploy.engine import build_engine

    app = create_app(lambda: build_engine(max_model_len=512, max_num_seqs=8, kv_cache_memory=14 << 20),
                     [MODEL], api_key=API_KEY, max_waiting=MAX_WAITING)
    srv = serve_loaded(app)
    engine = srv.app.state.engine_slot.engine
    scheduler = engine.engine.scheduler

    async def run() -> tuple[list[int], list[int]]:
        tasks: list[asyncio.Task] = []
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120, limits=limits) as c:
            try:
                first = await _held_streams(4, tasks, c, 440)
                deadline = time.monotonic() + 60  # four growing answers fill the cache: preemptions
                while not scheduler.num_preemptions and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert scheduler.num_preemptions, "the KV cache never filled"
                assert engine.in_flight() == 4, "the first answers ended before the burst"
                burst = await _held_streams(10, tasks, c, 32)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return first, burst

    try:
        first, burst = asyncio.run(run())
        assert first == [200] * 4
        # The places the cache holds move by about one as the four answers are preempted and readmitted
        # (and as admitted short answers start), so the burst finds the waiting places plus at most one;
        # counted against the eight slots it found six.
        assert burst.count(200) <= MAX_WAITING + 1 and set(burst) <= {200, 429}, burst
    finally:
        srv.stop()


def test_a_request_that_can_never_be_admitted_is_a_400(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI, n=5, max_tokens=2)
    error = exc.value.body
    assert error["param"] == "n" and "can never be admitted" in error["message"] and "at most 4" in error["message"]
    # n = slots + waiting places fits an idle server
    assert len(client.chat.completions.create(model=MODEL, messages=HI, n=4, max_tokens=2).choices) == 4


# ---- 3, 4: bodies that broke the parser and the tokenizer -----------------------------------------

ROUTES = {
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
    "/v1/completions": lambda text: {"prompt": text, "max_tokens": 2},
    "/v1/responses": lambda text: {"input": [{"role": "user", "content": text}], "max_output_tokens": 2},
    "/v1/messages": lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
    "/v1/messages/count_tokens": lambda text: {"messages": [{"role": "user", "content": text}]},
}


def _shape_ok(route: str, r: httpx.Response) -> str:
    """The message of a 400 in the route's protocol's error shape."""
    assert r.status_code == 400, r.text
    body = r.json()
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_deeply_nested_json_is_a_400(http: httpx.Client, route: str) -> None:
    for depth in (10_000, 150):
        nested = "[" * depth + "]" * depth
        raw = json.dumps(ROUTES[route]("Hi"))[:-1] + f', "extra": {nested}}}'
        message = _shape_ok(route, http.post(route, content=raw, headers={"content-type": "application/json"}))
        assert "nests deeper than" in message or "could not parse" in message


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_lone_surrogate_is_a_400_naming_the_field(http: httpx.Client, route: str) -> None:
    raw = json.dumps(ROUTES[route]("caf\ud800e"))  # ensure_ascii: the JSON escape \ud800, valid JSON
    assert "\\ud800" in raw
    message = _shape_ok(route, http.post(route, content=raw, headers={"content-type": "application/json"}))
    assert "surrogate" in message
    field = {"/v1/completions": "prompt", "/v1/responses": "input[0].content"}.get(route, "messages")
    assert field in message.replace(".0.", "[0].")


# ---- 5: media the model cannot see -----------------------------------------------------------------

PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_media_is_refused_not_dropped(live: LiveServer, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    for part, path in [({"type": "image_url", "image_url": {"url": PIXEL}}, "messages[0].content[1]"),
                       ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages[0].content[1]")]:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
        assert exc.value.body["param"] == path and "takes text only" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": PIXEL}]}])
    assert exc.value.body["param"] == "input[0].content[1]"

    claude = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL.split(",")[1]}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    for content, where in [([{"type": "text", "text": "What is this?"}, image], "messages.0.content.1"),
                           ([document, {"type": "text", "text": "Summarise."}], "messages.0.content.0"),
                           ([{"type": "tool_result", "tool_use_id": "t1", "content": [image]}], "messages.0.content.0.content.0")]:
        with pytest.raises(anthropic.BadRequestError) as aexc:
            claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}])
        assert where in aexc.value.body["error"]["message"], aexc.value.body
    # the engine kept serving
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices


# ---- 6: tool definitions ----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": 7}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "wibble"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
      {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], None, "tools[1].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    (None, "required", "tool_choice"),
])
def test_invalid_openai_tools_are_a_400(live: LiveServer, tools: Any, choice: Any, param: str) -> None:
    body: dict[str, Any] = {"messages": HI, "max_tokens": 2}
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    r = httpx.post(f"{live.url}/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("tool, fragment", [
    ({"description": "no name", "input_schema": SCHEMA}, "tools.0.name"),
    ({"name": "f", "input_schema": "x"}, "tools.0.input_schema"),
    ({"name": "f"}, "tools.0.input_schema"),
])
def test_invalid_anthropic_tools_are_a_400(live: LiveServer, tool: dict[str, Any], fragment: str) -> None:
    claude = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=MODEL, max_tokens=2, messages=HI, tools=[tool])
    assert fragment in exc.value.body["error"]["message"]


def test_invalid_responses_tool_is_a_400(live: LiveServer) -> None:
    r = httpx.post(f"{live.url}/v1/responses", headers=AUTH,
                   json={"input": "Hi", "tools": [{"type": "function", "parameters": SCHEMA}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name"


# ---- 7: a huge prompt ---------------------------------------------------------------------------------


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_huge_prompt_is_refused_by_the_bound_before_tokenizing(http: httpx.Client, route: str) -> None:
    """10 MB of text cannot fit 1,024 tokens however it tokenizes: refused from its length alone (the
    message gives the bound), not after seconds of tokenizing on the event loop."""
    message = _shape_ok(route, http.post(route, json=ROUTES[route]("hello world " * 900_000)))
    assert message.startswith("The prompt is too long") and "are at least" in message


def test_health_answers_while_a_long_prompt_is_tokenized(live: LiveServer, http: httpx.Client) -> None:
    """A prompt just under the bound is tokenized on a worker thread: /health answers meanwhile."""
    engine = live.app.state.engine_slot.engine
    text = "hello world " * (engine.max_model_len * engine.tokenizer.max_token_chars // 13)
    tokenize = engine.tokenizer.encode
    entered, gate = threading.Event(), threading.Event()

    def slow_encode(*args: Any, **kwargs: Any) -> list[int]:
        if len(args[0]) > 50_000:
            entered.set()
            gate.wait(30)  # holds this worker thread, as a long tokenization would
        return tokenize(*args, **kwargs)

    engine.tokenizer.encode = slow_encode
    try:
        result: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: result.setdefault("r", http.post(
            "/v1/chat/completions", json=ROUTES["/v1/chat/completions"](text))))
        worker.start()
        assert entered.wait(30)
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200  # the loop is free
        gate.set()
        worker.join(60)
    finally:
        engine.tokenizer.encode = tokenize
        gate.set()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"


# ---- max_tokens that cannot fit (issue 32, part 3) -------------------------------------------------------


def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=5000)
    body = exc.value.body
    assert body["param"] == "max_completion_tokens" and body["code"] == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in body["message"] and "5000 in the completion" in body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1024)
    # the Anthropic route generates what fits (--max-tokens-policy auto): Claude Code asks every model for 32,000
    claude = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0)
    with claude.messages.stream(model=MODEL, max_tokens=32000, messages=HI) as stream:  # as Claude Code asks
        answer = stream.get_final_message()
    assert answer.content and answer.usage.input_tokens + answer.usage.output_tokens <= 1024
    r = httpx.post(f"{live.url}/v1/responses", headers=AUTH, json={"input": "Hi", "max_output_tokens": 4096})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    # what fits is served
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens <= 2


def test_clamp_policy_generates_what_fits() -> None:
    """--max-tokens-policy clamp: the same request is served with what room the context leaves; auto (the
    default) clamps on the Anthropic route only; error refuses on every route."""
    engine = SimpleNamespace(max_model_len=64, check_params=lambda params: None)
    prompt = [[1] * 10]
    for policy, anthropic_route, clamps in (("clamp", False, True), ("auto", True, True), ("auto", False, False),
                                            ("error", True, False)):
        settings = ServerSettings(max_tokens_policy=policy)
        if clamps:
            jobs = make_jobs(engine, settings, SamplingFields(), 5000, prompt, "c", anthropic=anthropic_route)
            assert jobs[0].params.max_tokens == 54
            continue
        with pytest.raises(APIError) as exc:
            make_jobs(engine, settings, SamplingFields(), 5000, prompt, "e", anthropic=anthropic_route)
        assert exc.value.status == 400 and "10 in the prompt, 5000 in the completion" in exc.value.message


# ---- an unexpected failure: one 500, logged once -------------------------------------------------------


class _BrokenTokenizer:
    max_token_chars = 1

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("a bug in the template path")


class _BrokenEngine:
    max_model_len = 1024
    input_modalities = frozenset({"text"})
    tokenizer = _BrokenTokenizer()

    def stats(self) -> dict[str, int]:
        return {}


def test_a_500_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    srv = _serve(create_app(lambda: _BrokenEngine(), [MODEL]))
    try:
        assert _wait_ready(srv.url).status_code == 200
        with caplog.at_level(logging.ERROR):
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": HI})
            time.sleep(0.2)  # uvicorn's own logging, if any, happens after the response
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        tracebacks = [rec for rec in caplog.records if rec.exc_info is not None]
        assert len(tracebacks) == 1, [rec.getMessage() for rec in tracebacks]
        assert "a bug in the template path" in str(tracebacks[0].exc_info[1])
    finally:
        srv.stop()


def test_serve_help_recommends_the_key_variable() -> None:
    from flagdeploy.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    assert "FLAGDEPLOY_API_KEY" in out and "--max-tokens-policy" in out


# ---- 8: what the second hostile client found (types, vocabularies, hang-ups, envelopes) ------------------

def _post(live: LiveServer, route: str, body: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{route}", headers=AUTH, json=body, timeout=60)


@pytest.mark.parametrize("items, param", [
    ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}], "input[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "input_text", "text": ["a"]}]}], "input[0].content[0].text"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"role": "assistant", "content": {"a": 1}}], "input[0].content"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "x", "output": 5}],
     "input[1].output"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "x",
                                          "output": [{"type": "input_text", "text": 5}]}], "input[1].output[0].text"),
    ([{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant",
                                          "content": [{"type": "output_text", "text": 5}]}], "input[1].content[0].text"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": 7}], "input[1].name"),
    ([{"role": "user", "content": [{"type": "weird", "text": "hi"}]}], "input[0].content[0].type"),
    ([{"role": "wizard", "content": "hi"}], "input[0].role"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
])
def test_responses_items_of_the_wrong_shape_are_a_400_naming_the_field(live: LiveServer, items: Any, param: str) -> None:
    """These were 500s (a text part's `text` that was no string reached a join)."""
    r = _post(live, "/v1/responses", {"input": items, "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("route, body, where", [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "weird"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": HI, "guided_choice": []}, "guided_choice"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": [1]}}}, "text.format.schema"),
    ("/v1/responses", {"input": "hi", "instructions": 5}, "instructions"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
                       "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ("/v1/messages", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ("/v1/messages", {"messages": HI, "tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ("/v1/messages", {"messages": HI, "tool_choice": {"type": "weird"}}, "tool_choice.type"),
    ("/v1/messages", {"messages": HI, "system": [{"type": "text", "text": "Be brief."}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}, "system.1"),
])
def test_wrong_vocabulary_is_a_400_naming_the_field(live: LiveServer, route: str, body: dict, where: str) -> None:
    """Unknown roles and part types, a json_schema format without a schema object, an empty choice list, a
    tool_choice without its name: refused, where they were dropped, answered "null" or named 'None'."""
    message = _shape_ok(route, _post(live, route, {"max_tokens": 2, **body}))
    assert where in message, message
    if not route.startswith("/v1/messages"):
        assert _post(live, route, {"max_tokens": 2, **body}).json()["error"]["param"] == where


def test_an_empty_stop_string_stops_nothing(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    want = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8)
    got = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, stop="")
    assert got.choices[0].message.content == want.choices[0].message.content
    assert len(got.choices[0].message.content) > 1


def test_allowed_tools_restricts_the_tools_a_forced_call_may_name(live: LiveServer) -> None:
    tools = [{"type": "function", "name": n, "parameters": SCHEMA} for n in ("weather", "time")]
    r = _post(live, "/v1/responses", {"input": "What is the weather in Paris?", "tools": tools, "max_output_tokens": 48,
                                      "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                      "tools": [{"type": "function", "name": "time"}]}})
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and {c["name"] for c in calls} == {"time"}


def test_a_client_that_hangs_up_mid_body_is_no_server_error(live: LiveServer, http: httpx.Client,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """It used to be logged with a traceback and counted as a 500, one per connection (a slowloris
    client filled the log and the 5xx rate)."""
    import socket
    from urllib.parse import urlparse

    def count(status: str) -> float:
        text = http.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name.endswith("http_requests_total") and s.labels.get("status") == status)

    url = urlparse(live.url)
    before = count("500")
    with caplog.at_level(logging.ERROR):
        for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            with socket.create_connection((url.hostname, url.port)) as sock:
                sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                             "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\"".encode())
            time.sleep(0.3)
    assert count("500") == before
    assert not [rec for rec in caplog.records if rec.exc_info is not None]
    assert http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).status_code == 200


def test_routing_errors_and_encodings_answer_in_the_protocol_s_shape(live: LiveServer, http: httpx.Client) -> None:
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        r = http.request(method, path)
        assert r.status_code == status and r.json()["type"] == "error", r.text
    assert http.get("/v1/nothing").json()["error"]["message"].startswith("Invalid URL")
    assert http.head("/health").status_code == 200
    import gzip

    r = http.post("/v1/chat/completions", content=gzip.compress(json.dumps({"messages": HI}).encode()),
                  headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and "uncompressed" in r.json()["error"]["message"]


def test_penalties_logit_bias_and_min_p_are_applied_or_refused(live: LiveServer) -> None:
    """They were accepted and ignored, whatever their values."""
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    first = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                      logprobs=1).choices[0].logprobs.tokens[0]
    assert plain.choices[0].text.startswith(first)
    biased = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logit_bias={"28": 100})  # token 28 every time
    assert biased.choices[0].text != plain.choices[0].text and len(set(biased.choices[0].text)) == 1
    for extra, param in (({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"), ({"frequency_penalty": 3}, "frequency_penalty"),
                         ({"repetition_penalty": -1}, "repetition_penalty"), ({"min_p": 5}, "min_p")):
        r = _post(live, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    ok = _post(live, "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "presence_penalty": 1.5,
                                              "repetition_penalty": 1.2, "min_p": 0.1, "temperature": 0.7})
    assert ok.status_code == 200, ok.text


def test_tokenize_counts_what_a_chat_completion_would(live: LiveServer, http: httpx.Client) -> None:
    """vLLM's /tokenize: a chat rendered as a chat completion renders it (its prompt_tokens), or a prompt."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    counted = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert counted["count"] == usage["prompt_tokens"] == len(counted["tokens"]) and counted["max_model_len"] == 1024
    prompt = http.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert prompt["count"] == len(prompt["tokens"]) > 1
    assert http.post("/tokenize", json={"prompt": "x", "messages": messages}).status_code == 400
    assert httpx.post(f"{live.url}/tokenize", json={"prompt": "x"}).status_code == 401  # behind the key
