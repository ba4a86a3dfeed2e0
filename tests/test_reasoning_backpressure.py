"""Reasoning split (`--reasoning-parser`), chat_template_kwargs, and backpressure (`--max-waiting`).

The parser is tested on its own on awkward splits. The reasoning wire shapes go through a real
server and the real SDKs, but over a scripted engine (SmolLM2 does not think): `create_app` takes
any engine, so a fake one that replays fixed deltas shows exactly where each piece lands.
Backpressure needs the real engine's queue: one slot, no waiting room, one long request running.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner
from test_server import API_KEY, LiveServer, _serve, _wait_ready, serve_loaded

from flagdeploy.engine.request import RequestOutput
from flagdeploy.server import create_app
from flagdeploy.server.reasoning import REASONING_PARSERS, ReasoningParser, prompt_opens_reasoning, split

THINK = REASONING_PARSERS["think"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---- the parser ----------------------------------------------------------------------------------


def _feed(pieces: list[str], started: bool = False) -> tuple[list[str], list[str]]:
    parser = ReasoningParser(THINK, started)
    thoughts, contents = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        thoughts.append(r)
        contents.append(c)
    r, c = parser.finish()
    return thoughts + [r], contents + [c]


@pytest.mark.parametrize("text, started, expected", [
    ("<think>plan</think>\n\nanswer", False, ("plan", "answer")),
    ("  \n<think>plan</think>answer", False, ("plan", "answer")),
    ("plan</think>\n\nanswer", True, ("plan", "answer")),       # the template opened <think>
    ("<think>still thinking", False, ("still thinking", "")),  # budget ran out mid-thought
    ("still thinking", True, ("still thinking", "")),
    ("plain answer", False, (None, "plain answer")),
    ("a <think> later is content", False, (None, "a <think> later is content")),
    ("<thin", False, (None, "<thin")),                         # a start tag never completed
    ("<think></think>answer", False, ("", "answer")),
])
def test_split_whole_and_every_two_piece_split(text: str, started: bool, expected: tuple) -> None:
    assert split(text, THINK, started) == expected
    want_r, want_c = expected[0] or "", expected[1]
    for cut in range(len(text) + 1):  # every place a delta boundary can fall, tags included
        thoughts, contents = _feed([text[:cut], text[cut:]], started)
        assert ("".join(thoughts), "".join(contents)) == (want_r, want_c), cut


def test_char_by_char_never_leaks_a_tag() -> None:
    text = "<think>a < b, c </ d</think>\n\nx <y> </z>"
    thoughts, contents = _feed(list(text))
    assert "".join(thoughts) == "a < b, c </ d"
    assert "".join(contents) == "x <y> </z>"
    assert not any("<think" in t or "</think" in t for t in thoughts + contents)


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)  # thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", THINK)


def test_serve_help_documents_the_options() -> None:
    from flagdeploy.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--reasoning-parser" in out and "--max-waiting" in out and "429" in out and "529" in out


# ---- reasoning on the wire, over a scripted engine -----------------------------------------------


class ScriptedTokenizer:
    """Renders a Qwen3-like template: it opens <think> unless enable_thinking is False."""

    max_token_chars = 1

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        self.kwargs.append(kwargs)
        opened = "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "<think>\n"
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>" + opened

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Replays `deltas` as the output of every request."""

    max_model_len = 4096
    input_modalities = frozenset({"text"})

    def __init__(self, deltas: list[str]) -> None:
        self.deltas = deltas
        self.tokenizer = ScriptedTokenizer()

    async def generate(self, prompt_ids, params, request_id):
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield RequestOutput(request_id, text, [1], last, "stop" if last else None, len(prompt_ids), i + 1)

    def abort(self, request_id: str) -> None:
        pass

    def check_params(self, params) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


# The template opened <think>, so the output has only the end tag, split over deltas.
DELTAS = ["Let me", " think </", "thi", "nk>", "\n\n", "Paris", "."]


@pytest.fixture(scope="module")
def scripted() -> LiveServer:
    engine = ScriptedEngine(DELTAS)
    srv = _serve(create_app(lambda: engine, ["thinker"], api_key=API_KEY, reasoning_parser="think"))
    assert _wait_ready(srv.url).status_code == 200
    srv.observed["engine"] = engine
    yield srv
    srv.stop()


def test_openai_reasoning_content(scripted: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key=API_KEY, max_retries=0)
    msg = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "Capital?"}]).choices[0].message
    assert msg.content == "Paris."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "Let me think "

    thoughts, contents = [], []
    for chunk in client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "Capital?"}],
                                                stream=True):
        for choice in chunk.choices:
            thoughts.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            contents.append(choice.delta.content or "")
    assert "".join(thoughts) == "Let me think " and "".join(contents) == "Paris."
    assert not any("think>" in piece or "</" in piece for piece in thoughts + contents)


def test_anthropic_thinking_block(scripted: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=scripted.url, api_key=API_KEY, max_retries=0)
    msg = claude.messages.create(model="thinker", max_tokens=64, messages=[{"role": "user", "content": "Capital?"}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think " and msg.content[0].signature
    assert msg.content[1].text == "Paris."

    with claude.messages.stream(model="thinker", max_tokens=64, messages=[{"role": "user", "content": "Capital?"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me think " and final.content[0].signature == msg.content[0].signature
    assert final.content[1].text == "Paris."


def test_anthropic_stream_block_order(scripted: LiveServer) -> None:
    body = {"model": "thinker", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "Capital?"}]}
    r = httpx.post(f"{scripted.url}/v1/messages", headers=AUTH, json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
             for e in events if e["type"].startswith("content_block")]
    assert shape[0] == ("content_block_start", 0, "thinking")
    assert shape.index(("content_block_delta", 0, "signature_delta")) < shape.index(("content_block_stop", 0, None))
    assert shape[shape.index(("content_block_stop", 0, None)) + 1] == ("content_block_start", 1, "text")
    assert shape[-1] == ("content_block_stop", 1, None)
    assert {s[2] for s in shape if s[0] == "content_block_delta" and s[1] == 0} == {"thinking_delta", "signature_delta"}


def test_template_kwargs_reach_the_template(scripted: LiveServer) -> None:
    seen = scripted.observed["engine"].tokenizer.kwargs
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "Hi"}],
                                       reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False, "clear_thinking": True,
                                                                            "add_generation_prompt": False}})
    assert seen[-1] == {"enable_thinking": False, "reasoning_effort": "low", "clear_thinking": True}  # passed as given
    # Thinking off: the prompt closes the section, so the replayed output has no start tag and is all content.
    assert r.choices[0].message.content == "".join(DELTAS) and "reasoning_content" not in r.choices[0].message.model_extra

    httpx.post(f"{scripted.url}/v1/chat/completions", headers=AUTH,
               json={"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}})
    assert seen[-1] == {"enable_thinking": False, "thinking": False}
    httpx.post(f"{scripted.url}/v1/messages", headers=AUTH,
               json={"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                     "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert seen[-1] == {"enable_thinking": True, "thinking": True}


# ---- backpressure, on the real engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def busy_server() -> LiveServer:
    """One sequence slot and no waiting room: while one request runs, any other is refused."""
    from flagdeploy.engine import build_engine

    app = create_app(lambda: build_engine(max_model_len=512, max_num_seqs=1, kv_cache_memory=64 << 20),
                     ["smollm2"], api_key=API_KEY, max_waiting=0)
    srv = serve_loaded(app)
    yield srv
    srv.stop()


def test_backpressure_429_and_529_with_retry_after(busy_server: LiveServer) -> None:
    url = busy_server.url
    running = threading.Event()
    long_result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=300) as r:
            long_result["status"] = r.status_code
            for i, _ in enumerate(r.iter_lines()):
                if i == 2:
                    running.set()  # it holds the only slot now
            long_result["done"] = True
        running.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        assert running.wait(120)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
            # Fired together: all are refused at once, none is queued.
            refused = [http.post("/v1/chat/completions", json=chat), http.post("/v1/completions", json={"prompt": "Hi"}),
                       http.post("/v1/messages", json={**chat, "stream": True}),
                       http.post("/v1/messages", json=chat)]
            assert worker.is_alive(), "the long request ended before the burst: nothing was tested"
        for r in refused[:2]:
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        for r in refused[2:]:
            assert r.status_code == 529, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json() == {"type": "error", "error": {"type": "overloaded_error", "message": r.json()["error"]["message"]}}
        # The SDKs see their overload errors (retries off: retrying is what Retry-After is for).
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
                model="smollm2", messages=chat["messages"], max_tokens=4)
        with pytest.raises(anthropic.APIStatusError) as exc:
            anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0).messages.create(
                model="smollm2", max_tokens=4, messages=chat["messages"])
        assert exc.value.status_code == 529
    finally:
        worker.join(300)
    assert long_result == {"status": 200, "done": True}
    # The slot is free again: a request is served normally.
    ok = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "Hi"}],
                                                                       "max_tokens": 2})
    assert ok.status_code == 200
