"""The PEP 517 backend pyproject.toml names: setuptools' own, and a wheel writer of its own where setuptools has none.

setuptools makes wheels through `bdist_wheel`, which it has from 70.1 and older versions only with the `wheel`
package. An isolated build installs a new setuptools, but `pip wheel --no-build-isolation .` (or `pip install`,
`python -m build --no-isolation`) on a Python with, say, the setuptools 65 that `python3 -m venv` seeds and no
`wheel` ends in "invalid command 'bdist_wheel'". Where that is so, this module runs the setuptools commands every
version has (`egg_info`, `build_py`) and writes the wheel and its .dist-info itself: same files, same metadata.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist  # noqa: F401  (the sdist is setuptools')

__all__ = ["build_sdist", "build_wheel", "build_editable", "get_requires_for_build_sdist",
           "get_requires_for_build_wheel", "get_requires_for_build_editable", "prepare_metadata_for_build_wheel",
           "prepare_metadata_for_build_editable"]

TAG = "py3-none-any"


def setuptools_makes_wheels() -> bool:
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        return False
    return True


# ---- the hooks: setuptools' where it makes wheels, ours where it does not --------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    # setuptools < 70.1 asks for `wheel` here, which a build without isolation cannot install
    return _setuptools.get_requires_for_build_wheel(config_settings) if setuptools_makes_wheels() else []


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) if setuptools_makes_wheels() else []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    if setuptools_makes_wheels():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
    with tempfile.TemporaryDirectory() as tmp:
        return _dist_info(Path(tmp), Path(metadata_directory)).name


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    if setuptools_makes_wheels():
        return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if setuptools_makes_wheels():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "lib"
        _setup_py("build_py", "--build-lib", str(lib))
        info = _dist_info(Path(tmp), lib)
        return _write_wheel(Path(wheel_directory), lib, info)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    if setuptools_makes_wheels():
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "lib"
        lib.mkdir()
        info = _dist_info(Path(tmp), lib)
        _editable_finder(lib, info.name.split("-")[0])
        return _write_wheel(Path(wheel_directory), lib, info)


# ---- our wheel ----------------------------------------------------------------------------------------------------

def _setup_py(*args: str) -> None:
    """setup.py in a child process: the hooks run with the project as the working directory (PEP 517)."""
    r = subprocess.run([sys.executable, "setup.py", "-q", *args], capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"`setup.py {' '.join(args)}` failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def _dist_info(tmp: Path, into: Path) -> Path:
    """The .dist-info of the wheel from what `egg_info` writes: PKG-INFO with requires.txt's requirements as
    Requires-Dist (setuptools < 70 keeps them apart), and the entry points."""
    _setup_py("egg_info", "--egg-base", str(tmp))
    egg = next(tmp.glob("*.egg-info"))
    headers, _, body = (egg / "PKG-INFO").read_text(encoding="utf-8").partition("\n\n")
    fields = dict(line.split(": ", 1) for line in headers.splitlines() if ": " in line)
    lines = [h for h in headers.splitlines() if not h.startswith("Requires-Dist:")]
    lines += [f"Requires-Dist: {r}" for r in _requires_dist(egg / "requires.txt")]
    name = re.sub(r"[-_.]+", "_", fields["Name"]).lower()
    info = into / f"{name}-{fields['Version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("\n".join(lines) + "\n\n" + body, encoding="utf-8")
    for kept in ("entry_points.txt", "top_level.txt"):
        if (egg / kept).exists():
            shutil.copy2(egg / kept, info / kept)
    (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nGenerator: flagdeploy build_backend\nRoot-Is-Purelib: true\n"
                                f"Tag: {TAG}\n", encoding="utf-8")
    return info


def _requires_dist(requires_txt: Path) -> list[str]:
    """requires.txt's sections (`[extra]`, `[extra:marker]`, `[:marker]`) as PEP 508 requirements with markers."""
    out, marker = [], ""
    if not requires_txt.exists():
        return out
    for line in requires_txt.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("["):
            extra, _, env = line[1:-1].partition(":")
            compound = " and " in env or " or " in env
            parts = [f"({env})" if compound and extra else env] if env else []
            parts += [f'extra == "{extra}"'] if extra else []
            marker = " and ".join(parts)
            continue
        out.append(f"{line}; {marker}" if marker else line)
    return out


def _editable_finder(lib: Path, name: str) -> None:
    """An editable install of a tree whose one import namespace spans several folders (setup.py's ROOTS): a .pth
    runs a finder that maps each root import name to its folder in this checkout; below the roots, imports take
    the folders' own paths, so an edit shows without a reinstall."""
    import runpy

    roots = {mod: str(Path(folder).resolve()) for mod, folder in runpy.run_path("setup.py")["ROOTS"].items()}
    (lib / f"__editable___{name}_finder.py").write_text(f'''"""Maps {name}'s import roots to the checkout."""
import importlib.machinery
import importlib.util
import os
import sys

ROOTS = {roots!r}


class Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = ROOTS.get(fullname)
        if folder is None:
            return None
        init = os.path.join(folder, "__init__.py")
        if os.path.exists(init):
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [folder]
        return spec


def install():
    if not any(f is Finder for f in sys.meta_path):
        sys.meta_path.insert(0, Finder)
''', encoding="utf-8")
    (lib / f"__editable__.{name}.pth").write_text(f"import __editable___{name}_finder; "
                                                  f"__editable___{name}_finder.install()\n", encoding="utf-8")


def _write_wheel(wheel_directory: Path, lib: Path, info: Path) -> str:
    """Zip `lib` (the packages and the .dist-info in it) with a RECORD; written beside its final name, then
    renamed, so that a failed build leaves no wheel behind."""
    wheel_name = f"{info.name[:-len('.dist-info')]}-{TAG}.whl"
    files = sorted(p for p in lib.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    record = []
    wheel_directory.mkdir(parents=True, exist_ok=True)
    part = wheel_directory / f".{wheel_name}.part"
    with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            arc = p.relative_to(lib).as_posix()
            data = p.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
            z.writestr(_entry(arc), data, zipfile.ZIP_DEFLATED)
        record_name = f"{info.name}/RECORD"
        z.writestr(_entry(record_name), "\n".join(record + [f"{record_name},,"]) + "\n", zipfile.ZIP_DEFLATED)
    os.replace(part, wheel_directory / wheel_name)
    return wheel_name


def _entry(name: str) -> zipfile.ZipInfo:
    """A fixed date (the same bytes from the same tree) and rw-r--r-- (installers keep the archive's modes)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    return info
