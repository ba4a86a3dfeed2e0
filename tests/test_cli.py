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
    assert r.exit_code == 2 and "Unknown chip 'no-such-chip'" in r.output


def test_models_lists_the_cached_default(default_model):
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0
    assert "smollm2-135m-instruct" in r.output


@pytest.fixture(scope="module")
def served(default_model):
    """`flagdeploy serve` with the README's defaults, one for the module: (its base URL, its port)."""
    port = _free_port()
    proc = _serve("--port", str(port))
    try:
        yield wait_ready(proc, port), port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_answers_a_chat_completion(served):
    """The README's journey: serve, then a plain HTTP chat completion answers with the model's greedy reply."""
    url, port = served
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


def test_serve_speaks_openai_through_the_sdk(served):
    """The OpenAI routes (server/openai.py) as `flagdeploy serve` assembles them (serving.py, assemble.py),
    driven by the `openai` SDK: the model list, chat and completions whole and streamed, and a body the
    server refuses surfacing as the SDK's BadRequestError with the server's message and param."""
    import openai

    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=chat, max_tokens=8)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length") and 0 < whole.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(model="smollm2-135m-instruct", messages=chat, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the stream says what the whole answer said
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    done = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                     max_tokens=4)
    pieces = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                       max_tokens=4, stream=True)
    assert done.object == "text_completion" and "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    for create, body, param, says in (
            (client.chat.completions.create, {"messages": chat, "n": 0}, "n",
             "Invalid value for 'n': Input should be greater than or equal to 1"),
            (client.chat.completions.create, {"messages": [{"role": "wizard", "content": "hi"}]},
             "messages[0].role", "Invalid value for 'messages[0].role': \"wizard\". Supported values are: "),
            (client.chat.completions.create, {"messages": chat, "stream": True, "n": 17}, "n",  # a status, not an event
             "Invalid value for 'n': Input should be less than or equal to 16"),
            (client.completions.create, {"prompt": "hi", "max_tokens": 0}, "max_tokens",
             "Invalid value for 'max_tokens': Input should be greater than or equal to 1")):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="smollm2-135m-instruct", **body)
        assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
        assert info.value.body["param"] == param and says in info.value.body["message"], info.value.body


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


# ---- --chip: one meaning in every command (issue 32) ---------------------------------------------------------

SYSTEMS = __import__("pathlib").Path(__file__).parent / "fixtures" / "systems"


def _commands_with_chip(group=main, path=()):
    """(command path, its --chip option) for every command of the CLI that takes --chip."""
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands_with_chip(cmd, (*path, name))
        for param in cmd.params:
            if "--chip" in getattr(param, "opts", ()):
                yield (*path, name), param


def test_every_chip_option_is_the_one_resolver():
    """A command added later with a plain --chip option would take a different set of values: every --chip is
    the same ParamType, so all of them accept the catalog ids and the backend names, and fail alike."""
    from flagdeploy.cli import ChipParam

    found = {" ".join(path): type(param.type).__name__ for path, param in _commands_with_chip()}
    assert {"serve", "ops list", "ops check", "ops tune", "quantize", "plan", "install", "doctor", "deploy",
            "selftest"} <= set(found)
    assert all(kind == ChipParam.__name__ for kind in found.values()), found


# each command with the arguments it needs besides --chip, so that only the chip can be wrong
_ARGS = {
    "serve": ["serve", "--port", "0"],
    "ops list": ["ops", "list"],
    "ops check": ["ops", "check"],
    "ops tune": ["ops", "tune"],
    "quantize": ["quantize", "src", "-o", "dst"],
    "plan": ["plan", "--model", "glm-5.3-flash"],
    "install": ["install", "--dry-run"],
    "doctor": ["doctor"],
    "deploy": ["deploy", "docker", "--model", "glm-5.3-flash"],
    "selftest": ["selftest"],
}


@pytest.mark.parametrize("command", sorted(_ARGS))
def test_an_unknown_chip_gets_the_same_error_in_every_command(command):
    """Parse time, before anything loads: the value, the closest ids, every catalog id and the backend names."""
    from flagdeploy.chips import all_chips

    r = CliRunner().invoke(main, [*_ARGS[command], "--chip", "ascend91c"])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--chip': Unknown chip 'ascend91c'. Did you mean 'ascend910c'" in r.output
    listed = r.output.split("Known chips: ", 1)[1]
    assert all(c.id in listed for c in all_chips())
    assert "or a backend name: " in listed and all(b in listed for b in ("cpu", "cuda", "ascend"))


@pytest.mark.parametrize("chip,backend", [("ascend910c", "ascend"), ("h20-141g", "cuda"), ("cpu-edge", "cpu"),
                                          ("ascend", "ascend"), ("CUDA", "cuda"), ("cpu", "cpu")])
def test_ops_list_takes_catalog_ids_and_backend_names(chip, backend):
    r = CliRunner().invoke(main, ["ops", "list", "--chip", chip])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"backend: {backend} ")


def test_ops_check_and_tune_resolve_a_chip_to_its_backend():
    """ops tune --chip h200 reaches the cuda backend (which has nothing to tune), not a 'no backend' error;
    ops check takes the same value (checked here up to the backend it would check)."""
    r = CliRunner().invoke(main, ["ops", "tune", "--chip", "h200"])
    assert r.exit_code == 1 and "the cuda backend has nothing to tune" in r.output
    from flagdeploy import ops

    assert ops.get_backend("ascend910c").name == "ascend" and ops.get_backend("h20-141g").name == "cuda"


def test_a_chip_whose_backend_is_not_installed_says_how_to_install_it(monkeypatch):
    from flagdeploy.errors import UnknownChipError
    from flagdeploy.ops import registry

    monkeypatch.setattr(registry, "_backends", {"cpu": registry.backends()["cpu"]})
    with pytest.raises(UnknownChipError, match=r"--chip ascend910c runs on the 'ascend' backend, which is not "
                                               r"installed here \(installed: cpu\).*flagdeploy install --chip ascend910c"):
        registry.get_backend("ascend910c")


def test_selftest_takes_catalog_ids_and_backend_names():
    """No device here: the message names the chip (or backend) asked for; both reached the cuda backend."""
    r = CliRunner().invoke(main, ["selftest", "--chip", "h20-141g"])
    assert r.exit_code == 1 and "no NVIDIA H20 (141 GB" in r.output and "(h20-141g) device is visible to the cuda" in r.output
    r = CliRunner().invoke(main, ["selftest", "--chip", "cuda"])
    assert r.exit_code == 1 and "no cuda backend device is visible to the cuda backend" in r.output


def test_commands_that_need_the_chip_refuse_a_shared_backend_name(tmp_path):
    """plan, deploy and quantize need one chip's memory and dtypes: `cuda` names six chips, so they ask which,
    at parse time; a backend the catalog has one chip of resolves to it."""
    for args in (["plan", "--model", "glm-5.3-flash"], ["deploy", "docker", "--model", "glm-5.3-flash"],
                 ["quantize", "src", "-o", "dst"]):
        r = CliRunner().invoke(main, [*args, "--chip", "cuda"])
        assert r.exit_code == 2, r.output
        assert "--chip cuda names the cuda backend" in r.output and "h20, h20-141g, h100, h200, a100, l20" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "glm-5.3-flash", "--chip", "cambricon", "--json"])
    assert r.output and __import__("json").loads(r.output)["chip"] == "mlu590"


def test_deploy_takes_a_catalog_id_and_the_memory_share(tmp_path):
    import yaml

    r = CliRunner().invoke(main, ["deploy", "compose", "--chip", "h20-141g", "--model", "glm-5.3-flash", "--devices", "4",
                                  "--gpu-memory-utilization", "0.85", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "--profile" in (tmp_path / "compose.yaml").read_text()
    profile = yaml.safe_load((tmp_path / "profile.yaml").read_text())["profile"]
    assert profile["chip"] == "h20-141g" and profile["memory_utilization"] == 0.85


def test_install_and_doctor_take_a_backend_name_as_the_chip_found_here():
    r = CliRunner().invoke(main, ["install", "--chip", "cuda", "--dry-run", "--root", str(SYSTEMS / "h20")])
    assert r.exit_code == 0, r.output
    assert "chip h20 (sm90)" in r.output
    r = CliRunner().invoke(main, ["doctor", "--chip", "ascend", "--root", str(SYSTEMS / "a3")])
    assert "found: 16 x ascend910c" in r.output
    r = CliRunner().invoke(main, ["install", "--chip", "ascend", "--dry-run", "--root", str(SYSTEMS / "h20")])
    assert r.exit_code == 1 and "names the ascend backend" in r.output and "--chip auto" in r.output


def test_serve_takes_a_catalog_id_and_plans_on_that_chip(default_model):
    """serve --chip ascend910c is accepted as the catalog id of a chip of the ascend backend (the failure is
    that this host has none); the plan line serve prints before loading is for the chip named, not the first
    chip of its backend."""
    r = CliRunner().invoke(main, ["serve", "--chip", "ascend910c", "--port", "0", "--model", "/nonexistent/m.gguf"])
    assert r.exit_code == 1 and "no ascend910c device is visible to the ascend backend" in r.output, r.output
    from flagdeploy.assemble import ServeOptions
    from flagdeploy.serving import plan_line

    line = plan_line(default_model, ServeOptions(chip="h20-141g", max_num_seqs=4, kv_cache_memory=1 << 30,
                                                 memory_utilization=0.8))
    assert "plan: smollm2-135m-instruct" in line and "h20-141g x1 tp=1,dp=1,ep=1,pp=1 in 80% of 140.4 GiB" in line


def test_serve_passes_the_chip_and_memory_share_to_a_launched_engine(monkeypatch):
    """serve --engine vllm --chip h20-141g --gpu-memory-utilization 0.8: the launched vLLM gets the planner's
    flags for that chip and the share, as `plan --emit vllm` prints them (nothing is started here)."""
    import flagdeploy.gateway
    import flagdeploy.server
    from flagdeploy.gateway.launch import launch_plan

    built = []

    class _Gateway:
        pools = []

    monkeypatch.setattr(flagdeploy.gateway, "build_gateway", lambda cfg: built.append(cfg) or _Gateway())
    monkeypatch.setattr(flagdeploy.server, "make_server", lambda *a, **k: type("S", (), {"run": lambda self: None})())
    r = CliRunner().invoke(main, ["serve", "--engine", "vllm", "--model", "zai-org/GLM-5.3-Flash", "--chip", "h20-141g",
                                  "--gpu-memory-utilization", "0.8", "--port", "0"])
    assert r.exit_code == 0, r.output
    entry = built[0].models[0]
    assert entry.chip == "h20-141g"
    argv = launch_plan(entry, 9000).argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.8"


# ---- what a first-hour user tried (the second exploratory pass) ------------------------------------------

def test_a_preset_names_its_checkpoint_in_every_command(tmp_path):
    """`--model glm-5.3-flash` is the planner's preset in plan/deploy and the checkpoint it describes in
    serve/pull: deploy's profile carries the hub id (serve on it used to fail: "Unknown model source")."""
    from flagdeploy.errors import FlagdeployError
    from flagdeploy.checkpoints import source
    from flagdeploy.planner import Profile

    with pytest.raises(FlagdeployError, match="zai-org/GLM-5.3-Flash is not in the cache"):
        source.resolve("glm-5.3-flash", download=False)
    out = tmp_path / "d"
    r = CliRunner().invoke(main, ["deploy", "docker", "--chip", "ascend910c", "--model", "glm-5.3-flash", "-o", str(out)])
    assert r.exit_code == 0, r.output
    profile = Profile.load(out / "profile.yaml")
    assert (profile.model, profile.served_model_name) == ("zai-org/GLM-5.3-Flash", "glm-5.3-flash")


def test_bad_values_and_files_are_error_lines_not_tracebacks(tmp_path):
    runner = CliRunner()
    for args in (["plan", "--model", "glm-5.3-flash", "--chip", "ascend910c", "--max-model-len", "0"],
                 ["serve", "--port", "99999"], ["plan", "--model", "glm-5.3-flash", "--chip", "ascend910c",
                                                "--devices", "-4"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 2 and "is not in the range" in r.output, (args, r.output)
    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "part.yaml").write_text("model: x\n")
    for name, says in (("bad.yaml", "is not valid YAML"), ("part.yaml", "lacks the profile fields ['chip']")):
        for command in (["deploy", "docker"], ["serve"]):
            r = runner.invoke(main, [*command, "--profile", str(tmp_path / name)])
            assert r.exit_code == 1 and says in r.output and r.exc_info[0] is SystemExit, (command, r.output)
    (tmp_path / "file").write_text("")
    r = runner.invoke(main, ["deploy", "docker", "--chip", "ascend910c", "--model", "glm-5.3-flash",
                             "-o", str(tmp_path / "file" / "sub")])
    assert r.exit_code == 1 and "Check the path" in r.output and r.exc_info[0] is SystemExit, r.output


def test_a_missing_device_and_a_split_that_cannot_be_are_refused_before_anything_starts():
    """serve and ops check on a chip this host lacks used to die in torch ("Expected one of cpu, cuda ...
    device string: npu"); --dp replicas with a --tp the model cannot take were each restarted five times."""
    runner = CliRunner()
    for args in (["serve", "--chip", "ascend910c"], ["ops", "check", "--chip", "ascend910c"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 1 and "no ascend910c device is visible" in r.output, (args, r.output)
    r = runner.invoke(main, ["serve", "--tp", "2", "--dp", "2"])  # the default model: 9 heads
    assert r.exit_code == 1 and "cannot be split with --tp 2" in r.output, r.output


def test_chip_auto_is_the_detected_device_in_every_command(default_model):
    runner = CliRunner()
    for args in (["ops", "list", "--chip", "auto"], ["plan", "--model", "smollm2-135m-instruct", "--chip", "auto"],
                 ["install", "--chip", "auto", "--dry-run"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 0, (args, r.output)


def test_the_port_check_is_not_fooled_by_a_dead_server_s_connections():
    """A server killed outright leaves its connections in TIME_WAIT on the port for about a minute; the check
    before listening took them for a listener, so a --dp replica could not be restarted."""
    import socket

    from flagdeploy.errors import FlagdeployError
    from flagdeploy.serving import check_port

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    listener.close()
    check_port("127.0.0.1", port)  # no error
    with socket.create_server(("127.0.0.1", 0)) as busy, pytest.raises(FlagdeployError, match="cannot listen on"):
        check_port("127.0.0.1", busy.getsockname()[1])


def test_plan_takes_every_model_source_serve_takes(default_model):
    """--model means one thing in every command: the bundled model and a GGUF file plan too (they were
    "no model ... pass a preset", and a GGUF a UTF-8 decoding error)."""
    for model in ("smollm2-135m-instruct", str(default_model.path)):
        r = CliRunner().invoke(main, ["plan", "--model", model, "--chip", "h200", "--devices", "1"])
        assert r.exit_code == 0 and "0.13B params" in r.output, (model, r.output)
