"""Finding Ascend NPUs: device nodes, `npu-smi info`, torch_npu's SoC name -> family -> catalog chip id.

Every source is optional and every parser takes its input as an argument (command output, SoC string,
device directory), so all of it is testable without hardware. Formats from /work/shared/docs/
ascend-torch-npu.md [4.1] (device nodes), [4.2] (npu-smi), [1.11] (SoC names and versions).
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

# family -> the catalog id (profiles/chips.yaml) a generic member of it maps to
FAMILY_CHIP = {"A2": "ascend910b", "A3": "ascend910c", "950": "ascend950", "310P": "ascend310p"}
# what the cube unit takes per family (ADOC [2]); FP8 only on 950
FAMILY_MATMUL_DTYPES = {
    "A2": ("int8", "int4", "bf16", "fp16"),
    "A3": ("int8", "int4", "bf16", "fp16"),
    "950": ("fp8", "int8", "bf16", "fp16"),
    "310P": ("int8", "fp16"),
}


def soc_family(soc: str | int | None, chips_per_npu: int | None = None) -> str | None:
    """'A2' / 'A3' / '950' / '310P' from a SoC or npu-smi name (Ascend910B3, 910B4, Ascend910_9391,
    ascend950dt_9582, 310P3) or torch_npu's integer SoC version (220-225 A2, 250-255 A3, 260 950,
    200-205 310P). A bare "Ascend910"/"910" is what npu-smi shows on A3, recognised by its two chips per
    NPU; alone it is ambiguous (the original 910 has the same name) and gives None."""
    if soc is None:
        return None
    if isinstance(soc, int):
        for lo, hi, fam in ((220, 225, "A2"), (250, 255, "A3"), (260, 260, "950"), (200, 205, "310P")):
            if lo <= soc <= hi:
                return fam
        return None
    n = str(soc).strip().lower().removeprefix("ascend")
    if n.startswith("910b"):
        return "A2"
    if n.startswith("910_93") or n.startswith("910c"):
        return "A3"
    if n.startswith("950"):
        return "950"
    if n.startswith("310p"):
        return "310P"
    if n == "910" and chips_per_npu == 2:
        return "A3"
    return None


def chip_id(soc: str | int | None, family: str | None = None) -> str | None:
    """The catalog id: 910B4 (32 GB) has its own entry, other A2 SKUs map to ascend910b."""
    family = family or soc_family(soc)
    if family == "A2" and isinstance(soc, str) and soc.strip().lower().removeprefix("ascend").startswith("910b4"):
        return "ascend910b4"
    return FAMILY_CHIP.get(family) if family else None


# ---- npu-smi info ---------------------------------------------------------------------------------------

_HEADER = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
# | 0  910B3 | OK | 101.8  43  0 / 0 |       (NPU id, name, health)
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+([A-Za-z0-9_-]*[A-Za-z][A-Za-z0-9_-]*)\s*\|\s*([A-Za-z]+)\s*\|")
# | 0 | 0000:C1:00.0 | 0  0 / 0  3318 / 65536 |   (chip [phy-id], bus id, usage pairs)
_CHIP_ROW = re.compile(r"^\|\s*(\d+)(?:\s+(\d+))?\s*\|\s*([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s*\|(.*)\|")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


@dataclass
class NpuSmiDevice:
    npu: int
    chip: int
    name: str
    health: str
    bus_id: str
    memory_total_mib: int | None


@dataclass
class NpuSmiInfo:
    version: str | None
    driver_version: str | None
    devices: list[NpuSmiDevice]

    @property
    def chips_per_npu(self) -> int | None:
        per = {}
        for d in self.devices:
            per[d.npu] = per.get(d.npu, 0) + 1
        return max(per.values()) if per else None


def parse_npu_smi(text: str) -> NpuSmiInfo:
    """`npu-smi info` output -> one entry per chip (die). The header's second number is the driver
    version; the HBM total is the last "used / total" pair of a chip row (the Memory-Usage pair when the
    HBM pair reads 0 / 0, as on cards without HBM)."""
    version = driver = None
    m = _HEADER.search(text)
    if m:
        version, driver = m.group(1), m.group(2)
    devices: list[NpuSmiDevice] = []
    current: tuple[int, str, str] | None = None
    for line in text.splitlines():
        line = line.strip()
        row = _NPU_ROW.match(line)
        if row:
            current = (int(row.group(1)), row.group(2), row.group(3))
            continue
        chip = _CHIP_ROW.match(line)
        if chip and current is not None:
            pairs = [(int(a), int(b)) for a, b in _PAIR.findall(chip.group(4))]
            total = next((b for _, b in reversed(pairs) if b), None)
            devices.append(NpuSmiDevice(current[0], int(chip.group(1)), current[1], current[2], chip.group(3), total))
    return NpuSmiInfo(version, driver, devices)


# ---- everything together --------------------------------------------------------------------------------


@dataclass
class AscendInfo:
    device_nodes: list[str] = field(default_factory=list)
    npu_smi: NpuSmiInfo | None = None
    soc_name: str | None = None
    family: str | None = None
    chip: str | None = None
    device_count: int = 0
    memory_mib: list[int] = field(default_factory=list)
    matmul_dtypes: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def present(self) -> bool:
        return self.device_count > 0


def _run_npu_smi() -> str | None:
    exe = shutil.which("npu-smi") or next((p for p in ("/usr/local/bin/npu-smi", "/usr/local/sbin/npu-smi")
                                            if os.path.exists(p)), None)
    if not exe:
        return None
    try:
        return subprocess.run([exe, "info"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _torch_npu_soc() -> tuple[str | None, list[int]]:
    """(device name, total memory per device in MiB) from torch_npu, or (None, []) without it."""
    try:
        importlib.import_module("torch_npu")
        import torch

        if not torch.npu.is_available():
            return None, []
        n = torch.npu.device_count()
        mem = [int(torch.npu.get_device_properties(i).total_memory) >> 20 for i in range(n)]
        return torch.npu.get_device_name(0), mem
    except Exception:
        return None, []


def detect_info(npu_smi_output: str | None = None, soc_name: str | None = None, dev_dir: str = "/dev",
                probe: bool = True) -> AscendInfo:
    """What is on this host. Pass `npu_smi_output` / `soc_name` to parse given text instead of probing
    (probe=False never runs a command nor imports torch_npu)."""
    info = AscendInfo()
    info.device_nodes = sorted(glob.glob(os.path.join(dev_dir, "davinci[0-9]*")),
                               key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    if npu_smi_output is None and probe:
        npu_smi_output = _run_npu_smi()
    torch_mem: list[int] = []
    if soc_name is None and probe:
        soc_name, torch_mem = _torch_npu_soc()
    if npu_smi_output:
        info.npu_smi = parse_npu_smi(npu_smi_output)
    smi_devs = info.npu_smi.devices if info.npu_smi else []
    info.soc_name = soc_name or (smi_devs[0].name if smi_devs else None)
    chips_per_npu = info.npu_smi.chips_per_npu if info.npu_smi else None
    info.family = soc_family(info.soc_name, chips_per_npu)
    if info.family is None and smi_devs:
        info.family = soc_family(smi_devs[0].name, chips_per_npu)
    info.chip = chip_id(info.soc_name, info.family)
    if info.family is None and info.soc_name:
        info.notes.append(f"unknown Ascend SoC {info.soc_name!r}")
    if torch_mem:
        info.memory_mib = torch_mem
    else:
        info.memory_mib = [d.memory_total_mib for d in smi_devs if d.memory_total_mib]
    info.device_count = len(torch_mem) or len(smi_devs) or len(info.device_nodes)
    info.matmul_dtypes = FAMILY_MATMUL_DTYPES.get(info.family, ())
    return info
