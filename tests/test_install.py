"""`flagdeploy install`, `doctor` and `deploy` from the command line: plans over recorded systems, a real
install of the CPU stack in this venv, and the errors a user meets first."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flagdeploy.installer import install as inst
from flagdeploy.installer.detect import detect

SYSTEMS = Path(__file__).parent / "fixtures" / "systems"


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flagdeploy.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("system,chip,wants", [
    ("a2", "ascend910b", ["8 x ascend910b (A2", "install   torch-npu==2.12.0", "CANN      >= 9.1.0"]),
    ("a3", "auto", ["16 x ascend910c (A3", "install   torch-npu==2.12.0", "-a3-"]),
    ("h20", "auto", ["8 x h20", "chip h20 (sm90)"]),
    ("cpu", "cpu", ["1 x cpu", "chip cpu (cpu)"]),
])
def test_dry_run_plans_for_recorded_systems(system, chip, wants):
    r = _cli("install", "--chip", chip, "--dry-run", "--root", str(SYSTEMS / system))
    assert r.returncode == 0, r.stderr
    for w in wants:
        assert w in r.stdout, (w, r.stdout)
    assert "host " not in r.stdout  # these boxes have their driver, CANN and NNAL


def test_plan_names_host_prerequisites_with_their_commands():
    plan = inst.make_plan(detect(SYSTEMS / "cpu"), "ascend910c", "vllm-ascend")
    missing = "\n".join(f"{what}: {how}" for what, how in plan.host_missing)
    assert "driver" in missing and "Ascend-cann-toolkit" in missing and "nnal/atb/set_env.sh" in missing
    assert any(r.startswith("vllm-ascend") for r in plan.to_install)


def test_absent_and_unknown_chips():
    r = _cli("install", "--chip", "ascend910c", "--root", str(SYSTEMS / "h20"))
    assert r.returncode == 1 and "found: 8 x h20" in r.stderr and "--dry-run" in r.stderr
    r = _cli("install", "--chip", "ascend9999", "--dry-run")  # a bad option value: click's usage error, exit 2
    assert r.returncode == 2 and "ascend910c" in r.stderr and "--chip auto" in r.stderr


def test_a_failed_pip_step_says_what_and_changes_nothing(tmp_path):
    plan = inst.make_plan(detect(SYSTEMS / "cpu"), "cpu")
    plan.to_install = ["flagdeploy-no-such-package==1.0"]
    with pytest.raises(inst.InstallError, match=r"(?s)downloading the packages failed.*pip download.*run the same"):
        inst.download(plan, tmp_path, index_url="http://127.0.0.1:9/simple")
    assert not list(tmp_path.iterdir())
    assert inst._installed("flagdeploy-no-such-package") is None


def test_install_cpu_for_real(tmp_path, default_model):
    """What CI runs: the builtin CPU stack in this fresh venv, the default model, the op check, exit 0."""
    env = tmp_path / "env.sh"
    r = _cli("install", "--chip", "cpu", "--yes", "--env-file", str(env))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified: torch 2.13" in r.stdout and "passed" in r.stdout
    assert env.read_text().startswith("# written by `flagdeploy install`")


def test_install_cpu_edge_for_real(tmp_path, default_model):
    """The ONNX Runtime path of the edge chip: its packages (the edge extra) are found, and the check names
    onnxruntime and the execution provider, not torch."""
    if importlib.util.find_spec("onnxruntime") is None and os.environ.get("FLAGDEPLOY_REQUIRE_ONNXRUNTIME") != "1":
        pytest.skip("onnxruntime is not installed: pip install 'flagdeploy[edge]'")
    r = _cli("install", "--chip", "cpu-edge", "--yes", "--env-file", str(tmp_path / "env.sh"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engine onnxruntime" in r.stdout and "verified: onnxruntime 1." in r.stdout
    assert "CPUExecutionProvider present" in r.stdout


def test_doctor_finds_the_container_without_devices(tmp_path):
    box = tmp_path / "a3"
    shutil.copytree(SYSTEMS / "a3", box)
    for node in (box / "dev").glob("davinci*"):
        node.unlink()
    (box / ".commands" / "npu-smi_info.txt").unlink(missing_ok=True)
    r = _cli("doctor", "--chip", "ascend910c", "--root", str(box))
    assert r.returncode == 1
    assert "no Ascend device nodes inside this container" in r.stdout and "--device /dev/davinci0" in r.stdout
    r = _cli("doctor", "--chip", "ascend910c", "--root", str(SYSTEMS / "a3"))
    assert "device nodes" not in r.stdout


@pytest.mark.parametrize("cann,driver,supported", [
    ("9.2.0", "25.3.RC1", True), ("9.2.0", "25.2.0", False),  # 9.2 dropped the 25.2 drivers
    ("9.1.0", "25.2.1", True), ("9.1.0", "26.1.0", True), ("9.1.0", "25.0.rc1.1", False),
    ("8.5.0", "25.0.RC1", True), ("8.2.RC1", "24.1.rc2", True), ("8.2.RC1", "25.3.RC1", False),
    ("8.0.RC3", "24.1.rc2", None),  # no row: nothing is claimed
])
def test_driver_and_cann_pairing_from_the_sourced_table(cann, driver, supported):
    from flagdeploy.installer import hdk

    p = hdk.pairing(cann, driver)
    assert p.supported is supported
    assert bool(p.sources) is (supported is not None) and all("hiascend.com" in s or "release notes" in s for s in p.sources)


def test_doctor_checks_the_driver_against_the_cann(tmp_path):
    """The recorded A3 box pairs CANN 9.1.0 with driver 25.0.rc1.1, which CANN 9.1's table does not list."""
    r = _cli("doctor", "--chip", "ascend910c", "--root", str(SYSTEMS / "a3"))
    assert r.returncode == 1
    assert "driver 25.0.rc1.1 is not one CANN 9.1.0 supports" in r.stdout
    assert "25.2.X" in r.stdout and "9.0.X" in r.stdout  # the drivers to install, or the CANN that fits
    box = tmp_path / "a3"
    shutil.copytree(SYSTEMS / "a3", box)
    info = box / "usr/local/Ascend/driver/version.info"
    info.write_text(info.read_text().replace("25.0.rc1.1", "25.3.rc1"))
    r = _cli("doctor", "--chip", "ascend910c", "--root", str(box))
    assert "CANN 9.1.0 with driver 25.3.rc1: a listed pairing" in r.stdout and "is not one" not in r.stdout
    info.unlink()  # no driver at all: the plan names the drivers for its CANN
    (box / ".commands" / "npu-smi_info.txt").unlink()
    r = _cli("install", "--chip", "ascend910c", "--dry-run", "--root", str(box))
    assert "for CANN 9.1.0, Ascend HDK 25.2.X" in r.stdout, r.stdout


def test_deploy_writes_the_planned_manifests(tmp_path):
    r = _cli("deploy", "k8s", "--chip", "h200", "--model", "glm-5.3-flash", "--devices", "8", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all((tmp_path / "deployment.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service"} <= kinds
    profile = yaml.safe_load((tmp_path / "profile.yaml").read_text())["profile"]
    assert profile["chip"] == "h200" and profile["tp"] * profile["dp"] * profile["pp"] == 8
    r = _cli("deploy", "k8s", "--chip", "h200", "--model", "glm-5.3-flash", "--devices", "8", "-o", str(tmp_path))
    assert r.returncode == 1 and "refusing to overwrite" in r.stderr and "--overwrite" in r.stderr


def test_verification_catches_a_stack_for_the_wrong_ascend_family(monkeypatch):
    """Through the torch_npu stand-in: an A2 plan on a device that reports an A3 SoC is refused."""
    import os

    standins = str(Path(__file__).parent / "standins")
    env = {"PYTHONPATH": os.pathsep.join([standins, os.environ.get("PYTHONPATH", "")])}
    a2 = inst.make_plan(detect(SYSTEMS / "a2"), "ascend910b")
    facts = inst.probe(a2, {**env, "FLAGDEPLOY_STANDIN_SOC": "Ascend910B3"})
    assert facts["family"] == "A2" and facts["devices"] >= 1
    with pytest.raises(inst.InstallError, match=r"SoC version 250 \(A3\).*ascend910b \(A2\).*--chip auto"):
        inst.probe(a2, {**env, "FLAGDEPLOY_STANDIN_SOC": "Ascend910_9391"})


def test_verification_catches_a_vllm_ascend_build_for_another_family(tmp_path):
    """vLLM-Ascend's kernels are compiled for one family: an A2 build on an A3 box is refused, with the
    build to install instead; the build record is read without importing the plugin."""
    import os

    standins = str(Path(__file__).parent / "standins")
    package = tmp_path / "vllm_ascend"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the verification must not start the plugin')\n")
    env = {"PYTHONPATH": os.pathsep.join([standins, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "FLAGDEPLOY_STANDIN_SOC": "Ascend910_9391"}
    a3 = inst.make_plan(detect(SYSTEMS / "a3"), "ascend910c", engine="vllm-ascend")
    (package / "_build_info.py").write_text("__soc_version__ = 'ascend910_9391'\n__sleep_mode_enabled__ = False\n")
    facts = inst.probe(a3, env)
    assert facts["family"] == facts["build_family"] == "A3"
    (package / "_build_info.py").write_text("__soc_version__ = 'ascend910b3'\n__device_type__ = 'A2'\n")
    with pytest.raises(inst.InstallError, match=r"built for ascend910b3 \(A2\), but ascend910c is A3.*-a3"):
        inst.probe(a3, env)
    (package / "_build_info.py").unlink()
    with pytest.raises(inst.InstallError, match="build record"):
        inst.probe(a3, env)


def test_download_only_fetches_the_whole_stack_for_the_other_host(monkeypatch, tmp_path):
    """The wheels are for an air-gapped host: what this host already has is fetched too (it used to be
    skipped, leaving the folder empty), flagdeploy itself aside; a CPU build of torch is no CUDA stack."""
    plan = inst.make_plan(detect(SYSTEMS / "cpu"), "cpu")
    asked = []
    monkeypatch.setattr(inst, "_pip", lambda args, what: asked.append(args))
    inst.download(plan, tmp_path, everything=True)
    assert any(a.startswith("torch") for a in asked[0]) and not any(a.startswith("flagdeploy") for a in asked[0])
    monkeypatch.setattr(inst, "_installed", lambda name: "2.13.0+cpu" if name == "torch" else None)
    assert any(r.startswith("torch") for r in inst.make_plan(detect(SYSTEMS / "h20"), "h20").to_install)
    (tmp_path / "b").mkdir()
    r = _cli("install", "--chip", "cpu", "--download-only", str(tmp_path / "a"), "--offline", str(tmp_path / "b"))
    assert r.returncode == 1 and "give one of them" in r.stderr


def test_doctor_plans_the_model_on_the_memory_found_here():
    """On a CPU host the fit is judged on its RAM (the fixture's 31 GiB), not the catalog's nominal figure (it
    said 230.4 GiB were available on a 24 GiB box)."""
    r = _cli("doctor", "--chip", "cpu", "--model", "glm-5.3-flash", "--root", str(SYSTEMS / "cpu"))
    assert "does not fit on 1 x cpu" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "28.0 GiB is available" in r.stdout + r.stderr, r.stdout + r.stderr  # 90% of 31.1 GiB
