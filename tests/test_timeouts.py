"""--request-timeout: a request that runs past it is stopped with a 408 in its protocol's shape, and its
engine requests are aborted (the engine is idle afterwards, not still generating for nobody)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_metrics import TINY
from test_server import _serve, _wait_ready

from flagdeploy.loaders.tiny_checkpoint import write_word_tokenizer
from flagdeploy.server import create_app

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 120, "ignore_eos": True}


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
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

    srv = _serve(create_app(load, ["tiny"], request_timeout=0.001))
    assert _wait_ready(srv.url, timeout=60).status_code == 200
    yield srv, engines[0]
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
