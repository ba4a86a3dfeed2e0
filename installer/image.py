"""`flagdeploy deploy image --chip X`: a Dockerfile that builds the image the other deploy kinds run.

One recipe per stack of the compatibility matrix that has a base to start from (images.yaml, next to this file):
the base is the matrix row's `image` (the CANN or vLLM-Ascend image, vLLM's own) or, where the row has none, the
recipe's own exact tag; the Python packages are the row's pins, the same `install --dry-run` prints. Stage 1 builds
flagdeploy's wheel from this source tree (`pip wheel --no-deps`), or the recipe copies a wheel given with --wheel;
stage 2 installs it with the stack, as a non-root user whose cache directory is a volume.

A stack whose base image sits on the engine (vLLM, vLLM-Ascend: their images carry SoC- or CUDA-specific builds)
is checked in the build, not reinstalled: `pip install --no-index --no-deps <pins>` succeeds only when the base
already has exactly those versions. A row with no documented base is refused with what is missing.

The recipes are tested statically (tests/test_image.py); no image is built where flagdeploy is developed.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import SpecifierSet

from flagdeploy import __version__
from flagdeploy.chips import get_chip
from flagdeploy.errors import FlagdeployError

from .atomic import write_set
from .detect import chip_family
from .install import runtime_env
from .matrix import StackRow, engines_for, resolve

__all__ = ["DATA", "ImageRecipeError", "Recipe", "exact_ref", "recipe", "source_tree", "write"]

DATA = Path(__file__).with_name("images.yaml")
CONTAINERS = Path(__file__).with_name("containers.yaml")
WHEELS = "/tmp/flagdeploy-wheels"
VENDOR_INDEX_ARG = "VENDOR_INDEX_URL"  # the build argument naming the chip vendor's pip index
PORT = 8000  # `flagdeploy serve --port`'s default
# A tag that names one build: a full x.y.z version in it (3.11.13-slim-bookworm, v0.23.0-a3), never `latest` or a
# bare major/minor (3.11-slim moves with every patch release); or a digest.
_EXACT_TAG = re.compile(r".*\d+\.\d+\.\d+.*")
_DIGEST = re.compile(r".+@sha256:[0-9a-f]{64}")
_WHEEL = re.compile(r"flagdeploy-[0-9][^-]*-[^-]+-[^-]+-[^-]+\.whl")


class ImageRecipeError(FlagdeployError):
    """No recipe for this chip and engine, or a bad --wheel; the message says what is missing."""


@functools.cache
def _data() -> dict[str, Any]:
    return yaml.safe_load(DATA.read_text())


@functools.cache
def _common() -> dict[str, Any]:
    return yaml.safe_load(CONTAINERS.read_text())["common"]


def exact_ref(ref: str) -> bool:
    """Whether an image reference names one build: a digest, or a tag with a full version that is not latest."""
    if _DIGEST.fullmatch(ref):
        return True
    name, _, tag = ref.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and bool(_EXACT_TAG.fullmatch(tag))


def source_tree() -> Path | None:
    """The flagdeploy source tree this code runs from (an editable install or a checkout), or None when it runs
    from an installed wheel: the tree's root holds pyproject.toml naming the project, next to flagdeploy/."""
    root = Path(__file__).resolve().parent.parent
    project = root / "pyproject.toml"
    if project.is_file() and (root / "flagdeploy").is_dir() and re.search(r'(?m)^name\s*=\s*"flagdeploy"',
                                                                          project.read_text()):
        return root
    return None


@dataclass
class Recipe:
    """What `deploy image` writes and prints."""

    chip: str
    row: StackRow
    base: str
    tag: str  # e.g. flagdeploy:0.1.0-a3 or flagdeploy:0.1.0-a3-vllm-ascend
    context: Path | None  # the build context: the source tree; None with a wheel (the output directory is)
    files: dict[str, str]  # name -> text, written into the output directory
    wheel: Path | None = None  # copied into the output directory (the context) when given
    unconfirmed: list[str] = field(default_factory=list)
    build_args: dict[str, str] = field(default_factory=dict)  # what `docker build` must be given (--build-arg)

    def build_command(self, out_dir: str | Path) -> str:
        dockerfile = Path(out_dir) / "Dockerfile"
        context = self.context or Path(out_dir)
        args = "".join(f" --build-arg {k}={shlex.quote(v)}" for k, v in self.build_args.items())
        return (f"docker build -f {shlex.quote(str(dockerfile))}{args} -t {shlex.quote(self.tag)} "
                f"{shlex.quote(str(context))}")


def _spec(family: str, engine: str) -> dict[str, Any] | None:
    return next((r for r in _data()["recipes"] if str(r["family"]) == family and r["engine"] == engine), None)


def _refuse(chip_id: str, row: StackRow) -> ImageRecipeError:
    have = [e for e in engines_for(row.family) if _spec(row.family, e)]
    what = (f"matrix.yaml names no base image for it (image: null)" if row.image is None
            else f"images.yaml has no recipe for its image {row.image}")
    unsure = f"; not backed by a source: {', '.join(row.unconfirmed)}" if row.unconfirmed else ""
    other = (f" Recipes for {row.family}: --engine {' / '.join(have)}." if have
             else f" No stack of {row.family} has a recipe.")
    return ImageRecipeError(
        f"no image recipe for {chip_id} ({row.family}) with engine {row.engine}: {what}, and none is documented in "
        f"the stored sources{unsure}.{other} Otherwise start from a recipe of another chip and put a base image "
        f"with this stack in its FROM yourself (pinned by exact tag or digest), or install on the host: "
        f"`flagdeploy install --chip {chip_id} --engine {row.engine}`.")


def recipe(chip_id: str, engine: str | None = None, *, wheel: str | Path | None = None) -> Recipe:
    """The recipe for a catalog chip and engine (default: builtin, or the chip's edge engine, as `install`)."""
    chip = get_chip(chip_id)
    if engine in (None, "builtin"):
        from flagdeploy.edge import edge_info

        engine = edge_info(chip.id).get("engine", "builtin")
    family = chip_family(chip.id)
    if family is None:
        raise ImageRecipeError(f"the installer has no stack for {chip.id} ({chip.vendor}), so there is no image recipe "
                               "for it; recipes follow installer/matrix.yaml (`flagdeploy install --dry-run --chip "
                               f"{chip.id}` says the same).")
    row = resolve(family, engine)
    spec = _spec(row.family, row.engine)
    if spec is None:
        raise _refuse(chip.id, row)
    base = row.image or spec.get("base")
    if not base or (row.image and spec.get("base") and spec["base"] != row.image):
        raise ValueError(f"{DATA.name}: {row.family}/{row.engine} must take the matrix's image ({row.image}) or, "
                         "where the matrix has none, name its own base")
    if not exact_ref(base):
        raise ValueError(f"{DATA.name}: base {base} of {row.family}/{row.engine} is not pinned (exact tag or digest)")
    if not SpecifierSet(row.python).contains(str(spec["base_python"]) + ".0"):
        raise ValueError(f"{DATA.name}: {base} has Python {spec['base_python']}, outside the row's {row.python}")
    wheel_path = _check_wheel(wheel) if wheel is not None else None
    tree = source_tree()
    if wheel_path is None and tree is None:
        raise ImageRecipeError(
            "this flagdeploy runs from an installed wheel, not from its source tree, so there is nothing to build the "
            "image's flagdeploy from: pass --wheel PATH (a flagdeploy wheel: `pip wheel --no-deps <source tree>` or "
            "`pip download --no-deps flagdeploy`), or run `flagdeploy deploy image` from a checkout "
            "(`pip install -e <checkout>`).")
    suffix = row.family.lower() + ("" if row.engine == "builtin" else f"-{row.engine}")
    unconfirmed = [f"matrix {f}" for f in row.unconfirmed] + [f"recipe {f}" for f in spec.get("unconfirmed", [])]
    # vendor builds (not on PyPI): from the vendor's pip index, the row's where a source names it, else given at build
    build_args = ({VENDOR_INDEX_ARG: row.vendor_index or "<vendor-index-url>"}
                  if spec.get("vendor_index") else {})
    rec = Recipe(chip=chip.id, row=row, base=base, tag=f"flagdeploy:{__version__}-{suffix}",
                 context=tree if wheel_path is None else None, files={}, wheel=wheel_path,
                 unconfirmed=unconfirmed, build_args=build_args)
    rec.files = {"Dockerfile": _dockerfile(rec, spec, chip.backend), "Dockerfile.dockerignore": _dockerignore()}
    return rec


def _check_wheel(wheel: str | Path) -> Path:
    path = Path(wheel)
    if not path.is_file():
        raise ImageRecipeError(f"--wheel {path}: no such file")
    if not _WHEEL.fullmatch(path.name):
        raise ImageRecipeError(f"--wheel {path}: not a flagdeploy wheel (expected "
                               "flagdeploy-<version>-py3-none-any.whl, as `pip wheel --no-deps <tree>` names it)")
    return path


def _pins(row: StackRow, spec: dict[str, Any]) -> list[str]:
    """The stack's pip requirements, flagdeploy itself aside (it is the wheel): the row's and the recipe's extras."""
    extra = spec.get("extra_packages") or {}
    return [f"{n}{s}" for n, s in {**extra, **row.packages}.items() if n != "flagdeploy"]


def _run(*lines: str) -> str:
    return "RUN " + " \\\n && ".join(lines)


def _entry_script(sources: list[str]) -> list[str]:
    """The `flagdeploy` command in the image: sources the vendor runtime's environment (a process started with
    `flagdeploy ...` by Kubernetes' `command` gets no shell to do it), drops a leading `flagdeploy` so that the
    deploy files' `flagdeploy serve ...` and `docker run IMAGE serve ...` both work, then runs the CLI."""
    lines = ["#!/bin/bash",
             "# flagdeploy in this image (written by `flagdeploy deploy image`): the vendor environment, then the CLI."]
    if sources:
        lines.append(f'for f in {" ".join(sources)}; do [ -f "$f" ] && . "$f"; done')
    lines += ['[ "${1:-}" = flagdeploy ] && shift', 'exec python3 -m flagdeploy "$@"']
    return lines


def _dockerfile(rec: Recipe, spec: dict[str, Any], backend: str) -> str:
    row, c, d = rec.row, _common(), _data()
    user = c["user"]
    home, cache, uid, gid = user["home"], c["container_cache"], user["uid"], user["gid"]
    q = shlex.quote
    pins = _pins(row, spec)
    sources, env = runtime_env(backend)
    build_args = "".join(f" --build-arg {k}={v}" for k, v in rec.build_args.items())
    build = (f"docker build -f <DIR>/Dockerfile{build_args} -t {rec.tag} "
             + ("<DIR>" if rec.wheel else "<flagdeploy source tree>"))
    engine_flag = "" if row.engine == "builtin" else f" --engine {row.engine}"
    head = [f"flagdeploy {__version__} for {row.family}, engine {row.engine}: written by `flagdeploy deploy image "
            f"--chip {rec.chip}{engine_flag}`.",
            f"Stack (installer/matrix.yaml, as `flagdeploy install --dry-run --chip {rec.chip}{engine_flag}` prints "
            "it): "
            f"{' '.join(pins) or 'none'} + flagdeploy; versions from: {row.source}",
            f"Base: {rec.base}, Python {spec['base_python']}; from: {spec['base_source']}."]
    if row.cann_min:
        head.append(f"CANN >= {row.cann_min} (in the base image); the host needs the matching Ascend driver.")
    if row.notes:
        head.append(f"Note: {row.notes}")
    if rec.build_args:
        head.append(f"Vendor builds ({', '.join(row.vendor_packages)}) are not on PyPI: they come from the pip index "
                    f"given as --build-arg {VENDOR_INDEX_ARG}=URL; the build stops if it is empty. The vendor's "
                    "user-space runtime (driver libraries, SDK) is not in this base: put the vendor's SDK image "
                    "(pinned) in the final FROM line instead, or mount the runtime from the host.")
    if rec.unconfirmed:
        head.append(f"UNCONFIRMED (not backed by a stored source): {', '.join(rec.unconfirmed)}.")
    head += [f"Build: {build}",
             "Not built where flagdeploy is developed (no container engine there): checked statically only.",
             f"Runs as uid {uid} (not root); the model cache {cache} is a volume: a host directory mounted there",
             f"must be writable by uid {uid} (sudo install -d -o {uid} -g {gid} DIR)."]
    out = ["# " + line for line in head] + [""]
    if rec.wheel is None:
        b = d["builder"]
        out += [f"FROM {b['image']} AS wheel", "WORKDIR /src"]
        files = [p for p in b["tree"] if "." in p]
        out.append(f"COPY {' '.join(files)} ./")
        out += [f"COPY {p} ./{p}" for p in b["tree"] if p not in files]
        out += [f"RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir {WHEELS} .", ""]
    out += [f"FROM {rec.base}", "USER root", "ARG DEBIAN_FRONTEND=noninteractive"]
    if spec.get("apt"):
        out.append(_run("apt-get update",
                        f"apt-get install -y --no-install-recommends {' '.join(spec['apt'])}",
                        "rm -rf /var/lib/apt/lists/*"))
    pip = "python3 -m pip install --no-cache-dir"
    if rec.build_args:
        out.append(f"ARG {VENDOR_INDEX_ARG}=")
        out.append(_run(f'test -n "${VENDOR_INDEX_ARG}" || {{ echo "the vendor builds of this stack are not on PyPI: '
                        f'pass --build-arg {VENDOR_INDEX_ARG}=<the vendor pip index>" >&2; exit 1; }}'))
        pip += f' --extra-index-url "${VENDOR_INDEX_ARG}"'
    if spec["stack"] == "base":
        out.append(f"# The base carries the stack: check it has exactly the matrix's versions (no index: nothing is "
                   f"replaced).")
        out.append(_run(f"{pip} --no-index --no-deps {' '.join(map(q, pins))} || "
                        f"{{ echo 'base image {rec.base} lacks the stack of installer/matrix.yaml' >&2; exit 1; }}"))
    elif spec.get("torch_index") and any(p.startswith("torch=") for p in pins):
        torch = next(p for p in pins if p.startswith("torch="))
        out.append(f"# torch from {spec['torch_index']} (its CPU build), before anything can pull another build.")
        out.append(_run(f"{pip} --index-url {spec['torch_index']} {q(torch)}"))
    if rec.wheel is None:
        out.append(f"COPY --from=wheel {WHEELS}/ {WHEELS}/")
    else:
        out.append(f"COPY {rec.wheel.name} {WHEELS}/")
    out.append(_run(f"{pip} {WHEELS}/flagdeploy-*.whl {' '.join(map(q, pins))}", f"rm -rf {WHEELS}"))
    script = _entry_script(sources)
    # In place of pip's console script (or in /usr/local/bin where the base keeps its scripts off PATH).
    out.append("RUN f=\"$(command -v flagdeploy || echo /usr/local/bin/flagdeploy)\" && printf '%s\\n' \\\n    "
               + " \\\n    ".join(q(line) for line in script) + ' > "$f" && chmod 0755 "$f"')
    out.append(_run(f"(getent group {gid} >/dev/null || groupadd --gid {gid} {user['name']})",
                    f"(getent passwd {uid} >/dev/null || useradd --uid {uid} --gid {gid} --home-dir {home} "
                    f"--shell /bin/bash {user['name']})",
                    f"mkdir -p {cache}", f"chown -R {uid}:{gid} {home}"))
    envs = {"HOME": home, "FLAGDEPLOY_CACHE": cache, "PYTHONUNBUFFERED": "1", **env}
    out.append("ENV " + " \\\n    ".join(f"{k}={q(v)}" for k, v in envs.items()))
    out += [f"WORKDIR {home}", f'VOLUME ["{cache}"]', f"USER {uid}:{gid}", f"EXPOSE {PORT}",
            'ENTRYPOINT ["flagdeploy"]',
            "CMD [" + ", ".join(f'"{a}"' for a in spec.get("cmd") or ["serve", "--host", "0.0.0.0"]) + "]"]
    return "\n".join(out) + "\n"


# Kept out of the build context: what the wheel does not need, and files that may hold secrets. The tree's own
# .dockerignore (for the legacy builder) lists the same.
IGNORE = (".git", ".venv", "**/__pycache__", "**/*.pyc", "*.egg-info", "build", "dist", ".pytest_cache", "tests",
          "benchmarks", "docs", "**/.env", "**/*.pem", "**/*.key", "**/.netrc")


def _dockerignore() -> str:
    """BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile: keeps the context small and secrets out."""
    return "\n".join(["# beside the Dockerfile: BuildKit (docker >= 23) reads it for this Dockerfile's build context",
                      *IGNORE, ""])


def write(rec: Recipe, out_dir: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Write the recipe's files (and the wheel, when given) into out_dir as one set (atomic.write_set)."""
    files: dict[str, str | Path] = dict(rec.files)
    if rec.wheel is not None:
        files[rec.wheel.name] = rec.wheel
    return write_set(out_dir, files, overwrite=overwrite)
