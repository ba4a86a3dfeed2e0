"""The `flagdeploy` command as a user runs it: a real subprocess for serve, CliRunner for the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from test_server import _free_port

from flagdeploy import __version__
from flagdeploy.cli import main


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flagdeploy.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 180) -> str:
    """The server's base URL once /ready answers 200; fails with its stderr if it exits first."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("server never became ready")


def test_version_and_ops_list():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output
    r = CliRunner().invoke(main, ["ops", "list", "--chip", "cpu"])
    assert r.exit_code == 0
    assert "backend: cpu" in r.output
    assert "attention_prefill" in r.output and "native" in r.output and "reference" in r.output
    r = CliRunner().invoke(main, ["ops", "list", "--chip", "no-such-chip"])
    assert r.exit_code == 1 and "installed: " in r.output


def test_models_lists_the_cached_default(default_model):
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0
    assert "smollm2-135m-instruct" in r.output


def test_serve_answers_a_chat_completion(default_model):
    """The README's journey: serve, then a plain HTTP chat completion answers with the model's greedy reply."""
    port = _free_port()
    proc = _serve("--port", str(port))
    try:
        url = wait_ready(proc, port)
        # exactly the README's curl: no temperature (the server default is greedy), curl's form content type
        body = ('{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":'
                '"What is the capital of France?"}]}')
        r = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=120,
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200, r.text
        data = r.json()
        assert "Paris" in data["choices"][0]["message"]["content"]
        u = data["usage"]
        assert u["prompt_tokens"] > 0 and u["completion_tokens"] > 0
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        # the port is now taken: a second server must refuse clearly and at once
        second = _serve("--port", str(port))
        out, err = second.communicate(timeout=60)
        assert second.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _write_gguf(path, arch: str) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["unsupported-arch", "corrupt", "missing"])
def test_serve_rejects_bad_model_files(tmp_path, case):
    path = tmp_path / "model.gguf"
    if case == "unsupported-arch":
        _write_gguf(path, "bert")
        expected = "'bert'"
    elif case == "corrupt":
        path.write_bytes(b"GGUF" + os.urandom(64))
        expected = str(path)
    else:
        expected = "model.gguf"
    proc = _serve("--model", str(path), "--port", str(_free_port()))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert err.startswith("error: ") and expected in err
    assert "Traceback" not in err
