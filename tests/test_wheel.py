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


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    given = os.environ.get("FLAGDEPLOY_DIST")
    if given:
        return Path(given)
    pytest.importorskip("build", reason="the `build` package (in the test extra) builds the sdist and wheel")
    # Built from a copy of what git tracks: a checkout's own build/ and *.egg-info (left by earlier builds and
    # editable installs) are read back into new archives and would hide a missing file.
    src = tmp_path_factory.mktemp("src")
    for f in _tracked():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TOP / f, src / f)
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
