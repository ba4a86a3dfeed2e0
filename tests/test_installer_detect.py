"""Detection over recorded systems (tests/fixtures/systems/*) and the compatibility matrix (issue 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flagdeploy.errors import FlagdeployError, UnknownChipError
from flagdeploy.installer.detect import ChipNotPresentError, chip_family, detect, pick_chip
from flagdeploy.installer.matrix import UnsupportedStackError, all_rows, engines_for, resolve

SYSTEMS = Path(__file__).parent / "fixtures" / "systems"


@pytest.mark.parametrize("system,vendor,family,chip,count,mem,names", [
    ("a2", "huawei", "A2", "ascend910b", 8, 64.0, ["910B3"]),
    ("a3", "huawei", "A3", "ascend910c", 16, 64.0, ["Ascend910"]),  # 8 NPUs x 2 dies
    ("310p", "huawei", "310P", "ascend310p", 2, 43.2, ["310P3"]),  # one 300I Duo card, two chips
    ("h20", "nvidia", "sm90", "h20", 8, 95.6, ["NVIDIA H20"]),
    ("cpu", "cpu", "cpu", "cpu", 1, 31.1, ["13th Gen Intel(R) Core(TM) i7-1360P"]),
])
def test_accelerators(system, vendor, family, chip, count, mem, names):
    info = detect(SYSTEMS / system)
    assert len(info.accelerators) == 1  # a Huawei NIC / NVSwitch / Intel iGPU on the PCI bus is not one
    acc = info.accelerators[0]
    assert (acc.vendor, acc.family, acc.chip, acc.count, acc.memory_gib, acc.names) == \
        (vendor, family, chip, count, mem, names)
    assert info.free_disk_gib is None  # a recording has no disk


@pytest.mark.parametrize("system,driver,cann,nnal,container,nodes", [
    ("a2", "24.1.rc2", "8.0.RC3", True, False, 11),  # ascend_toolkit_install.info; bare metal
    ("a3", "25.0.rc1.1", "9.1.0", True, True, 19),  # version.cfg; /.dockerenv
    ("310p", "23.0.0", "8.0.0", False, True, 5),  # compiler/version.info; kubepods cgroup
    ("h20", None, None, False, False, 11),
    ("cpu", None, None, False, False, 0),
])
def test_versions_and_host(system, driver, cann, nnal, container, nodes):
    info = detect(SYSTEMS / system)
    assert (info.ascend_driver, info.cann, info.nnal, info.in_container) == (driver, cann, nnal, container)
    assert len(info.device_nodes) == nodes
    assert info.cpu_cores > 0 and info.memory_gib > 0 and info.cpu_model and info.python


def test_host_details():
    a3, h20 = detect(SYSTEMS / "a3"), detect(SYSTEMS / "h20")
    assert a3.cpu_model == "HiSilicon Kunpeng-920" and a3.cpu_cores == 320
    assert {"/dev/davinci15", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(a3.device_nodes)
    assert (h20.nvidia_driver, h20.cuda) == ("550.54.15", "12.4.1")
    assert "/dev/nvidia7" in h20.device_nodes and "/dev/nvidiactl" in h20.device_nodes


def test_live_host_never_raises():
    info = detect()
    assert info.accelerators and info.python


def test_pick_chip_auto_and_present():
    assert pick_chip(detect(SYSTEMS / "a3"), "auto") == "ascend910c"
    assert pick_chip(detect(SYSTEMS / "h20"), "auto") == "h20"
    assert pick_chip(detect(SYSTEMS / "cpu"), "auto") == "cpu"
    assert pick_chip(detect(SYSTEMS / "a2"), "ASCEND910B") == "ascend910b"
    assert pick_chip(detect(SYSTEMS / "a2"), "cpu") == "cpu"  # the host CPU is always there


def test_pick_chip_absent_says_what_was_found():
    info = detect(SYSTEMS / "cpu")
    with pytest.raises(ChipNotPresentError) as e:
        pick_chip(info, "ascend910c")
    msg = str(e.value)
    assert isinstance(e.value, FlagdeployError)
    assert "ascend910c" in msg and "found: 1 x cpu" in msg and "--dry-run" in msg
    with pytest.raises(ChipNotPresentError, match="16 x ascend910c"):
        pick_chip(detect(SYSTEMS / "a3"), "ascend910b")  # A2 build on an A3 box is the classic mistake
    assert pick_chip(info, "ascend910c", present_required=False) == "ascend910c"  # a dry run may plan it


def test_pick_chip_unknown_lists_known_and_auto():
    with pytest.raises(UnknownChipError, match=r"ascend910c.*--chip auto"):
        pick_chip(detect(SYSTEMS / "cpu"), "tpu9")


def test_chip_family():
    assert [chip_family(c) for c in ("ascend910b4", "ascend910c", "ascend310p", "h200", "cpu")] == \
        ["A2", "A3", "310P", "sm90", "cpu"]


def test_resolve_a3_vllm_ascend():
    row = resolve("A3", "vllm-ascend")
    assert row.packages["vllm-ascend"] == "==0.23.0" and row.packages["torch-npu"] == "==2.10.0.post4"
    assert row.packages["triton-ascend"] == "==3.2.2" and row.cann_min == "9.1.0"
    assert row.image.endswith("-a3") and row.python == ">=3.10,<3.13" and "VA versioning policy" in row.source
    assert row.unconfirmed == ("image",)  # the tag format


def test_resolve_a2_builtin():
    row = resolve("a2", "builtin")
    assert row.requirements() == ["torch==2.12.0", "torch-npu==2.12.0", "flagdeploy"]
    assert row.cann_min == "9.1.0" and "910b" in row.image and row.confirmed


def test_resolve_cpu_builtin():
    row = resolve("cpu", "builtin")
    assert row.requirements() == ["torch==2.13.0", "flagdeploy"] and row.python == ">=3.10"
    assert row.cann_min is None and row.confirmed


def test_resolve_unknown_engine_lists_available():
    with pytest.raises(UnsupportedStackError) as e:
        resolve("cpu", "vllm-ascend")
    assert isinstance(e.value, FlagdeployError) and "builtin" in str(e.value)
    assert engines_for("A3") == ["builtin", "vllm-ascend", "sglang", "mindie"]
    with pytest.raises(UnsupportedStackError, match="Known families"):
        resolve("tpu", "builtin")


def test_every_row_has_a_source_and_detected_families_resolve():
    assert all(r.source for r in all_rows())
    for system in ("a2", "a3", "310p", "h20", "cpu"):
        assert resolve(detect(SYSTEMS / system).accelerators[0].family, "builtin")


@pytest.mark.parametrize("name,chip", [("NVIDIA H20-3e", "h20-141g"), ("NVIDIA H20", "h20"),
                                       ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")])
def test_nvidia_product_names(name, chip):
    """nvidia-smi calls the 141 GB H20 'NVIDIA H20-3e': its catalog product name, not the token h20, decides."""
    from flagdeploy.installer.detect import _nvidia_chip

    assert _nvidia_chip(name) == chip
