"""--request-timeout: a request that runs past it is stopped with a 408 in its protocol's shape, and its
engine requests are aborted (the engine is idle afterwards, not still generating for nobody)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_metrics import TINY
from test_server import _serve, _wait_ready

from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer
from flagdeploy.server import create_app

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 120, "ignore_eos": True}


def _server(tmp_path_factory, request_timeout: float):
    from flagdeploy.engine import build_engine

    root = tmp_path_factory.mktemp("tiny-model")
    (root / "config.json").write_text(json.dumps(TINY))
    write_word_tokenizer(root, TINY["vocab_size"])
    engines = []

    def load():
        engine = build_engine(str(root), chip="cpu", load_format="dummy", max_model_len=128, max_num_seqs=4,
                              kv_cache_memory=1 << 20)
        # every step at least 50 ms: the 1 ms limit passes before the first token on any host (the tiny
        # model's first step took under 1 ms on a fast one, and the stream had started when the limit hit)
        step = engine.engine.step
        engine.engine.step = lambda: (time.sleep(0.05), step())[1]
        engines.append(engine)
        return engine

    srv = _serve(create_app(load, ["tiny"], request_timeout=request_timeout))
    assert _wait_ready(srv.url, timeout=60).status_code == 200
    return srv, engines[0]


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    srv, engine = _server(tmp_path_factory, 0.001)
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def mid_stream(tmp_path_factory):
    """A limit that passes after the first tokens went out (steps take 50 ms, 120 tokens are asked for)."""
    srv, engine = _server(tmp_path_factory, 0.5)
    yield srv, engine
    srv.stop()


def _idle(engine) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False


def test_timeouts_answer_408_and_free_the_engine(impatient):
    srv, engine = impatient
    for body in (LONG, {**LONG, "stream": True}):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 408, r.text
        assert r.json()["error"]["code"] == "request_timeout"
    r = httpx.post(f"{srv.url}/v1/messages", json={**LONG, "max_tokens": 120}, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
    assert _idle(engine)


def test_a_stream_cut_by_the_limit_still_ends_as_its_protocol_ends(mid_stream):
    """After the 200 the limit is an error event, and then the stream's own end: `[DONE]` on the OpenAI
    routes (clients that wait for it would wait forever), `response.failed` on /v1/responses."""
    srv, engine = mid_stream
    for route, body in (("/v1/chat/completions", {**LONG, "stream": True}),
                        ("/v1/completions", {"model": "tiny", "prompt": "w5 w6", "max_tokens": 120, "ignore_eos": True,
                                             "stream": True})):
        r = httpx.post(f"{srv.url}{route}", json=body, timeout=30)
        events = [e for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and len(events) > 2, r.text
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
        assert events[-1] == "data: [DONE]"
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": "tiny", "input": "w5 w6", "max_output_tokens": 120,
                                                     "stream": True}, timeout=30)
    kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    failed = json.loads(r.text.strip().splitlines()[-1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "request_timeout"
    assert _idle(engine)
