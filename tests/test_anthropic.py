"""The Anthropic Messages API, driven by the real `anthropic` SDK (and raw httpx where the SDK would
hide the wire) against a real uvicorn on loopback, in front of the real engine on the default model.

The server is test_server's (same fixture, same API key); outputs are kept to a few tokens.
"""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import pytest
import test_server
from test_server import API_KEY, NAMES, LiveServer, _serve, _wait_ready

from flagdeploy.server import create_app

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HELLO = [{"role": "user", "content": "Say hello."}]

live, http = test_server.live, test_server.http  # the fixtures: its loaded server, an httpx client with the key


@pytest.fixture(scope="module")
def claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0, timeout=60)


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event, as framed on the wire."""
    out = []
    for frame in response.text.split("\n\n"):
        if not frame.strip():
            continue
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_create_greedy_capital_of_france(claude: anthropic.Anthropic) -> None:
    # This SDK has no sampling parameters any more; Claude Code still sends `temperature`.
    r = claude.messages.create(model=NAMES[0], max_tokens=24, messages=FRANCE,
                               extra_body={"temperature": 0, "top_k": 1, "top_p": 1})
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == NAMES[0]
    assert [b.type for b in r.content] == ["text"]
    assert "Paris" in r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24


def test_max_tokens_stop_reason(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=NAMES[0], max_tokens=2, messages=FRANCE)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_stream_text_equals_final(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=NAMES[0], max_tokens=12, messages=FRANCE) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_stream_wire_framing(http: httpx.Client) -> None:
    """`event:` on every frame, and exactly one message_start / message_delta / message_stop (Claude
    Code aborts on duplicates); `?beta=true` and any anthropic-* header values are accepted."""
    r = http.post("/v1/messages?beta=true", json={"model": NAMES[0], "max_tokens": 6, "stream": True,
                                                   "messages": HELLO},
                  headers={"anthropic-version": "2099-01-01", "anthropic-beta": "claude-code-20250219,whatever"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    kinds = [k for k, _ in events]
    assert all(k == data["type"] for k, data in events)
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert {kinds.count(k) for k in ("message_start", "message_delta", "message_stop")} == {1}
    assert set(kinds[3:-3]) == {"content_block_delta"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] > 0
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0


def test_system_blocks_and_system_role_in_messages(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    system = [{"type": "text", "text": "You are a pirate.", "cache_control": {"type": "ephemeral"}}]
    r = claude.messages.create(model=NAMES[0], max_tokens=4, system=system, messages=HELLO,
                               metadata={"user_id": "u1"}, tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert r.content[0].text
    # Claude Code >= 2.1.154: role "system" inside messages, merged into the system prompt; its
    # history carries thinking, tool_use and tool_result blocks, which must render, not fail.
    body = {"model": NAMES[0], "max_tokens": 4, "thinking": {"type": "adaptive"}, "context_management": {},
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is 6 times 7?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                             {"type": "tool_use", "id": "toolu_1", "name": "mul", "input": {"a": 6, "b": 7}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "text", "text": "42"}]}]}]}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    merged = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    top_level = dict(body, system="Be brief.", messages=body["messages"][1:])
    assert http.post("/v1/messages/count_tokens", json=top_level).json()["input_tokens"] == merged


def test_stop_sequences(claude: anthropic.Anthropic) -> None:
    free = claude.messages.create(model=NAMES[0], max_tokens=24, messages=FRANCE).content[0].text
    word = free.split()[2]  # a word the greedy answer reaches
    r = claude.messages.create(model=NAMES[0], max_tokens=24, messages=FRANCE, stop_sequences=["zzz", word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert word not in r.content[0].text and free.startswith(r.content[0].text)
    with claude.messages.stream(model=NAMES[0], max_tokens=24, messages=FRANCE, stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == r.content[0].text


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    """The templated prompt's length: what generation then reports as input_tokens."""
    short = claude.messages.count_tokens(model=NAMES[0], messages=HELLO, system="Be terse.").input_tokens
    longer = claude.messages.count_tokens(model=NAMES[0], messages=HELLO, system="Be terse. " * 10).input_tokens
    assert 0 < short < longer
    r = claude.messages.create(model=NAMES[0], max_tokens=1, messages=HELLO, system="Be terse.")
    assert r.usage.input_tokens == short


def test_context_suffix_and_case(claude: anthropic.Anthropic) -> None:
    """Claude Code's `[1m]` marker (repeats too) is stripped, the name matched case-insensitively,
    and the bare name echoed, as Anthropic does."""
    r = claude.messages.create(model="SmolLM2-135M-Instruct[1m]", max_tokens=2, messages=HELLO)
    assert r.model == "SmolLM2-135M-Instruct"
    assert claude.messages.count_tokens(model="smollm2[1M][1m]", messages=HELLO).input_tokens > 0


def test_auth_x_api_key_or_bearer(live: LiveServer) -> None:
    body = {"model": NAMES[0], "max_tokens": 1, "messages": HELLO}
    bearer = anthropic.Anthropic(base_url=live.url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(**body).content is not None
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{live.url}/v1/messages", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", json.dumps({"model": NAMES[0]}).encode(),
                                  json.dumps({"model": NAMES[0], "messages": "hi"}).encode(),
                                  json.dumps({"model": NAMES[0], "messages": HELLO, "max_tokens": 0}).encode()])
def test_malformed_body_is_400_never_422(http: httpx.Client, body: bytes) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_not_found(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="glm-5.3-flash[1m]", max_tokens=1, messages=HELLO)
    assert info.value.body["error"]["type"] == "not_found_error"
    assert "glm-5.3-flash" in info.value.body["error"]["message"]


def test_models_carry_anthropic_fields(claude: anthropic.Anthropic) -> None:
    models = claude.models.list()
    assert [m.id for m in models.data] == NAMES
    assert all(m.type == "model" and m.display_name and m.created_at for m in models.data)
    assert models.first_id == NAMES[0] and models.last_id == NAMES[-1] and models.has_more is False


def test_loading_and_failed_load_in_anthropic_shape() -> None:
    """503 while loading is a retryable overloaded_error with Retry-After; a failed load, api_error."""
    go = threading.Event()

    def load_engine():
        go.wait(10)
        raise RuntimeError("weights file is truncated")

    srv = _serve(create_app(load_engine, NAMES))
    try:
        body = {"model": NAMES[0], "max_tokens": 1, "messages": HELLO}
        r = httpx.post(f"{srv.url}/v1/messages", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "overloaded_error"
        go.set()
        assert _wait_ready(srv.url, timeout=10).status_code == 503
        r = httpx.post(f"{srv.url}/v1/messages", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
        assert "weights file is truncated" in r.json()["error"]["message"]
    finally:
        go.set()
        srv.stop()
