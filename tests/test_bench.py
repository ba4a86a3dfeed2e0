"""`flagdeploy bench` and `flagdeploy eval`: the metric maths on recorded timestamps, then every command
against our real server on loopback in front of the default model (tiny workloads: every token costs
CPU time), and the checks that refuse bad input before any load is sent."""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from test_server import NAMES, LiveServer, _free_port, _serve, serve_loaded

from flagdeploy.bench.ab import compare, format_ab
from flagdeploy.bench.baseline import Answer, compare_answers, split_text
from flagdeploy.bench.needle import build_haystack, parse_lengths
from flagdeploy.bench.prefix import server_counters
from flagdeploy.bench.report import atomic_write, format_speculative
from flagdeploy.bench.specdecode import SpecScrape, parse_spec, spec_stats
from flagdeploy.bench.stats import (
    RequestRecord,
    median_of_rounds,
    percentile,
    round_stats,
    tpot,
)
from flagdeploy.cli import main
from flagdeploy.engine.speculative import SpeculativeConfig

# ---- metric maths on recorded timestamps --------------------------------------------------------


def test_percentile_matches_numpy_linear() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_request_metrics_from_recorded_timestamps() -> None:
    # sent at t=10.0; output chunks at 10.5, 10.6, 10.8, 11.1; usage says 4 tokens
    r = RequestRecord(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], output_tokens=4, prompt_tokens=7)
    assert r.ok
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    # a chunk carrying two tokens: TPOT uses the usage count, ITL the chunk gaps
    two = RequestRecord(start=0.0, chunk_times=[1.0, 2.0], output_tokens=3)
    assert two.tpot == pytest.approx(0.5) and two.itl == pytest.approx([1.0])
    assert tpot(0.5, 0.5, 1) is None  # one token: no time per *output* token after the first
    assert not RequestRecord(start=0.0, error="HTTP 500").ok


def test_round_stats_and_median_excludes_warmup() -> None:
    def rnd(no: int, ttft: float, duration: float, errors: int = 0) -> object:
        recs = [RequestRecord(start=0.0, chunk_times=[ttft, ttft + 0.1, ttft + 0.2], output_tokens=3, prompt_tokens=5)
                for _ in range(4)]
        recs += [RequestRecord(start=0.0, error="boom") for _ in range(errors)]
        return round_stats(recs, concurrency=2, round_no=no, warmup=no == 0, duration_s=duration)

    warm = rnd(0, 9.0, 20.0)  # the compile stall: must not reach the summary
    rounds = [warm, rnd(1, 0.2, 2.0), rnd(2, 0.4, 4.0, errors=1), rnd(3, 0.3, 3.0)]
    r1 = rounds[1]
    assert (r1.completed, r1.errors, r1.output_tokens, r1.input_tokens) == (4, 0, 12, 20)
    assert r1.output_throughput == pytest.approx(6.0) and r1.request_throughput == pytest.approx(2.0)
    assert r1.ttft["p50"] == pytest.approx(0.2) and r1.itl["p99"] == pytest.approx(0.1)
    assert r1.tpot["mean"] == pytest.approx(0.1) and r1.e2e["p90"] == pytest.approx(0.4)
    s = median_of_rounds(rounds)
    assert s["rounds_used"] == [1, 2, 3] and not s["from_warmup"]
    assert s["ttft_p50"] == pytest.approx(0.3)  # median of 0.2, 0.4, 0.3 -- not the best, not the warm-up
    assert s["output_throughput"] == pytest.approx(4.0)  # median of 6, 3, 4
    assert s["errors"] == 1  # errors add up
    assert s["throughput_spread"] == pytest.approx(2.0)  # 6 vs 3 tokens/s
    only = median_of_rounds([warm])
    assert only["from_warmup"] and only["ttft_p50"] == pytest.approx(9.0)


def test_helpers() -> None:
    assert parse_lengths("4k, 32k,1000") == [4096, 32768, 1000]
    hay = build_haystack(3000, 50, "QBXT-4817", seed=1)
    at = hay.index("QBXT-4817") / len(hay)
    assert 0.4 < at < 0.6 and hay.count("secret code") == 1
    assert build_haystack(3000, 0, "QBXT-4817", seed=1).startswith("The secret code is QBXT-4817.")
    a = Answer("p", "x", ["a", "b", "c"], [-0.1, -0.2, -0.3], [{}] * 3)
    b = Answer("p", "y", ["a", "b", "d", "e"], [-0.1, -0.25, -0.5, -1.0], [{}] * 4)
    c = compare_answers(a, b)
    assert c.first_divergence == 2 and (c.baseline_token, c.current_token) == ("c", "d")
    assert c.agreement == pytest.approx(0.5) and c.drift_max == pytest.approx(0.05)
    same = compare_answers(a, a)
    assert same.first_divergence is None and same.agreement == 1.0 and same.drift_max == 0.0
    assert all(len(ch) <= 20 for ch in split_text("word " * 50, 20))
    counters = server_counters({"vllm:prefix_cache_hits_total": 5.0}, {"vllm:prefix_cache_hits_total": 37.0,
                                                                      "vllm:prefix_cache_queries_total": 40.0})
    assert counters.engine == "vllm" and counters.hit and counters.hit_tokens == 32
    assert server_counters({}, {"sglang:cache_hit_rate": 0.5}).hit
    assert not server_counters({}, {"other": 1.0}).hit


def test_atomic_write_leaves_no_temp(tmp_path) -> None:
    p = atomic_write(tmp_path / "d" / "x.csv", "a,b\n")
    assert p.read_text() == "a,b\n" and [f.name for f in p.parent.iterdir()] == ["x.csv"]


# ---- speculative decoding from /metrics: recorded vLLM and SGLang expositions -------------------

# vLLM v1 (prometheus_client Counters: `_total` samples, `_created` timestamps, model_name and engine
# labels; two data-parallel engines) before and after a run
VLLM_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 0.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7531e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
"""
VLLM_AFTER = (VLLM_BEFORE
              .replace('drafts_total{engine="0",model_name="m"} 10.0', 'drafts_total{engine="0",model_name="m"} 60.0')
              .replace('drafts_total{engine="1",model_name="m"} 0.0', 'drafts_total{engine="1",model_name="m"} 50.0')
              .replace("} 30.0", "} 330.0").replace("} 15.0", "} 215.0")
              .replace('position="0"} 8.0', 'position="0"} 88.0').replace('position="1"} 5.0', 'position="1"} 65.0')
              .replace('position="2"} 2.0', 'position="2"} 62.0'))
SGLANG = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m"} 2.9
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{model_name="m"} 0.633
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.0
"""


def test_acceptance_from_vllm_and_sglang_metrics() -> None:
    st = spec_stats(parse_spec(VLLM_BEFORE), parse_spec(VLLM_AFTER))
    assert (st.engine, st.source) == ("vllm", "counters")
    # deltas summed over both engines; the _created timestamp is not a count
    assert (st.drafts, st.draft_tokens, st.accepted_tokens) == (100.0, 300.0, 200.0)
    assert st.acceptance_length == pytest.approx(3.0)  # 1 + 200 / 100
    assert st.acceptance_rate == pytest.approx(200 / 300)
    assert st.per_position == pytest.approx([0.8, 0.6, 0.6])  # accepted at i / drafts
    assert "acceptance length 3.00" in st.describe() and "per position: 0.80 0.60 0.60" in st.describe()

    sg = spec_stats(parse_spec(""), parse_spec(SGLANG))  # gauges: the value after the run, no delta
    assert (sg.engine, sg.source, sg.acceptance_length, sg.acceptance_rate) == ("sglang", "gauges", 2.9, 0.633)
    assert sg.drafts is None and "SGLang" in sg.describe()

    # the counters appear after the first read (absent before: counted from zero)
    assert spec_stats(parse_spec(VLLM_BEFORE.split("# HELP vllm:spec_decode_num_draft_tokens")[0]),
                      parse_spec(VLLM_AFTER)).accepted_tokens == 215.0
    assert spec_stats(parse_spec(VLLM_AFTER), parse_spec(VLLM_BEFORE)) is None  # counters went down: restarted
    no_spec = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0.0\n"
    assert spec_stats(parse_spec(no_spec), parse_spec(no_spec)) is None  # nothing known: the rows are left out
    assert spec_stats(None, parse_spec(VLLM_AFTER)) is None  # no /metrics before the run
    with pytest.raises(ValueError):
        parse_spec("this is { not prometheus")

    # the report: a line per concurrency with a value, none for counters that did not move or no metrics
    still = spec_stats(parse_spec(VLLM_BEFORE), parse_spec(VLLM_BEFORE))
    assert still.drafts == 0 and still.acceptance_length is None and still.per_position is None
    lines = format_speculative([{"concurrency": 4, "speculative": st.to_dict()},
                                {"concurrency": 8, "speculative": still.to_dict()}, {"concurrency": 16}])
    assert len(lines) == 2 and lines[1].split()[0] == "4" and "acceptance length 3.00" in lines[1]
    assert format_speculative([{"concurrency": 1}]) == []


def test_ab_ratios_and_table() -> None:
    base = {"concurrency": 1, "ttft_mean": 0.1, "ttft_p99": 0.2, "tpot_mean": 0.02, "tpot_p99": 0.03,
            "output_throughput": 50.0, "request_throughput": 1.0, "e2e_p99": 1.5, "errors": 0, "from_warmup": False,
            "throughput_spread": 1.1}
    a = {**base, "speculative": {"engine": "vllm", "source": "counters", "drafts": 0.0, "acceptance_length": None,
                                 "acceptance_rate": None, "per_position": None}}
    b = {**base, "tpot_mean": 0.01, "output_throughput": 100.0, "errors": 2, "throughput_spread": 2.0,
         "speculative": {"engine": "vllm", "source": "counters", "drafts": 10.0, "acceptance_length": 2.5,
                         "acceptance_rate": 0.75, "per_position": [0.9, 0.6]}}
    ratios = compare([a], [b])
    assert ratios[0]["tpot_mean"] == pytest.approx(0.5) and ratios[0]["output_throughput"] == pytest.approx(2.0)
    assert ratios[0]["ttft_mean"] == pytest.approx(1.0) and ratios[0]["acceptance_length"] is None  # A has none
    assert "errors" not in ratios[0]
    table = format_ab({"label": "off", "base_url": "http://a", "model": "m", "summary": [a]},
                      {"label": "mtp", "base_url": "http://b", "model": "m", "summary": [b]}, [1])
    rows = {line[:26].strip(): line[26:].split() for line in table.splitlines() if line[:26].strip()}
    assert rows["concurrency 1"] == ["off", "(A)", "mtp", "(B)", "B/A"]
    assert rows["acceptance length"] == ["-", "2.50", "-"]
    assert rows["accepted at position 1"] == ["-", "60.0%", "-"]
    assert rows["TPOT mean (ms)"] == ["20.0", "10.0", "0.500x"]
    assert rows["output tokens/s"] == ["50.00", "100.0", "2.000x"]
    assert rows["errors"] == ["0", "2", "-"]
    assert "B: rounds differ 2.0x" in table and "A: the server's speculation counters did not move" in table
    plain = format_ab({"label": "A", "base_url": "http://a", "model": "m", "summary": [base]},
                      {"label": "B", "base_url": "http://b", "model": "m", "summary": []}, [1])
    assert "acceptance length" not in plain and "(B has no finished round at this concurrency)" in plain


# ---- against our server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live() -> LiveServer:
    from flagdeploy.engine import build_engine

    srv = serve_loaded(__import__("flagdeploy.server", fromlist=["create_app"]).create_app(
        lambda: build_engine(max_model_len=1024, kv_cache_memory=256 << 20), NAMES))
    yield srv
    srv.stop()


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
REPEAT = "one two three four five six seven eight. " * 6  # a prompt the n-gram proposer drafts well from


@pytest.fixture(scope="module")
def ngram(live: LiveServer) -> LiveServer:
    """A second server, `--speculative ngram`, on the model `live` already loaded (no second load: its own
    engine, runner and KV cache over the same weights; the tests use one server at a time)."""
    from dataclasses import replace

    from flagdeploy.engine import AsyncEngine, LLMEngine

    base = live.app.state.engine_slot.engine.engine
    engine = LLMEngine(base.model, base.tokenizer, replace(base.config, speculative=NGRAM))
    srv = serve_loaded(__import__("flagdeploy.server", fromlist=["create_app"]).create_app(
        lambda: AsyncEngine(engine), NAMES), "ngram engine")
    yield srv
    srv.stop()


def _cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _completions_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "flagdeploy:http_requests_total" and s.labels.get("route") in
               ("/v1/completions", "/v1/chat/completions"))


def test_bench_serve(live: LiveServer, tmp_path) -> None:
    out = tmp_path / "serve"
    rc, stdout, stderr = _cli("bench", "serve", "--base-url", f"{live.url}/v1", "--model", NAMES[0].upper(),
                              "--concurrency", "1,2", "--input-len", "16", "--output-len", "8", "--rounds", "2",
                              "--num-prompts", "2", "--vocab-size", "49152", "--output-dir", str(out), "--no-progress")
    assert rc == 0, stderr
    assert "warm-up rounds (not in the summary)" in stdout and "TTFT p50" in stdout
    for name in ("rounds.csv", "requests.csv", "summary.json", "throughput.png", "latency.png"):
        assert (out / name).stat().st_size > 0
    import matplotlib.image

    for png in ("throughput.png", "latency.png"):
        img = matplotlib.image.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    requests = list(csv.DictReader((out / "requests.csv").open()))
    assert len(requests) == 2 * 2 * 2  # concurrencies x rounds x prompts
    for r in requests:
        assert r["ok"] == "True" and not r["error"]
        assert int(r["prompt_tokens"]) == 16 and int(r["output_tokens"]) == 8  # the server's usage
        assert 1 <= int(r["chunks"]) <= 8
        assert 0 < float(r["ttft_s"]) <= float(r["e2e_s"])
        assert float(r["tpot_s"]) == pytest.approx((float(r["e2e_s"]) - float(r["ttft_s"])) / 7)
    rounds = list(csv.DictReader((out / "rounds.csv").open()))
    assert [(r["concurrency"], r["round"], r["warmup"]) for r in rounds] == [
        ("1", "0", "True"), ("1", "1", "False"), ("2", "0", "True"), ("2", "1", "False")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["config"]["model"] == NAMES[0]
    assert [w["round"] for w in summary["warmup"]] == [0, 0]
    for s in summary["summary"]:
        assert s["rounds_used"] == [1] and s["errors"] == 0 and s["completed"] == 2
        assert s["output_tokens"] == 16 and s["input_tokens"] == 32
        assert s["output_throughput"] > 0 and s["request_throughput"] > 0
        assert s["output_throughput"] == pytest.approx(8 * s["request_throughput"])
        for m in ("ttft", "tpot", "itl", "e2e"):
            assert 0 < s[f"{m}_p50"] <= s[f"{m}_p90"] <= s[f"{m}_p95"] <= s[f"{m}_p99"]
        assert s["ttft_p50"] <= s["e2e_p50"] and s["tpot_p50"] < s["e2e_p50"]
        # our server always exposes the speculation counters; with speculation off they do not move
        assert s["speculative"]["engine"] == "flagdeploy" and s["speculative"]["drafts"] == 0
        assert s["speculative"]["acceptance_length"] is None
    assert "speculative decoding" not in stdout  # no line for counters that did not move


def test_bench_prefix_cache(live: LiveServer, tmp_path) -> None:
    rc, stdout, stderr = _cli("bench", "prefix-cache", "--base-url", live.url, "--model", NAMES[0],
                              "--prompt-words", "200", "--repeats", "2", "--output", str(tmp_path / "p.json"))
    assert (tmp_path / "p.json").exists(), (rc, stdout, stderr)
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["prompt_tokens"] > 200
    assert res["server"]["engine"] == "flagdeploy" and res["server"]["hit"] and res["server"]["hit_tokens"] >= 2 * 16
    assert all(c and c >= 16 for c in res["cached_tokens"])  # usage.prompt_tokens_details agrees
    assert res["cold_ttft_s"] > max(res["warm_ttft_s"])
    assert rc == 0 and "evidence complete" in stdout, stdout + stderr


def test_bench_needle(live: LiveServer, tmp_path) -> None:
    rc, stdout, stderr = _cli("bench", "needle", "--base-url", live.url, "--model", NAMES[0], "--lengths", "256,2k",
                              "--depths", "90", "--output", str(tmp_path / "n.json"))
    assert rc == 0, stderr
    cells = json.loads((tmp_path / "n.json").read_text())["cells"]
    short, long = cells
    assert short["found"] is True, short  # the model copies the code back from a short context
    assert 200 < short["prompt_tokens"] < 320 and short["ttft_s"] > 0
    assert short["identifier"] in short["answer"]
    assert long["found"] is None and "max_model_len 1024" in long["error"]  # 2k does not fit: skipped, said so
    assert "found 1 of 1 cells run" in stdout


def test_eval_baseline_and_ppl(live: LiveServer, tmp_path) -> None:
    d = str(tmp_path / "baselines")
    common = ("--base-url", live.url, "--dir", d, "--limit", "2")
    rc, stdout, stderr = _cli("eval", "baseline", "save", "ref", *common, "--max-tokens", "6")
    assert rc == 0, stderr
    saved = json.loads((tmp_path / "baselines" / "ref.json").read_text())
    assert len(saved["answers"]) == 2 and all(len(a["tokens"]) == len(a["logprobs"]) > 0 for a in saved["answers"])
    assert all(len(t) == 5 for a in saved["answers"] for t in a["top_logprobs"])

    rc, stdout, stderr = _cli("eval", "baseline", "compare", "ref", *common, "--output", str(tmp_path / "same.json"))
    assert rc == 0, stdout + stderr
    assert "full agreement" in stdout
    same = json.loads((tmp_path / "same.json").read_text())
    assert same["full_agreement"] and same["agreement"] == 1.0
    assert all(p["first_divergence"] is None and p["drift_max"] < 0.05 for p in same["prompts"])

    rc, stdout, stderr = _cli("eval", "baseline", "compare", "ref", *common, "--temperature", "1.5", "--seed", "7",
                              "--output", str(tmp_path / "hot.json"))
    assert rc == 2, stdout + stderr
    assert "DIVERGED" in stdout
    hot = json.loads((tmp_path / "hot.json").read_text())
    assert not hot["full_agreement"] and hot["agreement"] < 1.0
    assert any(p["first_divergence"] is not None and p["baseline_token"] != p["current_token"] for p in hot["prompts"])

    rc, _, stderr = _cli("eval", "baseline", "compare", "nope", *common)
    assert rc == 1 and "no baseline 'nope'" in stderr and "ref" in stderr
    rc, _, stderr = _cli("eval", "baseline", "save", "ref", *common, "--max-tokens", "6")  # never replaced silently
    assert rc == 1 and "already saved" in stderr and "--overwrite" in stderr
    assert json.loads((tmp_path / "baselines" / "ref.json").read_text()) == saved

    text = tmp_path / "t.txt"
    text.write_text("The capital of France is Paris. The capital of Germany is Berlin. " * 4)
    rc, stdout, stderr = _cli("eval", "ppl", str(text), "--base-url", live.url, "--chunk-chars", "200")
    assert rc == 0, stderr
    ppl = float(stdout.split()[1])
    assert 1.0 < ppl < 1000 and math.isfinite(ppl) and "2 chunk(s)" in stdout


def test_bad_input_is_refused_before_load(live: LiveServer, tmp_path) -> None:
    before = _completions_served(live.url)
    port = _free_port()  # nothing listens there
    rc, _, stderr = _cli("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m")
    assert rc == 1 and f"cannot reach http://127.0.0.1:{port}/v1/models" in stderr
    rc, _, stderr = _cli("bench", "serve", "--base-url", live.url, "--model", "gpt-4o", "--concurrency", "4")
    assert rc == 1 and "does not serve model 'gpt-4o'" in stderr and NAMES[0] in stderr
    rc, _, stderr = _cli("bench", "serve", "--base-url", live.url, "--input-len", "1000", "--output-len", "100")
    assert rc == 1 and "max_model_len 1024" in stderr
    rc, _, stderr = _cli("bench", "needle", "--base-url", "localhost:8000")
    assert rc == 1 and "not an http(s) URL" in stderr
    assert _completions_served(live.url) == before  # no load was sent (the streaming check never ran)

    # an endpoint that answers JSON to `stream: true`
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "m", "object": "model"}]})
    app.post("/v1/completions")(lambda: {"choices": [{"text": "hi", "index": 0, "finish_reason": "length"}]})
    plain = _serve(app)
    try:
        rc, _, stderr = _cli("bench", "serve", "--base-url", plain.url, "--model", "m", "--output-dir",
                             str(tmp_path / "x"))
        assert rc == 1 and "does not stream" in stderr and "text/event-stream" in stderr
        assert not (tmp_path / "x").exists()
    finally:
        plain.stop()


def test_ctrl_c_keeps_what_was_measured(live: LiveServer, tmp_path) -> None:
    out = tmp_path / "interrupted"
    served = _completions_served(live.url)  # cumulative over the module: wait for 3 more
    proc = subprocess.Popen([sys.executable, "-m", "flagdeploy.cli", "bench", "serve", "--base-url", live.url,
                             "--concurrency", "1", "--input-len", "16", "--output-len", "16", "--rounds", "3",
                             "--num-prompts", "400", "--vocab-size", "49152", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell's background job (`cmd &`) starts with SIGINT ignored, and Python then never
                            # raises KeyboardInterrupt: give the bench the default, as a terminal would
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        # 3 x 400 requests cannot all finish before the interrupt, however slow or busy the machine
        deadline = time.monotonic() + 120
        while _completions_served(live.url) < served + 3 and time.monotonic() < deadline:  # a few requests have finished
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        # writing the outputs imports matplotlib and draws the plots: slow on a busy 2-core machine
        _, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted: keeping what was measured" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["rounds"][0]["interrupted"] is True and summary["rounds"][0]["completed"] >= 1
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert rows and all(r["ok"] == "True" for r in rows)
    assert (out / "throughput.png").exists()


def test_acceptance_from_our_exposition(ngram: LiveServer) -> None:
    """The parser on the real text of our server with `--speculative ngram`, against the engine's own counts."""
    r = httpx.post(f"{ngram.url}/v1/completions", json={"model": NAMES[0], "prompt": REPEAT, "max_tokens": 12,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{ngram.url}/metrics").text
    assert "flagdeploy:spec_decode_num_drafts_total " in text  # prometheus_client's counter naming
    stats = ngram.app.state.engine_slot.engine.engine.stats()
    st = spec_stats(SpecScrape(), parse_spec(text))
    assert st.engine == "flagdeploy" and st.drafts == stats["spec_decode_num_drafts"] > 0
    assert st.draft_tokens == stats["spec_decode_num_draft_tokens"]
    assert st.accepted_tokens == stats["spec_decode_num_accepted_tokens"]
    assert st.acceptance_length == pytest.approx(1 + st.accepted_tokens / st.drafts)
    assert st.per_position == pytest.approx([n / st.drafts for n in stats["spec_decode_num_accepted_tokens_per_pos"]])
    assert len(st.per_position) == NGRAM.num_speculative_tokens


def _printed_range(figure: str) -> tuple[float, float]:
    """The values a figure printed with its digits may stand for: +- half its last digit."""
    half = 0.5 * 10.0 ** -len(figure.partition(".")[2])
    return float(figure) - half, float(figure) + half


def test_bench_ab(live: LiveServer, ngram: LiveServer, tmp_path) -> None:
    data = tmp_path / "repeat.jsonl"
    data.write_text(json.dumps({"prompt": REPEAT}) + "\n" + json.dumps({"prompt": "Count: 1, 2, 3, 1, 2, 3, 1, 2,"}) + "\n")
    out = tmp_path / "ab" / "ab.json"
    rc, stdout, stderr = _cli("bench", "ab", "--a", live.url, "--b", f"{ngram.url}/v1", "--label-a", "off",
                              "--label-b", "ngram", "--model", NAMES[0], "--dataset", str(data), "--concurrency", "1",
                              "--output-len", "16", "--rounds", "2", "--num-prompts", "1", "--no-progress",
                              "--output", str(out))
    assert rc == 0, stderr
    print(stdout)
    rows = {line[:26].strip(): line[26:].split() for line in stdout.splitlines() if line[:26].strip()}
    assert rows["concurrency 1"] == ["off", "(A)", "ngram", "(B)", "B/A"]
    for label in ("TTFT mean (ms)", "TTFT P99 (ms)", "TPOT mean (ms)", "TPOT P99 (ms)", "output tokens/s",
                  "requests/s", "E2E P99 (ms)"):
        a, b, r = rows[label]
        # the ratio is of the unrounded figures: B/A of the printed ones within their rounding (half their last
        # digit; a TPOT of ~2 ms printed as 2.2 is 2% off by itself)
        ra, rb = _printed_range(a), _printed_range(b)
        assert rb[0] / ra[1] - 0.0005 <= float(r.removesuffix("x")) <= rb[1] / ra[0] + 0.0005, label
    doc = json.loads(out.read_text())
    assert [f.name for f in out.parent.iterdir()] == ["ab.json"]  # renamed into place, no temp left
    (sa,), (sb,) = doc["a"]["summary"], doc["b"]["summary"]
    assert (doc["a"]["label"], doc["b"]["label"], doc["interrupted"]) == ("off", "ngram", False)
    assert doc["a"]["base_url"] == live.url and doc["b"]["base_url"] == ngram.url
    # the same load on both: the same prompts (same token counts) and fixed output lengths
    assert sa["input_tokens"] == sb["input_tokens"] > 0 and sa["output_tokens"] == sb["output_tokens"] == 16
    assert sa["errors"] == sb["errors"] == 0
    assert sa["speculative"]["drafts"] == 0 and sa["speculative"]["acceptance_length"] is None
    spec = sb["speculative"]
    assert spec["engine"] == "flagdeploy" and spec["drafts"] > 0
    assert spec["acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    assert len(spec["per_position"]) == NGRAM.num_speculative_tokens
    assert rows["acceptance length"] == ["-", f"{spec['acceptance_length']:.2f}", "-"]
    (ratios,) = doc["ratios"]
    assert ratios["output_throughput"] == pytest.approx(sb["output_throughput"] / sa["output_throughput"])
    assert ratios["tpot_p99"] == pytest.approx(sb["tpot_p99"] / sa["tpot_p99"])


def test_bench_ab_checks_both_before_load(live: LiveServer) -> None:
    before = _completions_served(live.url)
    port = _free_port()
    rc, _, stderr = _cli("bench", "ab", "--a", live.url, "--b", f"http://127.0.0.1:{port}", "--model", NAMES[0])
    assert rc == 1 and f"endpoint B: cannot reach http://127.0.0.1:{port}/v1/models" in stderr
    rc, _, stderr = _cli("bench", "ab", "--a", live.url, "--b", live.url, "--model-b", "gpt-4o")
    assert rc == 1 and "endpoint B: the server at" in stderr and "'gpt-4o'" in stderr
    assert _completions_served(live.url) == before  # A got no load
