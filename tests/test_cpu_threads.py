"""How a server process shares the cores with the cpu backend's kernel pool (flagdeploy/cpu_threads.py): OpenMP's
idle threads set to sleep before torch loads, the kernels' threads leaving cores to the server, and neither over
the user's own setting."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flagdeploy import cpu_threads
from flagdeploy.backends.cpu import ops as cpu_ops


def _python(code: str, **env: str) -> str:
    """`code` in a fresh interpreter (torch not loaded yet), its stdout's last line."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**environ, **env}, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_openmp_idle_threads_sleep_unless_the_user_chose():
    probe = """
        import os, sys
        from flagdeploy import cpu_threads
        cpu_threads.cores = lambda: {cores}
        {before}
        set_here = cpu_threads.sleep_idle_openmp()
        print(set_here, os.environ.get("OMP_WAIT_POLICY"), cpu_threads.user_environ().get("OMP_WAIT_POLICY"))
    """
    many = dict(cores=16, before="")
    assert _python(probe.format(**many)) == "True PASSIVE None"  # set here, and kept from non-flagdeploy children
    assert _python(probe.format(**many), OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE ACTIVE"
    assert _python(probe.format(**many), GOMP_SPINCOUNT="1000") == "False None None"
    # libgomp read its policy when torch loaded: setting it afterwards would only claim to
    assert _python(probe.format(cores=16, before="import torch")) == "False None None"
    # on few cores spinning threads cost less than sleeping ones' wake-ups: left as it is
    assert _python(probe.format(cores=2, before="")) == "False None None"


def test_serve_sets_the_policy_before_torch_loads():
    """The serve command's own path: the call comes before any import that loads torch (the model then fails to
    resolve, which is all the run needs)."""
    code = """
        import os, sys
        from click.testing import CliRunner
        from flagdeploy import cli, cpu_threads
        cpu_threads.cores = lambda: 16
        seen = []
        real = cpu_threads.sleep_idle_openmp
        cpu_threads.sleep_idle_openmp = lambda: seen.append("torch" in sys.modules) or real()
        result = CliRunner().invoke(cli.main, ["serve", "--model", "/nonexistent/model.gguf", "--port", "0"])
        print(seen, os.environ.get("OMP_WAIT_POLICY"), result.exit_code != 0)
    """
    assert _python(code) == "[False] PASSIVE True"


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (3, 3), (4, 3), (8, 6), (16, 12), (64, 48)])
def test_cpu_backend_leaves_one_core_in_four_to_the_server(cores, threads):
    assert cpu_ops.server_threads(cores) == threads


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_for_server_sets_torchs_threads(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cores", lambda: 16)
    assert cpu_threads.threads_for_server("cpu") == 12
    assert torch.get_num_threads() == 12


def test_threads_for_server_keeps_the_users_count(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cpu_threads, "cores", lambda: 16)
    torch.set_num_threads(1)
    assert cpu_threads.threads_for_server("cpu") is None
    assert torch.get_num_threads() == 1
