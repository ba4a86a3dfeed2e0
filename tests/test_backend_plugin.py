"""A third-party backend installed as its own package is discovered through the entry point, checked
against the reference like the in-tree ones, and dispatched to by name."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).parent / "plugins" / "flagdeploy-backend-demo"

PROBE = """
import torch
from flagdeploy import ops
from flagdeploy.ops.check import check_backend
import flagdeploy_backend_demo as demo

assert "demo" in ops.backends(), sorted(ops.backends())
be = ops.get_backend("demo")
assert ops.detect_backend().name != "demo"  # detect() is False: only chosen by name
results = check_backend(be)
assert all(r.passed for r in results), [r for r in results if not r.passed]
assert {r.op: r.impl for r in results}["rms_norm"] == "native"
ops.use_backend("demo")
before = demo.CALLS["rms_norm"]
x, w = torch.randn(3, 8), torch.randn(8)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.OPS["rms_norm"].reference(x, w, 1e-6))
assert demo.CALLS["rms_norm"] == before + 1
print("ok")
"""


def test_third_party_backend_is_discovered_and_dispatched(tmp_path):
    site, plugin = tmp_path / "site", tmp_path / "plugin"
    shutil.copytree(PLUGIN, plugin)  # the build leaves its own files next to the source: not in the repo
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(site), str(plugin)],
                   check=True, capture_output=True, text=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    # the CLI shows it too
    out = subprocess.run([sys.executable, "-m", "flagdeploy.cli", "ops", "list", "--chip", "demo"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "backend: demo (acme" in out.stdout and "rms_norm" in out.stdout
