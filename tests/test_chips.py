"""The chip catalog loads, says the right thing about dtypes the planner relies on, and fails clearly."""

from __future__ import annotations

import pytest

from flagdeploy import chips
from flagdeploy.chips import CONFIDENCES, MATMUL_DTYPES, TFLOPS_DTYPES, Chip, all_chips, get_chip
from flagdeploy.errors import UnknownChipError

REQUIRED_IDS = [
    "ascend910b", "ascend910b4", "ascend910c", "ascend950", "ascend310p", "ascend310b",
    "h20", "h20-141g", "h100", "h200", "a100", "l20", "cpu",
]
REQUIRED_VENDORS = ["cambricon", "kunlunxin", "hygon", "metax", "mthreads", "iluvatar", "enflame"]


@pytest.mark.parametrize("chip_id", REQUIRED_IDS)
def test_required_ids_load(chip_id):
    chip = get_chip(chip_id)
    assert isinstance(chip, Chip) and chip.id == chip_id
    assert chip.memory_gib > 0 and chip.memory_bandwidth_gbs > 0 and chip.devices_per_node >= 1
    assert chip.interconnect.bandwidth_gbs > 0


def test_one_part_per_other_vendor_with_its_own_backend():
    by_vendor = {c.vendor: c for c in all_chips()}
    for vendor in REQUIRED_VENDORS:
        assert vendor in by_vendor, vendor
        assert by_vendor[vendor].backend == vendor


def test_backends():
    assert {get_chip(i).backend for i in REQUIRED_IDS if i.startswith("ascend")} == {"ascend"}
    assert {get_chip(i).backend for i in ("h20", "h20-141g", "h100", "h200", "a100", "l20")} == {"cuda"}
    assert get_chip("cpu").backend == "cpu"


@pytest.mark.parametrize("chip_id", ["ascend910b", "ascend910b4", "ascend910c"])
def test_910b_910c_have_int8_and_bf16_but_no_fp8(chip_id):
    chip = get_chip(chip_id)
    assert not chip.supports("fp8")
    assert chip.supports("int8") and chip.supports("bf16")
    assert "fp8" not in chip.tflops


@pytest.mark.parametrize("chip_id", ["h200", "h100", "h20", "h20-141g", "l20", "ascend950"])
def test_fp8_chips(chip_id):
    assert get_chip(chip_id).supports("fp8")
    assert "fp8" in get_chip(chip_id).tflops


def test_a100_has_no_fp8_and_310p_has_no_bf16():
    assert not get_chip("a100").supports("fp8")
    assert not get_chip("ascend310p").supports("bf16")
    assert get_chip("ascend310p").supports("int8")


def test_memory_facts_from_the_ascend_doc():
    assert get_chip("ascend910b4").memory_gib == 32
    assert get_chip("ascend910b").memory_gib == 64
    c = get_chip("ascend910c")  # one die of the two-die package
    assert c.memory_gib == 64 and c.devices_per_node == 16


def test_h20_141g_is_the_h20_with_the_h200s_memory():
    """The seeds' 4x H20 deployment is the 141 GB part: same compute and links as the 96 GB H20, HBM3e as on
    the H200 (nvidia-smi reports 143771 MiB for both)."""
    big, small, h200 = get_chip("h20-141g"), get_chip("h20"), get_chip("h200")
    assert big.memory_gib == h200.memory_gib == 140.4 and big.memory_bandwidth_gbs == 4800
    assert big.tflops == small.tflops == {"fp8": 296, "int8": 296, "bf16": 148, "fp16": 148}
    assert big.interconnect == small.interconnect and big.matmul_dtypes == small.matmul_dtypes
    assert big.product_names == ("NVIDIA H20-3e",)


def test_resolve_chip_takes_ids_and_backend_names():
    from flagdeploy.chips import ChipChoice, backend_names, resolve_chip

    assert resolve_chip(" Ascend910C ") == ChipChoice("ascend910c", "ascend", get_chip("ascend910c"))
    assert resolve_chip("cpu").chip is get_chip("cpu")  # an id first, though cpu is also a backend
    assert resolve_chip("CUDA") == ChipChoice("cuda", "cuda", None)
    assert {"cpu", "cuda", "ascend"} <= set(backend_names())
    assert resolve_chip("demo", plugin_backends=["demo"]) == ChipChoice("demo", "demo", None)


def test_a_backend_name_is_a_chip_only_where_the_catalog_has_one_chip_of_it():
    from flagdeploy.chips import resolve_chip

    assert get_chip("cambricon").id == "mlu590"
    with pytest.raises(UnknownChipError, match=r"--chip cuda names the cuda backend.*h20, h20-141g, h100, h200"):
        resolve_chip("cuda").require_chip()


def test_an_unknown_value_suggests_the_close_ones():
    with pytest.raises(UnknownChipError) as info:
        get_chip("h20-141")
    msg = str(info.value)
    assert msg.startswith("Unknown chip 'h20-141'. Did you mean 'h20-141g'")
    assert "or a backend name: " in msg and "cuda" in msg
    with pytest.raises(UnknownChipError, match="Unknown chip 'zzz'. Known chips"):  # nothing close: no guess
        get_chip("zzz")


def test_unknown_id_lists_known_ids():
    with pytest.raises(UnknownChipError) as info:
        get_chip("ascend999")
    msg = str(info.value)
    assert "ascend999" in msg and "--chip" in msg
    for chip_id in REQUIRED_IDS:
        assert chip_id in msg


def test_case_insensitive():
    assert get_chip("Ascend910B") is get_chip("ascend910b")
    assert get_chip("H200").id == "h200"


def test_every_chip_is_sourced_and_consistent():
    chips_ = all_chips()
    assert len({c.id for c in chips_}) == len(chips_)
    assert chips_[0].id == "ascend910b"  # file order
    for c in chips_:
        for group in ("memory", "matmul_dtypes"):
            assert c.sources[group].source, (c.id, group)
            assert c.sources[group].confidence in CONFIDENCES, (c.id, group)
        assert set(c.matmul_dtypes) <= MATMUL_DTYPES, c.id
        assert set(c.tflops) <= TFLOPS_DTYPES & set(c.matmul_dtypes), c.id
        assert c.interconnect.kind in {"hccs", "nvlink", "pcie", "roce"}, c.id


def _load_bad(tmp_path, monkeypatch, text):
    path = tmp_path / "chips.yaml"
    path.write_text(text)
    monkeypatch.setattr(chips, "CATALOG", path)
    chips._catalog.cache_clear()
    try:
        with pytest.raises(ValueError) as info:
            chips.all_chips()
    finally:
        chips._catalog.cache_clear()
    return str(info.value)


GOOD = """
x1:
  name: X
  vendor: v
  backend: v
  memory_gib: 1
  memory_bandwidth_gbs: 1
  tflops: {bf16: 1}
  matmul_dtypes: [bf16]
  devices_per_node: 1
  interconnect: {kind: pcie, bandwidth_gbs: 1}
  sources:
    memory: {source: s, confidence: high}
    memory_bandwidth: {source: s, confidence: high}
    tflops: {source: s, confidence: high}
    matmul_dtypes: {source: s, confidence: high}
    interconnect: {source: s, confidence: high}
"""


def test_bad_catalog_names_chip_and_field(tmp_path, monkeypatch):
    msg = _load_bad(tmp_path, monkeypatch, GOOD.replace("matmul_dtypes: [bf16]", "matmul_dtypes: [bf16, fp9]"))
    assert "x1" in msg and "matmul_dtypes" in msg and "fp9" in msg
    msg = _load_bad(tmp_path, monkeypatch, GOOD.replace("  memory_gib: 1\n", ""))
    assert "x1" in msg and "memory_gib" in msg and "missing" in msg
    bad_confidence = GOOD.replace("confidence: high}\n    matmul", "confidence: sure}\n    matmul")
    msg = _load_bad(tmp_path, monkeypatch, bad_confidence)
    assert "x1" in msg and "sources.tflops" in msg
