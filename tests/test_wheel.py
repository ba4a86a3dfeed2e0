"""The wheel and the sdist hold the tree: what a non-editable install (pip install ., an image, an index) gets.

The editable install that development uses reads the folders directly and hides a package or data file the
build leaves out; these tests read the built archives. CI builds them once (`python -m build`, the wheel from
the sdist) and passes the folder as FLAGDEPLOY_DIST; without it they are built here, offline (--no-isolation).
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parents[1]
# source folder -> where the wheel puts it, from setup.py's import name -> folder map
ROOTS = {folder: name.replace(".", "/") for name, folder in runpy.run_path(str(TOP / "setup.py"))["ROOTS"].items()}


def _tracked(*paths: str) -> list[str]:
    """Files as git tracks them (so stray local files do not count), that exist in the working tree."""
    out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=TOP, capture_output=True, check=False)
    if out.returncode:
        pytest.skip("not a git checkout: the tree's file list comes from git ls-files")
    return sorted(f for f in out.stdout.decode().split("\0") if f and (TOP / f).is_file())


def _tree_files() -> list[str]:
    return _tracked(*ROOTS)


def _copy_of_tree(src: Path) -> Path:
    """What git tracks, copied to `src`: a checkout's own build/ and *.egg-info (left by earlier builds and editable
    installs) would be read back into new archives and hide a missing file."""
    for f in _tracked():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TOP / f, src / f)
    return src


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    given = os.environ.get("FLAGDEPLOY_DIST")
    if given:
        return Path(given)
    pytest.importorskip("build", reason="the `build` package (in the test extra) builds the sdist and wheel")
    src = _copy_of_tree(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(dist), str(src)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return dist


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {found}"
    return found[0]


def test_wheel_holds_every_file_of_the_tree(dist):
    names = set(zipfile.ZipFile(_one(dist, "flagdeploy-*.whl")).namelist())
    tree = _tree_files()
    assert any(f.startswith("flagdeploy/models/idefics3/") for f in tree)
    wanted = {f"{ROOTS[f.split('/', 1)[0]]}/{f.split('/', 1)[1]}" for f in tree}
    missing = sorted(wanted - names)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the tree: {missing[:10]}"
    # and nothing else lands in site-packages: one namespace, no generic top-level `backends` or `installer`
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"flagdeploy"}
    extra = sorted(n for n in names if n.startswith("flagdeploy/") and n not in wanted)
    assert not extra, f"the wheel holds files the tree does not track: {extra[:10]}"


def test_wheel_declares_the_entry_points(dist):
    wheel = zipfile.ZipFile(_one(dist, "flagdeploy-*.whl"))
    ep = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(ep).decode()
    assert "flagdeploy = flagdeploy.cli:main" in text
    for backend in ("cpu", "cuda", "ascend", "generic"):
        assert f"{backend} = flagdeploy.backends.{backend}:backend" in text


def test_sdist_can_rebuild_the_wheel(dist):
    """The sdist carries the build recipe and every file the wheel is made of (pip builds from it)."""
    with tarfile.open(_one(dist, "flagdeploy-*.tar.gz")) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = {"setup.py", "pyproject.toml", "README.md", *_tree_files()}
    missing = sorted(needed - names)
    assert not missing, f"the sdist lacks {missing[:10]}"


def _backend(src: Path, monkeypatch):
    """build_backend.py as a build frontend runs it: imported from the tree, the tree as working directory."""
    monkeypatch.chdir(src)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, "build_backend", raising=False)
    import build_backend

    return build_backend


def _record_ok(wheel: zipfile.ZipFile) -> None:
    import base64
    import hashlib

    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    rows = [line.split(",") for line in wheel.read(record).decode().splitlines()]
    assert {r[0] for r in rows} == set(wheel.namelist())
    for name, digest, size in rows:
        if name != record:
            data = wheel.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(data)), name


def test_own_wheel_writer_makes_setuptools_wheel(dist, tmp_path, monkeypatch):
    """Where setuptools cannot make wheels (< 70.1 without `wheel`: a build without isolation on the setuptools
    `python3 -m venv` seeds), build_backend.py writes the wheel itself: the same files and metadata."""
    src = _copy_of_tree(tmp_path / "src")
    backend = _backend(src, monkeypatch)
    monkeypatch.setattr(backend, "setuptools_makes_wheels", lambda: False)
    assert backend.get_requires_for_build_wheel() == []  # setuptools < 70.1 would ask for `wheel`
    name = backend.build_wheel(str(tmp_path / "out"))
    ours, theirs = zipfile.ZipFile(tmp_path / "out" / name), zipfile.ZipFile(_one(dist, "flagdeploy-*.whl"))
    assert name == Path(theirs.filename).name
    _record_ok(ours)
    assert set(ours.namelist()) == set(theirs.namelist())
    info = next(n for n in ours.namelist() if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]

    def fields(wheel, key):
        head = wheel.read(f"{info}/METADATA").decode().split("\n\n", 1)[0]
        return sorted(line for line in head.splitlines() if line.startswith(key + ":"))

    for key in ("Name", "Version", "Requires-Python", "Requires-Dist", "Provides-Extra"):
        assert fields(ours, key) == fields(theirs, key), key
    assert any('extra == "test"' in r for r in fields(ours, "Requires-Dist"))
    assert ours.read(f"{info}/entry_points.txt") == theirs.read(f"{info}/entry_points.txt")
    for n in ours.namelist():
        if not n.startswith(info):
            assert ours.read(n) == theirs.read(n), n
    # the metadata hook writes the same .dist-info pip compares the wheel's against
    meta = backend.prepare_metadata_for_build_wheel(str(tmp_path / "meta"))
    assert meta == info
    assert (tmp_path / "meta" / meta / "METADATA").read_bytes() == ours.read(f"{info}/METADATA")


def test_pip_without_build_isolation_on_an_old_setuptools(tmp_path):
    """`pip wheel --no-build-isolation .` and `pip install -e . --no-build-isolation` in a venv as `python3 -m
    venv` makes it on Python 3.11 (setuptools 65, no `wheel`): the case setuptools alone fails with "invalid
    command 'bdist_wheel'"."""
    venv = tmp_path / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, check=False)
    if r.returncode:
        pytest.skip(f"no venv with pip here: {r.stderr[-300:]}")
    py = str(venv / "bin" / "python")
    probe = ("import importlib.util, sys\ntry:\n from setuptools.command.bdist_wheel import bdist_wheel\n"
             "except ImportError:\n sys.exit(0 if importlib.util.find_spec('wheel') is None else 1)\nsys.exit(1)")
    if subprocess.run([py, "-c", probe], check=False).returncode:
        pytest.skip("this Python's venv seeds a setuptools that makes wheels (or none): not the case under test")
    src = _copy_of_tree(tmp_path / "src")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = zipfile.ZipFile(_one(tmp_path / "w", "flagdeploy-*.whl"))
    _record_ok(wheel)
    assert "flagdeploy/backends/cpu/tune.yaml" in wheel.namelist()
    r = subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(src)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # an editable install reads the checkout: each import root from its folder, the entry points declared
    show = ("import importlib.util as u, importlib.metadata as m\n"
            "for n in ('flagdeploy', 'flagdeploy.backends.cpu', 'flagdeploy.quantize', 'flagdeploy.profiles'):\n"
            " print(u.find_spec(n).origin)\n"
            "print(sorted(e.name for e in m.entry_points(group='flagdeploy.backends')))")
    out = subprocess.run([py, "-c", show], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:4] == [str(src / p / "__init__.py") for p in ("flagdeploy", "backends/cpu", "quantize", "profiles")]
    assert out[4] == str(["ascend", "cpu", "cuda", "generic"])
    assert (venv / "bin" / "flagdeploy").exists()
