"""Image recipes (issue 50, part 2): `flagdeploy deploy image --chip X` writes a Dockerfile per stack of the matrix,
and the other deploy kinds run the image given with --image. No container engine runs here, so the recipes are
checked statically: parsed into instructions, each base pinned (exact tag or digest, the matrix's where it has one),
the wheel built from this tree installed with the same pins `install --dry-run` names, a non-root user, the cache as
a volume, the entry point, no secrets; the entry script and the wheel build are run for real."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.chips import all_chips
from flagdeploy.cli import main
from flagdeploy.planner.profile import Profile
from installer import image as img
from installer.deploy import PLACEHOLDER_IMAGE, render
from installer.detect import chip_family
from installer.install import runtime_env
from installer.matrix import all_rows

ROOT = Path(__file__).resolve().parent.parent
COMMON = yaml.safe_load((ROOT / "installer" / "containers.yaml").read_text())["common"]
CACHE, USER = COMMON["container_cache"], COMMON["user"]
# The stacks that have a base image to start from; every other row of the matrix is refused with what is missing.
WITH_RECIPE = {("cpu", "builtin"), ("cpu", "onnxruntime"), ("sm90", "builtin"), ("sm90", "vllm"), ("sm80", "builtin"),
               ("sm89", "builtin"), ("A2", "builtin"),
               ("A3", "builtin"), ("950", "builtin"), ("A2", "vllm-ascend"), ("A3", "vllm-ascend"),
               ("950", "vllm-ascend"), ("310P", "vllm-ascend"),
               # the generic backend's families: no published base, python image + the vendor's index (images.yaml)
               *((f, "builtin") for f in ("metax", "iluvatar", "hygon", "kunlunxin", "mthreads", "cambricon", "enflame"))}
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.I)
SECRET_TEXT = re.compile(r"hf_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|-----BEGIN|://[^/\s:@]+:[^/\s@]+@|--api-key|"
                         r"password\s*=|token\s*=", re.I)


# ---- a tiny Dockerfile parser ----------------------------------------------------------------------------------

def parse(text: str) -> list[list[tuple[str, str]]]:
    """Stages of (INSTRUCTION, arguments): comment lines dropped (inside a continuation too, as Docker does),
    lines ending in a backslash joined with the next."""
    stages: list[list[tuple[str, str]]] = []
    buf = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        instr, _, args = (buf + line).strip().partition(" ")
        buf = ""
        if instr.upper() == "FROM":
            stages.append([])
        assert stages, f"{instr} before any FROM"
        stages[-1].append((instr.upper(), args.strip()))
    assert not buf, "the file ends inside a continuation"
    return stages


def args_of(stage, instr: str) -> list[str]:
    return [a for i, a in stage if i == instr]


def pip_installs(stage) -> list[list[str]]:
    """argv of every `python3 -m pip install ...` in the stage's RUN lines (one RUN may chain several with &&)."""
    out = []
    for run in args_of(stage, "RUN"):
        part: list[str] = []
        for token in [*shlex.split(run), "&&"]:
            if token not in ("&&", "||"):
                part.append(token)
                continue
            if part[:4] == ["python3", "-m", "pip", "install"]:
                out.append(part[4:])
            part = []
    return out


def a_chip(family: str, engine: str) -> str:
    """A catalog chip of the family whose `install` goes to this engine when asked for it."""
    return next(c.id for c in all_chips() if chip_family(c.id) == family)


ROWS = [(r.family, r.engine) for r in all_rows()]


# ---- every stack of the matrix: a recipe, or a refusal naming what is missing --------------------------------

def test_the_rows_with_recipes_are_the_ones_with_a_documented_base():
    assert WITH_RECIPE <= set(ROWS)
    entries = [(str(r["family"]), r["engine"]) for r in img._data()["recipes"]]
    assert sorted(entries) == sorted(WITH_RECIPE)  # one entry per stack, none for a row the matrix lacks
    for family in {f for f, _ in ROWS} - {"310B"}:  # 310B: no CANN image for the edge SoC in the sources
        assert any(f == family for f, _ in WITH_RECIPE), family


@pytest.mark.parametrize("family,engine", ROWS, ids=[f"{f}-{e}" for f, e in ROWS])
def test_every_matrix_stack_gets_a_recipe_or_a_clear_refusal(family, engine):
    chip = a_chip(family, engine)
    if (family, engine) not in WITH_RECIPE:
        refusal = rf"no image recipe for {chip} \({family}\) with engine {engine}"
        with pytest.raises(img.ImageRecipeError, match=refusal):
            img.recipe(chip, engine)
        return
    rec = img.recipe(chip, engine)
    assert (rec.row.family, rec.row.engine) == (family, engine)
    check_recipe(rec, chip)


def check_recipe(rec: img.Recipe, chip: str) -> None:
    text = rec.files["Dockerfile"]
    stages = parse(text)
    builder, final = stages[0], stages[-1]
    row = rec.row
    # Every base pinned by exact tag or digest; the final one the matrix's image where the row has one.
    for stage in stages:
        ref = stage[0][1].split()[0]
        assert img.exact_ref(ref) and not ref.endswith(":latest"), ref
    assert final[0][1] == (row.image or rec.base)
    if row.image:
        assert rec.base == row.image
    # Stage 1 builds the wheel from the tree; stage 2 installs that wheel with the stack's pins.
    assert any("pip wheel --no-cache-dir --no-deps" in r for r in args_of(builder, "RUN"))
    assert f"--from=wheel {img.WHEELS}/ {img.WHEELS}/" in args_of(final, "COPY")
    (wheel_line,) = [a for a in pip_installs(final) if f"{img.WHEELS}/flagdeploy-*.whl" in a]
    stack = [r for r in row.requirements() if r != "flagdeploy"]
    assert set(stack) <= set(wheel_line), (stack, wheel_line)
    # The non-root user owns the cache, which is a volume; the variables agree with the deploy files.
    user = args_of(final, "USER")[-1]
    assert user == f"{USER['uid']}:{USER['gid']}" and not user.startswith(("0", "root"))
    assert CACHE.startswith(USER["home"] + "/")
    assert args_of(final, "VOLUME") == [f'["{CACHE}"]']
    env = dict(kv.split("=", 1) for e in args_of(final, "ENV") for kv in shlex.split(e))
    assert env["FLAGDEPLOY_CACHE"] == CACHE and env["HOME"] == USER["home"]
    sources, variables = runtime_env(img.get_chip(chip).backend)  # what `install`'s environment file sets
    assert variables.items() <= env.items()
    assert args_of(final, "ENTRYPOINT") == ['["flagdeploy"]']
    assert args_of(final, "CMD")[0].startswith('["serve"') and args_of(final, "EXPOSE") == ["8000"]
    script = entry_script(final)
    assert all(s in script[2] for s in sources) if sources else not any("set_env" in s for s in script)
    # Every RUN is valid for the /bin/sh that runs it (Debian's and Ubuntu's: dash, POSIX; syntax only).
    for run in args_of(builder, "RUN") + args_of(final, "RUN"):
        out = subprocess.run(["sh", "-n", "-c", run], capture_output=True, text=True)
        assert out.returncode == 0, (run, out.stderr)
    # Nothing secret: no such variable or argument, no credentials in a URL.
    names = [kv.split("=", 1)[0] for e in args_of(final, "ENV") + args_of(final, "ARG") for kv in shlex.split(e)]
    assert not [n for n in names if SECRET_NAME.search(n)]
    assert not SECRET_TEXT.search(text)
    # The header says what is not confirmed, and that nothing was built here.
    unsure = row.unconfirmed or img._spec(row.family, row.engine).get("unconfirmed")
    assert ("UNCONFIRMED" in text) == bool(unsure)
    assert "Not built where flagdeploy is developed" in text
    # The stack the header names is the one installed.
    assert " ".join(stack) in text.splitlines()[1]


def entry_script(final) -> list[str]:
    (run,) = [r for r in args_of(final, "RUN") if "command -v flagdeploy" in r]
    argv = shlex.split(run)
    return argv[argv.index("%s\\n") + 1:argv.index(">")]


@pytest.mark.parametrize("chip,engine,family", [("ascend910c", None, "A3"), ("ascend910b4", "vllm-ascend", "A2"),
                                               ("h20", None, "sm90"), ("cpu-edge", None, "cpu"), ("cpu", None, "cpu")])
def test_the_recipe_uses_the_same_stack_as_install_dry_run(chip, engine, family):
    """The CLI's own plan: the same row (family, engine) and every package it would install is in the recipe."""
    rec = img.recipe(chip, engine)
    r = CliRunner().invoke(main, ["install", "--chip", chip, "--dry-run", *(["--engine", engine] if engine else [])])
    assert r.exit_code == 0, r.output
    assert f"chip {chip} ({family}), engine {rec.row.engine};" in r.output
    to_install = [line.split()[1] for line in r.output.splitlines() if line.startswith("  install   ")
                  and line.split()[1] != "nothing:"]
    (wheel_line,) = [a for a in pip_installs(parse(rec.files["Dockerfile"])[-1]) if any("flagdeploy-" in x for x in a)]
    assert set(to_install) - {"flagdeploy"} <= set(wheel_line)


def test_cpu_recipe_takes_torch_from_the_cpu_index_and_has_a_compiler():
    final = parse(img.recipe("cpu").files["Dockerfile"])[-1]
    assert final[0][1].startswith("python:3.11.") and "-slim" in final[0][1]
    cpu_torch = ["--no-cache-dir", "--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    assert cpu_torch in pip_installs(final)
    assert any("apt-get install -y --no-install-recommends g++" in r for r in args_of(final, "RUN"))


def test_engine_images_are_checked_not_reinstalled():
    """vLLM-Ascend's image carries a build for one SoC: the recipe checks its versions offline and never lets pip
    fetch another build; flagdeploy's wheel is installed with the same pins, so the resolver cannot move them."""
    rec = img.recipe("ascend910c", "vllm-ascend")
    final = parse(rec.files["Dockerfile"])[-1]
    assert final[0][1] == "quay.io/ascend/vllm-ascend:v0.23.0-a3"
    check, install = pip_installs(final)
    assert check[:3] == ["--no-cache-dir", "--no-index", "--no-deps"]
    assert set(check[3:]) == {"torch==2.10.0", "torch-npu==2.10.0.post4", "triton-ascend==3.2.2", "vllm==0.23.0",
                              "vllm-ascend==0.23.0"}
    assert set(check[3:]) <= set(install)
    assert args_of(final, "CMD") == ['["serve", "--engine", "vllm-ascend", "--host", "0.0.0.0"]']
    assert rec.tag == "flagdeploy:0.1.0-a3-vllm-ascend"


def test_unknown_stacks_are_refused_with_what_is_missing():
    with pytest.raises(img.ImageRecipeError, match=r"image: null.*Recipes for 310P: --engine vllm-ascend"):
        img.recipe("ascend310p")
    with pytest.raises(img.ImageRecipeError, match=r"images.yaml has no recipe for its image quay.io/kunlun/.*"
                                                   r"Recipes for kunlunxin: --engine builtin"):
        img.recipe("p800", "vllm")  # the vendor's vLLM image is run as it is (deploy --engine vllm), not rebuilt
    with pytest.raises(img.ImageRecipeError, match=r"No stack of 310B has a recipe"):
        img.recipe("ascend310b")


def test_pinned_references():
    assert img.exact_ref("python:3.11.13-slim-bookworm") and img.exact_ref("quay.io/ascend/vllm-ascend:v0.23.0-a3")
    assert img.exact_ref("registry:5000/x/y:1.2.3") and img.exact_ref("x/y@sha256:" + "a" * 64)
    for ref in ("python:3.11-slim", "python:latest", "python", "registry:5000/x/y", "x/y@sha256:abc"):
        assert not img.exact_ref(ref), ref


# ---- the entry point and the wheel, run for real --------------------------------------------------------------

def test_entry_script_runs_flagdeploy_with_or_without_a_leading_flagdeploy(tmp_path):
    """The deploy files run `flagdeploy serve ...` (Kubernetes' command replaces the entry point; docker and
    compose pass it as arguments to it): both reach `python3 -m flagdeploy serve ...`, after the vendor's env."""
    script = entry_script(parse(img.recipe("ascend910c").files["Dockerfile"])[-1])
    assert script[0] == "#!/bin/bash" and script[-1] == 'exec python3 -m flagdeploy "$@"'
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python3"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    entry = tmp_path / "flagdeploy"
    entry.write_text("\n".join(script) + "\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    for argv in (["flagdeploy", "serve", "--profile", "/p.yaml"], ["serve", "--profile", "/p.yaml"]):
        out = subprocess.run(["bash", str(entry), *argv], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.split() == ["-m", "flagdeploy", "serve", "--profile", "/p.yaml"]


def test_the_builder_copies_everything_setup_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = set(runpy.run_path(str(ROOT / "setup.py"))["ROOTS"].values())
    tree = img._data()["builder"]["tree"]
    backend = project["build-system"]  # the in-tree backend pyproject.toml names (backend-path)
    recipe = {f"{backend['build-backend']}.py"} if backend.get("backend-path") == ["."] else set()
    assert set(tree) == dirs | recipe | {"pyproject.toml", "setup.py", project["project"]["readme"]}


def test_the_builder_stage_builds_a_wheel_from_what_it_copies(tmp_path):
    """The builder's COPY lines, replayed into an empty folder, are enough for its `pip wheel` line (which needs
    setuptools from the index: skipped when that cannot be reached)."""
    builder = parse(img.recipe("cpu").files["Dockerfile"])[0]
    src = tmp_path / "src"
    src.mkdir()
    for copy in args_of(builder, "COPY"):
        *paths, dest = copy.split()
        for p in paths:
            target = src / (p if dest == "./" else dest)
            subprocess.run(["cp", "-r", str(ROOT / p), str(target)], check=True)
    (run,) = args_of(builder, "RUN")
    argv = shlex.split(run)
    argv = [sys.executable if a == "python" else str(tmp_path / "wheels") if a == img.WHEELS else a for a in argv]
    out = subprocess.run(argv, cwd=src, capture_output=True, text=True, timeout=300)
    if out.returncode and re.search(r"(?i)connection|network|resolve|index|find a version", out.stdout + out.stderr):
        pytest.skip(f"no package index here for the build backend: {(out.stdout + out.stderr)[-300:]}")
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "wheels").glob("flagdeploy-*.whl")
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True).stdout
    assert "flagdeploy/installer/images.yaml" in names and "flagdeploy/installer/matrix.yaml" in names


# ---- writing it, from the tree or from a wheel ----------------------------------------------------------------

def test_write_is_atomic_refuses_overwrite_and_names_the_build(tmp_path):
    rec = img.recipe("cpu")
    paths = img.write(rec, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["Dockerfile", "Dockerfile.dockerignore"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["Dockerfile", "Dockerfile.dockerignore"]
    ignore = (tmp_path / "out" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "**/.env"} <= set(ignore)
    with pytest.raises(FileExistsError):
        img.write(img.recipe("h200"), tmp_path / "out")
    assert (tmp_path / "out" / "Dockerfile").read_text() == rec.files["Dockerfile"]
    img.write(img.recipe("h200"), tmp_path / "out", overwrite=True)
    assert "nvidia/cuda:" in (tmp_path / "out" / "Dockerfile").read_text()
    assert rec.build_command(tmp_path / "out") == (f"docker build -f {tmp_path / 'out' / 'Dockerfile'} "
                                                   f"-t flagdeploy:0.1.0-cpu {ROOT}")


def test_a_given_wheel_is_copied_and_becomes_the_context(tmp_path):
    wheel = tmp_path / "flagdeploy-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    rec = img.recipe("ascend910b", wheel=wheel)
    stages = parse(rec.files["Dockerfile"])
    assert len(stages) == 1  # no builder: the wheel is given
    assert args_of(stages[0], "COPY") == [f"{wheel.name} {img.WHEELS}/"]
    out = tmp_path / "ctx"
    img.write(rec, out)
    assert (out / wheel.name).read_bytes() == wheel.read_bytes()
    assert rec.build_command(out).endswith(f"-t flagdeploy:0.1.0-a2 {out}")
    with pytest.raises(img.ImageRecipeError, match="not a flagdeploy wheel"):
        bad = tmp_path / "other-1.0-py3-none-any.whl"
        bad.write_bytes(b"x")
        img.recipe("cpu", wheel=bad)


def test_without_a_source_tree_it_asks_for_a_wheel(monkeypatch):
    monkeypatch.setattr(img, "source_tree", lambda: None)
    with pytest.raises(img.ImageRecipeError, match=r"installed wheel.*--wheel PATH"):
        img.recipe("cpu")
    monkeypatch.undo()
    assert img.source_tree() == ROOT  # found from this editable install


# ---- the CLI ------------------------------------------------------------------------------------------------

def test_cli_deploy_image_writes_the_recipe_and_prints_the_build_command(tmp_path):
    r = CliRunner().invoke(main, ["deploy", "image", "--chip", "ascend910c", "--engine", "vllm-ascend",
                                  "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert f"wrote {tmp_path / 'Dockerfile'}" in r.output
    build = [line for line in r.output.splitlines() if line.startswith("build it with: ")]
    assert build == [f"build it with: docker build -f {tmp_path / 'Dockerfile'} -t flagdeploy:0.1.0-a3-vllm-ascend "
                     f"{ROOT}"]
    assert "warning: not backed by a stored source yet: matrix image" in r.output
    r = CliRunner().invoke(main, ["deploy", "image", "--chip", "ascend910c", "-o", str(tmp_path)])
    assert r.exit_code == 1 and "refusing to overwrite" in r.output
    r = CliRunner().invoke(main, ["deploy", "image", "--chip", "cpu", "--model", "x", "-o", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--model belong to docker/compose/k8s" in r.output
    r = CliRunner().invoke(main, ["deploy", "docker", "--chip", "cpu", "--model", "x", "--wheel", __file__])
    assert r.exit_code == 2 and "options of `deploy image`" in r.output
    r = CliRunner().invoke(main, ["deploy", "image", "-o", str(tmp_path / "c")])
    assert r.exit_code == 2 and "give --chip" in r.output
    r = CliRunner().invoke(main, ["deploy", "image", "--chip", "ascend310p", "-o", str(tmp_path / "d")])
    assert r.exit_code == 1 and "Recipes for 310P: --engine vllm-ascend" in r.output
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


@pytest.mark.parametrize("kind,name", [("docker", "run.sh"), ("compose", "compose.yaml"), ("k8s", "deployment.yaml")])
def test_cli_deploy_takes_image_ref_and_warns_on_the_placeholder(tmp_path, kind, name):
    ref = "registry.example/flagdeploy@sha256:" + "0" * 64
    args = ["deploy", kind, "--chip", "cpu", "--model", "smollm2-135m-instruct"]
    r = CliRunner().invoke(main, [*args, "--image", ref, "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "a" / name).read_text()
    assert ref in text and PLACEHOLDER_IMAGE not in text and "warning" not in r.output
    r = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert PLACEHOLDER_IMAGE in (tmp_path / "b" / name).read_text()
    assert (f"warning: no --image given: the files name the placeholder {PLACEHOLDER_IMAGE}; build an image with "
            "`flagdeploy deploy image --chip cpu`") in r.output


def test_the_deploy_files_mount_the_cache_where_the_image_has_its_volume():
    profile = Profile(model="smollm2-135m-instruct", chip="cpu", port=8000)
    final = parse(img.recipe("cpu").files["Dockerfile"])[-1]
    (volume,) = args_of(final, "VOLUME")
    run_sh = render("docker", profile, cache_dir="/srv/models")["run.sh"]
    assert f"/srv/models:{CACHE}" in run_sh and f"FLAGDEPLOY_CACHE={CACHE}" in run_sh and CACHE in volume
    (svc,) = yaml.safe_load(render("compose", profile)["compose.yaml"])["services"].values()
    assert f"/var/cache/flagdeploy:{CACHE}" in svc["volumes"] and svc["environment"]["FLAGDEPLOY_CACHE"] == CACHE
    docs = {d["kind"]: d for d in yaml.safe_load_all(render("k8s", profile)["deployment.yaml"])}
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "cache", "mountPath": CACHE} in c["volumeMounts"]


def test_the_tree_ignores_what_the_recipe_ignores_and_keeps_what_it_copies():
    lines = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert tuple(lines) == img.IGNORE
    assert not set(img._data()["builder"]["tree"]) & set(img.IGNORE)


def test_the_docs_name_every_base_and_say_nothing_was_built():
    doc = (ROOT / "docs" / "images.md").read_text()
    assert "No image was built from these recipes" in doc
    for family, engine in sorted(WITH_RECIPE):
        base = img.recipe(a_chip(family, engine), engine).base
        short = base if base in doc else base.split(":")[0] + ":" + base.split(":")[1].split("-")[0]
        assert short in doc, base
    readme = (ROOT / "README.md").read_text()
    assert "`flagdeploy deploy image --chip X" in readme


def test_the_offline_stack_check_passes_only_on_exactly_the_pinned_versions():
    """The engine images' check, with this interpreter standing in for the image's: its flags (no index, no deps)
    accept installed versions that meet the pins, a local build label included (2.13.0+cpu for torch==2.13.0),
    and fail, changing nothing, on any other."""
    import torch

    final = parse(img.recipe("ascend910c", "vllm-ascend").files["Dockerfile"])[-1]
    flags = pip_installs(final)[0][:3]
    assert flags == ["--no-cache-dir", "--no-index", "--no-deps"]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    public = torch.__version__.split("+")[0]
    for pins, ok in (([f"torch=={public}", "pyyaml>=5"], True),
                     ([f"torch=={public}", "torch-npu==2.10.0.post4"], False), (["torch==0.0.1"], False)):
        out = subprocess.run([sys.executable, "-m", "pip", "install", *flags, *pins], capture_output=True, text=True,
                             env=env, timeout=120)
        assert (out.returncode == 0) == ok, out.stdout + out.stderr
