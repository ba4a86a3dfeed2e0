"""Data-parallel replicas of the builtin engine (`flagdeploy serve --dp K`, flagdeploy/gateway/replicas.py).

The unit tests check each replica's launch (argv carrying the serve options, its slice of the devices
on a CUDA-like backend, nothing device-related on the CPU) and the serve.yaml rules. The live test runs
the real command with two replicas of the default SmolLM2-135M GGUF on the CPU, drives it with the
`openai` SDK concurrently, compares every greedy answer with the one replica served in-process, checks
that both replicas served, and that stopping the server stops the replicas.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from test_cli import _free_port
from test_cli import _serve as _serve_cli
from test_cli import wait_ready

from flagdeploy.assemble import ServeOptions
from flagdeploy.gateway import ConfigError, build_gateway, parse_config
from flagdeploy.gateway.launch import launch_plan
from flagdeploy.gateway.replicas import merge_expositions, replica_env

SMALL = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]
CUDA_LIKE = SimpleNamespace(name="cuda", device_type="cuda", visible_devices_env="CUDA_VISIBLE_DEVICES")
CPU = SimpleNamespace(name="cpu", device_type="cpu", visible_devices_env=None)
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def _entry(dp: int = 2, **options):
    options = {"max_model_len": 512, "kv_cache_memory": "64MiB", "max_num_seqs": 4, "tp": 2, "ep": 1,
               "reasoning_parser": "none", "request_timeout": None} | options
    options = ServeOptions.from_args(options, chip="cpu", served_names=("tiny", "Tiny2"))
    cfg = parse_config({"api_key": "sk-x", "models": [options.replicas_entry(dp)]})
    return cfg.models[0]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_launch_plan_argv_and_devices(default_model):
    entry = _entry()
    assert entry.engine == "builtin" and entry.replicas == 2 and entry.names == ["tiny", "Tiny2"]
    plans = [launch_plan(entry, 9100 + i, i) for i in range(2)]  # this host: the cpu backend
    argv = plans[0].argv
    assert argv[:4] == [sys.executable, "-m", "flagdeploy", "serve"]
    assert _flag(argv, "--model") == str(default_model.path) and _flag(argv, "--host") == "127.0.0.1"
    assert [_flag(p.argv, "--port") for p in plans] == ["9100", "9101"]
    assert _flag(argv, "--max-model-len") == "512" and _flag(argv, "--kv-cache-memory") == str(64 << 20)
    assert _flag(argv, "--max-num-seqs") == "4" and _flag(argv, "--tp") == "2" and _flag(argv, "--ep") == "1"
    assert _flag(argv, "--chip") == "cpu" and _flag(argv, "--dp") == "1"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--served-model-name"] == ["tiny", "Tiny2"]
    assert "--api-key" not in argv and "--request-timeout" not in argv  # the gateway checks the key
    assert "--compile" not in argv and "--no-compile" not in argv  # unset: the replica's default
    assert "--limit-mm-per-prompt" not in argv and "--allowed-media-domains" not in argv
    media = {"limit_mm_per_prompt": {"image": 2, "video": 0}, "allowed_media_domains": ["images.example.com"]}
    cfg = parse_config({"models": [ServeOptions(chip="cpu").replicas_entry(2) | media]})
    with_media = launch_plan(cfg.models[0], 9100, 0).argv  # each replica applies the policy it fetches under
    assert _flag(with_media, "--limit-mm-per-prompt") == "image=2,video=0"
    assert _flag(with_media, "--allowed-media-domains") == "images.example.com"
    switched = [launch_plan(_entry(compile=on), 9100, 0).argv for on in (True, False)]
    assert "--compile" in switched[0] and "--no-compile" in switched[1]  # switches, not "--compile True"
    for plan in plans:  # the cpu: no device variable, the cores split between the replicas
        assert not set(plan.env) & set(DEVICE_VARS)
        assert int(plan.env["OMP_NUM_THREADS"]) == max(1, len(os.sched_getaffinity(0)) // 2)

    # a CUDA-like backend: replica i sees devices [i*tp*ep, (i+1)*tp*ep)
    from flagdeploy.gateway.launch import builtin_launch_plan

    cuda = [builtin_launch_plan(entry, 9100 + i, i, backend=CUDA_LIKE, environ={}, device_count=lambda: 8, cores=16)
            for i in range(2)]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in cuda] == ["0,1", "2,3"]
    assert [p.env["OMP_NUM_THREADS"] for p in cuda] == ["8", "8"]
    cpu = builtin_launch_plan(entry, 9100, 1, backend=CPU, environ={"CUDA_VISIBLE_DEVICES": "0"}, cores=3)
    assert cpu.env == {"OMP_NUM_THREADS": "1", "FLAGDEPLOY_PARENT_PID": str(os.getpid())}


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: whoever reaps orphans here may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_replica_ends_when_its_gateway_is_killed(tmp_path):
    """SIGKILL leaves the gateway no chance to stop its replicas: each replica notices on its own."""
    ready = tmp_path / "watching"
    replica = ("import sys, time; from flagdeploy.gateway.replicas import exit_with_parent; "
               f"exit_with_parent(interval=0.1); open({str(ready)!r}, 'w').close(); time.sleep(120)")
    gateway = ("import os, subprocess, sys, time; "
               f"p = subprocess.Popen([sys.executable, '-c', {replica!r}], "
               "env={**os.environ, 'FLAGDEPLOY_PARENT_PID': str(os.getpid())}); "
               "print(p.pid, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", gateway], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the replica never started watching"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), "the replica outlived its killed gateway"
    finally:
        proc.kill()


def test_device_slices_follow_the_users_list():
    given = {"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}
    slices = [replica_env(CUDA_LIKE, i, 2, 2, environ=given, cores=4)[0]["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    assert slices == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match=r"need 6 cuda devices; CUDA_VISIBLE_DEVICES=4, 5,6,7 lists 4"):
        replica_env(CUDA_LIKE, 0, 3, 2, environ=given)
    with pytest.raises(ConfigError, match=r"need 2 cuda devices; the cuda backend sees 1. Lower --dp"):
        replica_env(CUDA_LIKE, 0, 2, 1, environ={}, device_count=lambda: 1)
    env, warnings = replica_env(SimpleNamespace(name="xpu", device_type="xpu"), 0, 2, 1, environ={}, cores=1)
    assert env == {"OMP_NUM_THREADS": "1"} and "every replica sees every device" in warnings[0]
    from flagdeploy.ops import get_backend

    assert get_backend("cuda").visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert get_backend("ascend").visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert get_backend("cpu").visible_devices_env is None


def test_serve_yaml_builtin_replicas():
    cfg = parse_config({"models": [
        {"names": ["a"], "engine": "builtin", "replicas": 2, "args": {"max_model_len": 512}},
        {"names": ["b"], "engine": "builtin", "args": {"max_model_len": 512}}]})  # one in-process, one launched
    assert [m.replicas for m in cfg.models] == [2, 1]
    with pytest.raises(ConfigError, match="with one replica"):
        parse_config({"models": [{"names": ["a"], "engine": "builtin"}, {"names": ["b"], "engine": "builtin"}]})
    bad = parse_config({"models": [{"engine": "builtin", "replicas": 2, "args": {"cuda_graphs": False}}]})
    with pytest.raises(ConfigError, match=r"unknown args \['cuda_graphs'\]"):
        launch_plan(bad.models[0], 9000, 0)
    typo = parse_config({"models": [{"engine": "builtin", "replicas": 2, "args": {"reasoning_parser": "thnk"}}]})
    with pytest.raises(ConfigError, match="reasoning_parser"):
        build_gateway(typo)


def test_dp_refuses_external_engines():
    from click.testing import CliRunner

    from flagdeploy.cli import main

    out = CliRunner().invoke(main, ["serve", "--dp", "2", "--upstream", "http://h:1"])
    assert out.exit_code == 1 and "--dp runs replicas of the builtin engine" in out.output


def test_merged_metrics_label_each_replica():
    text = ('# HELP f_tokens_total Tokens.\n# TYPE f_tokens_total counter\nf_tokens_total 3.0\n'
            '# HELP f_lat Latency.\n# TYPE f_lat histogram\nf_lat_bucket{le="1.0"} 1.0\nf_lat_count 1.0\n')
    merged = merge_expositions("m", [("http://a", text), ("http://b", text.replace("3.0", "5.0"))])
    lines = merged.splitlines()
    assert lines.count("# TYPE f_tokens_total counter") == 1
    assert lines[2:4] == ['f_tokens_total{model="m",replica="http://a"} 3.0',
                          'f_tokens_total{model="m",replica="http://b"} 5.0']
    assert 'f_lat_bucket{model="m",replica="http://b",le="1.0"} 1.0' in lines


# ---- live: two replicas of the default model on the CPU ----------------------------------------------

PROMPTS = ["Say hello.", "Name a colour.", "What is 2+2?", "Name a fruit.", "Count to three.", "Say goodbye."]


def _chat(client: openai.OpenAI, prompt: str) -> str:
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=12, temperature=0)
    return out.choices[0].message.content


def _counter(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} with {label} in the gateway's /metrics")


def _scrape(url: str, replicas: list[str], tries: int = 10) -> str:
    """The gateway's /metrics once it carries every replica's own lines: a replica that does not answer
    the gateway's scrape within its 2 s (a loaded 2-core machine) is left out of that one scrape."""
    for _ in range(tries):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if all(f'replica="{r}"' in text for r in replicas):
            return text
        time.sleep(1)
    return text


def test_serve_dp2_live(default_model):
    port = _free_port()
    # dense weights: batch-invariant kernels, so answers batched through the gateway equal answers one at a
    # time (the int4 kernels are chosen by row count, and a near tie may flip: docs/architecture.md)
    proc = _serve_cli("--dp", "2", "--served-model-name", "smollm2", "--port", str(port), "--api-key", "sk-dp",
                      "--weight-format", "dense", *SMALL)
    pids: list[int] = []
    try:
        url = wait_ready(proc, port, timeout=150)
        replicas = httpx.get(f"{url}/ready").json()["models"]["smollm2"]["replicas"]
        assert len(replicas) == 2 and all(r["state"] == "ready" for r in replicas)
        pids = [r["pid"] for r in replicas]
        urls = [r["url"] for r in replicas]

        # The single-replica answers: replica 0 asked directly (a plain `flagdeploy serve`), one at a time.
        # (Its own process, not one in this test: greedy sums depend on the thread count, which differs.)
        one = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="none", max_retries=0, timeout=60)
        expected = {p: _chat(one, p) for p in PROMPTS}
        before = _scrape(url, urls)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-dp", max_retries=0, timeout=60)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = dict(zip(PROMPTS, pool.map(lambda p: _chat(client, p), PROMPTS)))
        assert answers == expected

        status = httpx.get(f"{url}/ready").json()["models"]["smollm2"]
        served = {r["url"]: r["served"] for r in status["replicas"]}
        assert sum(served.values()) == len(PROMPTS) and all(n > 0 for n in served.values()), served
        after = _scrape(url, urls)
        tokens = "flagdeploy:generation_tokens_total"
        for replica in urls:  # each replica's own engine counters, through the gateway's /metrics
            assert _counter(after, tokens, f'replica="{replica}"') > _counter(before, tokens, f'replica="{replica}"')
            assert _counter(after, "flagdeploy_upstream_requests_total", f'url="{replica}"') == served[replica]
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the gateway checks the key
        models = client.models.list().data
        assert [m.id for m in models] == ["smollm2"] and models[0].max_model_len == 512
        r = httpx.post(f"{url}/v1/messages/count_tokens", headers={"x-api-key": "sk-dp"}, timeout=30,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text  # a replica counts
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 5
    for pid in pids:  # stopping the server stopped the replicas
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"replica pid {pid} outlived the server")
