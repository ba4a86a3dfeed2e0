"""/metrics in the Prometheus text format, against a real uvicorn in front of the real engine on a
tiny random-weight model (config.json + word tokenizer, `load_format="dummy"`): cheap enough to
check exact counts."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import LiveServer, _serve, _wait_ready, serve_loaded

from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer
from flagdeploy.server import create_app

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": True}
NAME = "tiny"
CHAT = [{"role": "user", "content": "w5 w6 w7 w8"}]
# What Prometheus 2.x asks for: the answer must stay the classic text format, colons intact.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;"
                     "q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> LiveServer:
    from flagdeploy.engine import build_engine

    root = tmp_path_factory.mktemp("tiny-model")
    (root / "config.json").write_text(json.dumps(TINY))
    write_word_tokenizer(root, TINY["vocab_size"])
    srv = serve_loaded(create_app(lambda: build_engine(str(root), chip="cpu", load_format="dummy", max_model_len=128,
                                                       max_num_seqs=4, kv_cache_memory=1 << 20), [NAME]), timeout=60)
    yield srv
    srv.stop()


def _scrape(url: str) -> dict[str, list]:
    """Family name -> its samples."""
    r = httpx.get(f"{url}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family.samples for family in text_string_to_metric_families(r.text)}


def _value(samples: list, name: str, **labels: str) -> float:
    hits = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples)
    return hits[0]


def _sse_usage(text: str) -> dict:
    """The usage of the last chunk that carries one."""
    usage = None
    for frame in text.split("\n\n"):
        data = frame.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            usage = json.loads(data).get("usage") or usage
    assert usage is not None
    return usage


def test_metrics_after_real_requests(tiny_server: LiveServer) -> None:
    url = tiny_server.url
    before = _scrape(url)
    assert _value(before["flagdeploy:model_ready"], "flagdeploy:model_ready") == 1
    assert _value(before["flagdeploy:generation_tokens"], "flagdeploy:generation_tokens_total") == 0

    # one non-streamed chat, one streamed completion with usage
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": NAME, "messages": CHAT, "max_tokens": 5, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    stream = httpx.post(f"{url}/v1/completions", timeout=60,
                        json={"model": NAME, "prompt": "w9 w10 w11", "max_tokens": 4, "ignore_eos": True,
                              "stream": True, "stream_options": {"include_usage": True}})
    assert stream.status_code == 200, stream.text
    usages = [chat.json()["usage"], _sse_usage(stream.text)]
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert completion_tokens == 9
    # one bad body (400), one unknown model (404), one unknown path (404, no route)
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": "not a list"})
    assert bad.status_code == 400
    unknown = httpx.post(f"{url}/v1/chat/completions", json={"model": "no-such-model", "messages": CHAT})
    assert unknown.status_code == 404
    assert httpx.get(f"{url}/v1/no-such-route/123").status_code == 404

    m = _scrape(url)

    # HTTP requests: per route template and status (the /metrics scrapes count too, after they answer)
    by_route: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in m["flagdeploy:http_requests"]:
        if s.name == "flagdeploy:http_requests_total":
            by_route[s.labels["route"]][s.labels["status"]] += s.value
    assert dict(by_route["/v1/chat/completions"]) == {"200": 1, "400": 1, "404": 1}
    assert dict(by_route["/v1/completions"]) == {"200": 1}
    assert dict(by_route["unmatched"]) == {"404": 1}
    assert by_route["/metrics"]["200"] == 1  # the first scrape
    assert by_route["/ready"]["200"] >= 1
    assert not any("no-such-route" in route for route in by_route)  # raw paths never become labels

    # per-request histograms: one observation per generation request
    assert _value(m["flagdeploy:time_to_first_token_seconds"], "flagdeploy:time_to_first_token_seconds_count") == 2
    assert _value(m["flagdeploy:e2e_request_latency_seconds"], "flagdeploy:e2e_request_latency_seconds_count") == 2
    assert _value(m["flagdeploy:request_queue_time_seconds"], "flagdeploy:request_queue_time_seconds_count") == 2
    tpot = m["flagdeploy:time_per_output_token_seconds"]
    assert _value(tpot, "flagdeploy:time_per_output_token_seconds_count") == completion_tokens - 2
    assert _value(tpot, "flagdeploy:time_per_output_token_seconds_sum") > 0
    gen_len = m["flagdeploy:request_generation_tokens"]
    assert _value(gen_len, "flagdeploy:request_generation_tokens_count") == 2
    assert _value(gen_len, "flagdeploy:request_generation_tokens_sum") == completion_tokens
    assert _value(gen_len, "flagdeploy:request_generation_tokens_bucket", le="5.0") == 2
    assert _value(m["flagdeploy:request_prompt_tokens"], "flagdeploy:request_prompt_tokens_sum") == sum(
        u["prompt_tokens"] for u in usages)
    assert _value(m["flagdeploy:request_success"], "flagdeploy:request_success_total", finished_reason="length") == 2

    # engine counters
    assert _value(m["flagdeploy:generation_tokens"], "flagdeploy:generation_tokens_total") == completion_tokens
    assert _value(m["flagdeploy:prompt_tokens"], "flagdeploy:prompt_tokens_total") == sum(
        u["prompt_tokens"] for u in usages)
    queries = _value(m["flagdeploy:prefix_cache_queries"], "flagdeploy:prefix_cache_queries_total")
    hits = _value(m["flagdeploy:prefix_cache_hits"], "flagdeploy:prefix_cache_hits_total")
    assert 0 <= hits <= queries and queries > 0
    assert 0 <= _value(m["flagdeploy:prefix_cache_hit_rate"], "flagdeploy:prefix_cache_hit_rate") <= 1
    assert _value(m["flagdeploy:num_preemptions"], "flagdeploy:num_preemptions_total") == 0
    # the engine's own time: inside the two (sequential) requests' lifetimes, so at most their latencies
    step_s = _value(m["flagdeploy:engine_step_seconds"], "flagdeploy:engine_step_seconds_total")
    e2e_s = _value(m["flagdeploy:e2e_request_latency_seconds"], "flagdeploy:e2e_request_latency_seconds_sum")
    assert 0 < step_s <= e2e_s

    # gauges at rest
    assert _value(m["flagdeploy:num_requests_running"], "flagdeploy:num_requests_running") == 0
    assert _value(m["flagdeploy:num_requests_waiting"], "flagdeploy:num_requests_waiting") == 0
    assert 0 <= _value(m["flagdeploy:kv_cache_usage_perc"], "flagdeploy:kv_cache_usage_perc") <= 1
    free = _value(m["flagdeploy:kv_cache_blocks_free"], "flagdeploy:kv_cache_blocks_free")
    total = _value(m["flagdeploy:kv_cache_blocks_total"], "flagdeploy:kv_cache_blocks_total")
    assert 0 <= free <= total and total > 0


def test_metrics_without_a_loaded_model() -> None:
    """A failed load: /metrics still answers, model_ready 0 and no engine metrics; each app has its
    own registry, so creating apps side by side never collides."""

    def load_engine():
        raise RuntimeError("weights file is truncated")

    apps = [create_app(load_engine, [NAME]) for _ in range(2)]
    assert apps[0].state.metrics.registry is not apps[1].state.metrics.registry
    srv = _serve(apps[0])
    try:
        assert _wait_ready(srv.url, timeout=10).status_code == 503
        m = _scrape(srv.url)
        assert _value(m["flagdeploy:model_ready"], "flagdeploy:model_ready") == 0
        assert "flagdeploy:num_requests_running" not in m
        assert "flagdeploy:time_to_first_token_seconds" in m  # defined, no observations yet
    finally:
        srv.stop()
