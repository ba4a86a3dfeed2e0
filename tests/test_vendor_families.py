"""Issue 51 item 4, day 0 on the chips without a backend of their own (Cambricon, Kunlunxin, Hygon, MetaX, Moore
Threads, Iluvatar, Enflame): every catalog id gets a real answer from install --dry-run, doctor, plan, deploy and
ops list, and each of those vendors is detected from what the host shows: its tool (recorded, or a fake one on
PATH), its device nodes, its PCI functions.

Nothing here ran on those chips: the vendor facts (installer/vendors.yaml, containers.yaml, matrix.yaml) are data
with sources and `unconfirmed` lists, and these tests check that every command uses them and says so."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flagdeploy.chips import all_chips, get_chip
from flagdeploy.cli import main
from installer import install as inst
from installer import vendors
from installer.detect import PCI_VENDORS, chip_family, detect, pick_chip
from installer.matrix import resolve

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = Path(__file__).parent / "fixtures" / "systems"
CATALOG = [c.id for c in all_chips()]
VENDOR_CHIPS = [c.id for c in all_chips() if vendors.get(c.backend)]
FAMILIES = sorted(vendors.vendors())
SMALL = ["--model", "smollm2-135m-instruct", "--max-model-len", "4096"]  # fits every catalog chip, the 8 GB 310B too
CONTAINERS = yaml.safe_load((ROOT / "installer" / "containers.yaml").read_text())["vendors"]


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def chip_of(family: str) -> str:
    return next(c for c in VENDOR_CHIPS if get_chip(c).backend == family)


# ---- the data agrees with itself ----------------------------------------------------------------------------------


def test_the_seven_families_are_covered():
    assert set(FAMILIES) == {"cambricon", "kunlunxin", "hygon", "metax", "mthreads", "iluvatar", "enflame"}
    assert sorted(get_chip(c).backend for c in VENDOR_CHIPS) == FAMILIES  # one catalog chip each, today
    for family in FAMILIES:  # what a block calls unconfirmed is one of its own fields
        assert set(CONTAINERS[family]["unconfirmed"]) <= set(CONTAINERS[family]) - {"source", "unconfirmed"}


def test_a_container_with_only_the_shared_render_nodes_is_not_enough(tmp_path):
    """MetaX needs /dev/mxcd besides /dev/dri: a container given only /dev/dri (any GPU's) is named as lacking it."""
    chip = _host_with("metax", tmp_path, nodes=False, sdk=True, container=True)
    (tmp_path / "dev" / "dri").touch()
    r = cli("doctor", "--chip", chip, "--root", str(tmp_path))
    assert "MetaX device nodes missing inside this container: /dev/mxcd" in r.output, r.output


@pytest.mark.parametrize("family", FAMILIES)
def test_one_name_per_family_everywhere(family):
    """vendors.yaml, the chips' backend and vendor, the generic backend's families, the matrix, the container
    recipes and the image recipes all use the same family name; the tools agree where families.yaml names one."""
    from flagdeploy.backends.generic import families
    from installer import image as img

    v = vendors.get(family)
    for chip in (c for c in all_chips() if c.backend == family):
        assert chip.vendor == family and chip_family(chip.id) == family
    assert family in families() and family in CONTAINERS and family in set(PCI_VENDORS.values())
    assert families()[family]["tool"] in (None, v.tool)
    row = resolve(family, "builtin")
    assert row.source.startswith("FACTS") and "python" in row.unconfirmed and "flag-gems" in row.packages
    assert row.vendor_packages and "torch" in row.vendor_packages and "flag-gems" not in row.vendor_packages
    assert img._spec(family, "builtin")["vendor_index"] is True
    assert v.source and v.host and v.tool and (v.per_device or v.shared)


# ---- every catalog id through every command -----------------------------------------------------------------------


@pytest.mark.parametrize("chip", CATALOG)
def test_install_dry_run_prints_a_plan(chip):
    r = cli("install", "--chip", chip, "--dry-run", "--root", str(SYSTEMS / "cpu"))
    assert r.exit_code == 0, r.output
    assert f"chip {chip} (" in r.output and "versions from: " in r.output and "  install   " in r.output
    if chip in VENDOR_CHIPS:
        assert "(vendor build, not on PyPI)" in r.output and "--vendor-index-url URL" in r.output
        assert "nothing of this family ran on its silicon" in r.output
        assert "host      " in r.output and "flagdeploy cannot install it" in r.output  # the driver, at least


@pytest.mark.parametrize("chip", CATALOG)
def test_doctor_answers_with_findings(chip):
    r = cli("doctor", "--chip", chip, "--root", str(SYSTEMS / "cpu"))
    assert r.exit_code in (0, 1) and not r.output.startswith("error"), r.output
    assert r.output.startswith("found: 1 x cpu") and re.search(r"^\[(ok  |WARN|FAIL)\] ", r.output, re.M)
    if chip in VENDOR_CHIPS:
        v = vendors.get(get_chip(chip).backend)
        assert r.exit_code == 1 and f"no {v.name} device found for {chip}" in r.output
        assert f"{v.name}: these checks use " in r.output


@pytest.mark.parametrize("chip", CATALOG)
def test_plan_and_ops_list(chip):
    r = cli("plan", "--chip", chip, *SMALL)
    assert r.exit_code == 0, r.output
    r = cli("ops", "list", "--chip", chip)
    assert r.exit_code == 0 and r.output.startswith("backend: "), r.output
    if chip in VENDOR_CHIPS:
        assert r.output.startswith(f"backend: generic ({get_chip(chip).backend}, device ")


@pytest.mark.parametrize("chip", CATALOG)
def test_deploy_files_for_every_chip(chip, tmp_path):
    for kind, name in (("docker", "run.sh"), ("compose", "compose.yaml"), ("k8s", "deployment.yaml")):
        r = cli("deploy", kind, "--chip", chip, *SMALL, "-o", str(tmp_path / kind))
        assert r.exit_code == 0, r.output
        text = (tmp_path / kind / name).read_text()
        if chip in VENDOR_CHIPS:
            block = CONTAINERS[get_chip(chip).vendor]
            assert "are not confirmed by a stored source" in r.output and "# WARNING: " in text
            if kind == "k8s":
                assert block["k8s_resource"] in text
            else:
                for node in block["devices"]:
                    assert node in text
                if block["devices_per_index"]:
                    assert block["devices_per_index"][0].format(i=0) in text
                for group in block["group_add"]:
                    assert group in text


@pytest.mark.parametrize("chip", CATALOG)
def test_deploy_image_writes_a_recipe_or_says_why_not(chip, tmp_path):
    r = cli("deploy", "image", "--chip", chip, "-o", str(tmp_path))
    if r.exit_code:
        # a stack with no documented base: refused with what is missing and what to do instead
        assert chip not in VENDOR_CHIPS and f"no image recipe for {chip}" in r.output, r.output
        assert "flagdeploy install --chip" in r.output
        return
    assert "build it with: docker build" in r.output
    if chip in VENDOR_CHIPS:
        text = (tmp_path / "Dockerfile").read_text()
        assert "--build-arg VENDOR_INDEX_URL=" in r.output
        assert "none published" in text and "is not in this base" in text
        assert 'test -n "$VENDOR_INDEX_URL"' in text and '--extra-index-url "$VENDOR_INDEX_URL"' in text


# ---- detection from what the host shows --------------------------------------------------------------------------


def _node(pattern: str, i: int) -> str:
    """A device node name a glob of vendors.yaml matches: 'cambricon_dev[0-9]*' -> cambricon_dev<i>."""
    return pattern.replace("[0-9]*", str(i)).replace("*", str(i))


@pytest.mark.parametrize("family", [f for f in FAMILIES if vendors.get(f).per_device])
def test_detected_from_device_nodes(family, tmp_path):
    """Three device nodes, nothing else: three devices of the family, chip unnamed (a node does not say which of a
    vendor's chips it is), and a named chip of that family is accepted for install."""
    v = vendors.get(family)
    (tmp_path / "dev").mkdir()
    for i in range(3):
        (tmp_path / "dev" / _node(v.per_device[0], i)).touch()
    info = detect(tmp_path)
    (acc,) = info.accelerators
    assert (acc.vendor, acc.family, acc.chip, acc.count) == (family, family, None, 3)
    assert f"/dev/{_node(v.per_device[0], 2)}" in info.device_nodes
    assert pick_chip(info, chip_of(family)) == chip_of(family)
    r = cli("install", "--chip", chip_of(family), "--dry-run", "--root", str(tmp_path))
    assert r.exit_code == 0 and f"found: 3 x unknown {family} device ({family})" in r.output, r.output


@pytest.mark.parametrize("family", FAMILIES)
def test_detected_from_pci_functions(family, tmp_path):
    pci_id = next(k for k, name in PCI_VENDORS.items() if name == family)
    for i in range(2):
        dev = tmp_path / "sys/bus/pci/devices" / f"0000:0{i + 1}:00.0"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(pci_id + "\n")
        (dev / "class").write_text("0x120000\n")
        (dev / "device").write_text("0x0001\n")
    (acc,) = detect(tmp_path).accelerators
    assert (acc.family, acc.chip, acc.count) == (family, None, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_detected_from_the_recorded_tool(family, tmp_path):
    """A recorded system: the tool's output names the chip on two lines (its catalog id spelled the vendor's way,
    upper case with other punctuation): two devices of that chip, and the driver counts as present."""
    v, chip = vendors.get(family), chip_of(family)
    (tmp_path / ".commands").mkdir()
    spelled = chip.upper().replace("-", "_")
    (tmp_path / ".commands" / f"{v.tool}.txt").write_text(
        f"{v.name} tool\n  0  {spelled}  ok\n  1  {spelled}  ok\nend\n")
    info = detect(tmp_path)
    (acc,) = info.accelerators
    assert (acc.family, acc.chip, acc.count) == (family, chip, 2)
    assert info.vendor_tools[family] and info.vendor_host[family]["driver"]
    assert info.chips == [chip] and pick_chip(info, "auto") == chip


@pytest.mark.parametrize("family", FAMILIES)
def test_detected_from_a_fake_tool_on_path(family, tmp_path, monkeypatch):
    """The live host (root /): the vendor's tool is found on PATH and run; it names the chip on two lines."""
    v, chip = vendors.get(family), chip_of(family)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / v.tool
    tool.write_text(f"#!/bin/sh\necho '{v.name} management tool'\necho '0 {chip}'\necho '1 {chip}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    info = detect()
    found = [a for a in info.accelerators if a.family == family]
    assert found and found[0].chip == chip and info.vendor_tools[family]
    if not any(Path("/dev").glob(p) for p in v.per_device):  # this host has none of its nodes: counted by lines
        assert found[0].count >= 2


def _host_with(family: str, root: Path, *, nodes: bool, sdk: bool, container: bool) -> str:
    """A recorded host of `family`: the tool's output, optionally its device nodes, SDK paths and /.dockerenv."""
    v, chip = vendors.get(family), chip_of(family)
    (root / ".commands").mkdir(parents=True)
    (root / ".commands" / f"{v.tool}.txt").write_text(f"0 {chip}\n1 {chip}\n")
    (root / "dev").mkdir()
    if nodes:
        for pattern in v.shared:
            (root / "dev" / pattern).touch()
        for i in range(2):
            for pattern in v.per_device[:1]:
                (root / "dev" / _node(pattern, i)).touch()
    if sdk:
        for need in v.host:
            if need.present != "tool":
                (root / need.present).mkdir(parents=True)
    if container:
        (root / ".dockerenv").touch()
    return chip


@pytest.mark.parametrize("family", FAMILIES)
def test_doctor_names_the_missing_device_nodes_in_a_container(family, tmp_path):
    v = vendors.get(family)
    chip = _host_with(family, tmp_path / "bare", nodes=False, sdk=True, container=True)
    r = cli("doctor", "--chip", chip, "--root", str(tmp_path / "bare"))
    assert r.exit_code == 1 and f"{v.name} device nodes missing inside this container: /dev/" in r.output, r.output
    assert all(p in r.output for p in v.device_node_paths()) and f"deploy docker --chip {chip}" in r.output
    _host_with(family, tmp_path / "ok", nodes=True, sdk=True, container=True)
    r = cli("doctor", "--chip", chip, "--root", str(tmp_path / "ok"))
    assert "device nodes missing" not in r.output and "device found" not in r.output and "not found (" not in r.output
    assert f"found: 2 x {chip} ({family})" in r.output


@pytest.mark.parametrize("family", [f for f in FAMILIES if any(n.present != "tool" for n in vendors.get(f).host)])
def test_doctor_and_install_name_the_missing_sdk(family, tmp_path):
    chip = _host_with(family, tmp_path, nodes=True, sdk=False, container=False)
    need = next(n for n in vendors.get(family).host if n.present != "tool")
    r = cli("doctor", "--chip", chip, "--root", str(tmp_path))
    assert f"{need.what}: not found (/{need.present} is missing)" in r.output and need.how in r.output
    r = cli("install", "--chip", chip, "--dry-run", "--root", str(tmp_path))
    assert f"host      {need.what} is missing" in r.output and "driver" not in r.output.split("host")[1]


def test_a_real_install_asks_for_the_vendor_index_before_anything_is_fetched(tmp_path, monkeypatch):
    """The vendor builds are not on PyPI: without --vendor-index-url (or --offline) the install stops, pip not run,
    with the two ways to go on; with it, pip searches the vendor's index besides PyPI."""
    chip = _host_with("metax", tmp_path, nodes=True, sdk=True, container=False)
    r = cli("install", "--chip", chip, "--yes", "--root", str(tmp_path), "--env-file", str(tmp_path / "env.sh"))
    assert r.exit_code == 1 and "are vendor builds, not on PyPI" in r.output, r.output
    assert f"install --chip {chip} --vendor-index-url URL" in r.output and "--offline DIR" in r.output
    assert not (tmp_path / "env.sh").exists()
    asked = []
    monkeypatch.setattr(inst, "_pip", lambda args, what: asked.append(args))
    plan = inst.make_plan(detect(tmp_path), chip)
    inst.download(plan, tmp_path, vendor_index_url="https://pip.example/simple")
    assert asked[0][asked[0].index("--extra-index-url") + 1] == "https://pip.example/simple"
    assert "torch==2.8.0+metax3.5.3.9" in asked[0] and "flag-gems==5.0.2" in asked[0]


def test_a_torch_of_another_build_is_replaced(monkeypatch):
    """Hygon's torch is pinned 2.9.0 with the DAS build label: PyPI's 2.9.0 does not count as installed."""
    for have, replaced in (("2.9.0", True), ("2.9.0+cpu", True), ("2.9.0+das.opt1.dtk2604", False)):
        monkeypatch.setattr(inst, "_installed", lambda name, have=have: have if name == "torch" else None)
        plan = inst.make_plan(detect(SYSTEMS / "cpu"), "k100-ai")
        assert any(r.startswith("torch") for r in plan.to_install) is replaced, have
    assert "torch must be the +das build" in plan.describe()


def test_the_env_file_sources_the_vendor_runtime(tmp_path):
    plan = inst.make_plan(detect(SYSTEMS / "cpu"), "k100-ai")
    assert plan.source == list(vendors.get("hygon").env_source)
    text = inst.write_env_file(plan, tmp_path / "env.sh").read_text()
    assert "[ -f /opt/dtk/env.sh ] && . /opt/dtk/env.sh" in text


def test_the_verification_probe_runs_the_generic_backend_of_the_chip():
    """`install`'s check in a fresh interpreter, for a vendor chip on this host (no such device): it asks the chip's
    backend (the generic one, specialised to the family) and counts devices of the family's device type, instead of
    importing torch_npu as it did for every non-cuda backend."""
    from flagdeploy.backends.generic import families

    plan = inst.make_plan(detect(SYSTEMS / "cpu"), "c500")
    facts = inst.probe(plan)
    assert facts["backend"] == "generic" and facts["devices"] == 0 and facts["detected"] is False
    assert families()["metax"]["device_type"] == "cuda"
