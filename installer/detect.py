"""What is on this host: accelerators, drivers, toolkits, CPU, memory, container, disk.

`flagdeploy install` and `doctor` decide everything from this, so every reader takes a `root` directory:
tests point it at a recorded system (tests/fixtures/systems/*) with the same layout as `/`, and vendor tools
are then read from `root/.commands/<tool>.txt` instead of being run. Nothing here raises on a missing or odd
file: an absent fact is None, and the plan says what it could not see.

Ascend parsing (npu-smi, SoC name -> family -> catalog id) is reused from flagdeploy.backends.ascend.detect;
file locations follow /work/shared/docs/ascend-torch-npu.md [4.1], [4.2]. The vendors that run the generic backend
(Cambricon, Kunlunxin, Hygon, MetaX, Moore Threads, Iluvatar, Enflame) are found from data (vendors.yaml): their
tool, their device nodes and their PCI functions, one loop for all of them.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from flagdeploy.backends.ascend.detect import FAMILY_CHIP, detect_info, soc_family
from flagdeploy.chips import all_chips, get_chip, resolve_chip
from flagdeploy.errors import FlagdeployError, UnknownChipError

from . import vendors as vendor_data

__all__ = ["Accelerator", "SystemInfo", "ChipNotPresentError", "detect", "pick_chip", "chip_family"]

ROOT = Path("/")

# PCI vendor ids (sysfs .../vendor). Huawei and NVIDIA are certain (pci.ids); the others are UNCONFIRMED
# (recalled, not checked against a stored pci.ids). 0x19e5 also covers Huawei NICs/RAID and 0x1d94 Hygon
# CPU bridges, hence the class filter below.
PCI_VENDORS = {
    "0x19e5": "huawei",
    "0x10de": "nvidia",
    "0xcabc": "cambricon",  # UNCONFIRMED
    "0x1e3e": "iluvatar",  # UNCONFIRMED
    "0x9999": "metax",  # UNCONFIRMED
    "0x1ed5": "mthreads",  # UNCONFIRMED
    "0x1ea0": "enflame",  # UNCONFIRMED
    "0x1d94": "hygon",  # UNCONFIRMED (DCU)
    "0x1d22": "kunlunxin",  # UNCONFIRMED
}
# Only display controllers (0x03xxxx) and processing accelerators / co-processors (0x12xxxx, 0x0b40xx) count.
_ACCEL_CLASS = re.compile(r"^0x(03|12|0b40)")
# Ascend PCI device ids -> family, used only when npu-smi is absent. UNCONFIRMED (recalled).
ASCEND_PCI_FAMILY = {"0xd802": "A2", "0xd803": "A3", "0xd500": "310P"}
# NVIDIA: compute capability per catalog chip, for when nvidia-smi gives no compute_cap column.
NVIDIA_SM = {"h20": "sm90", "h20-141g": "sm90", "h100": "sm90", "h200": "sm90", "a100": "sm80", "l20": "sm89"}
# Where the CANN version is written ([4.1]); the first file that yields a version wins.
CANN_FILES = (
    "usr/local/Ascend/ascend-toolkit/latest/*-linux/ascend_toolkit_install.info",  # what VA collect_env reads
    "usr/local/Ascend/ascend-toolkit/latest/version.cfg",
    "usr/local/Ascend/ascend-toolkit/latest/compiler/version.info",
    "usr/local/Ascend/cann/*-linux/ascend_toolkit_install.info",  # newer layout, UNCONFIRMED
)


class ChipNotPresentError(FlagdeployError):
    """The user asked for a chip this host does not have (or auto found none it can name)."""


@dataclass
class Accelerator:
    """One kind of device on the host; count and memory are per framework device (a 910C die, one GPU)."""

    vendor: str
    family: str | None
    chip: str | None
    count: int
    memory_gib: float | None = None
    names: list[str] = field(default_factory=list)


@dataclass
class SystemInfo:
    accelerators: list[Accelerator]
    ascend_driver: str | None = None
    cann: str | None = None
    nnal: bool = False
    nvidia_driver: str | None = None
    cuda: str | None = None
    python: str = platform.python_version()
    cpu_model: str | None = None
    cpu_cores: int = 0
    memory_gib: float | None = None
    in_container: bool = False
    device_nodes: list[str] = field(default_factory=list)
    free_disk_gib: float | None = None
    # vendors.yaml families: whether the vendor's tool answered, and per host prerequisite whether it is there
    vendor_tools: dict[str, bool] = field(default_factory=dict)
    vendor_host: dict[str, dict[str, bool]] = field(default_factory=dict)

    @property
    def chips(self) -> list[str]:
        """Catalog ids of what was found, most capable first (accelerators before the CPU)."""
        return [a.chip for a in self.accelerators if a.chip]

    def describe(self) -> str:
        """'16 x ascend910c (A3, 64.0 GiB)'-style summary for messages."""
        parts = []
        for a in self.accelerators:
            what = a.chip or (a.names[0] if a.names else f"unknown {a.vendor} device")
            extra = ", ".join(x for x in (a.family, f"{a.memory_gib} GiB" if a.memory_gib else None) if x)
            parts.append(f"{a.count} x {what}" + (f" ({extra})" if extra else ""))
        return "; ".join(parts) or "nothing"


# ---- small readers --------------------------------------------------------------------------------------


def _is_live(root: Path) -> bool:
    return Path(root).resolve() == ROOT


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _kv(text: str | None, *keys: str) -> str | None:
    """The value of the first `key=value` line whose key matches one of `keys` (case-insensitive)."""
    if not text:
        return None
    found = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            found.setdefault(k.strip().lower(), v.strip())
    return next((found[k.lower()] for k in keys if found.get(k.lower())), None)


def command_output(root: Path, argv: list[str], record: str, *, timeout: float = 10,
                   any_returncode: bool = False) -> str | None:
    """A vendor tool's stdout: run it on the live host (`timeout` s, never raises), else the recorded
    `root/.commands/<record>` file. None when the tool is absent or fails; with `any_returncode` a tool that
    exits non-zero still gives its stdout and stderr (a failed ping's report is the answer)."""
    if not _is_live(root):
        return _read(Path(root) / ".commands" / record)
    exe = shutil.which(argv[0]) or next(
        (p for p in (f"/usr/local/bin/{argv[0]}", f"/usr/local/sbin/{argv[0]}") if Path(p).exists()), None)
    if not exe:
        return None
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if any_returncode:
        return done.stdout + done.stderr
    return done.stdout if done.returncode == 0 else None


def pci_devices(root: Path) -> list[tuple[str, str, str]]:
    """(vendor name, device id, PCI address) of each accelerator-class PCI function from sysfs."""
    found = []
    for dev in sorted((Path(root) / "sys/bus/pci/devices").glob("*")):
        vendor = (_read(dev / "vendor") or "").strip().lower()
        cls = (_read(dev / "class") or "").strip().lower()
        if vendor in PCI_VENDORS and (not cls or _ACCEL_CLASS.match(cls)):
            found.append((PCI_VENDORS[vendor], (_read(dev / "device") or "").strip().lower(), dev.name))
    return found


# ---- accelerators ---------------------------------------------------------------------------------------


def _ascend(root: Path, pci: list[tuple[str, str, str]]) -> tuple[Accelerator | None, str | None]:
    """The Ascend devices (from npu-smi, else device nodes / PCI) and the driver version npu-smi reports."""
    text = command_output(root, ["npu-smi", "info"], "npu-smi_info.txt")
    info = detect_info(npu_smi_output=text, dev_dir=str(Path(root) / "dev"), probe=False)
    huawei = [d for v, d, _ in pci if v == "huawei"]
    if not info.device_count and not huawei:
        return None, None
    family = info.family or next((ASCEND_PCI_FAMILY[d] for d in huawei if d in ASCEND_PCI_FAMILY), None)
    chip = info.chip or (FAMILY_CHIP.get(family) if family else None)
    names = sorted({d.name for d in info.npu_smi.devices}) if info.npu_smi else []
    mem = round(min(info.memory_mib) / 1024, 1) if info.memory_mib else None
    driver = info.npu_smi.driver_version if info.npu_smi else None
    return Accelerator("huawei", family, chip, info.device_count or len(huawei), mem, names), driver


def _nvidia_chip(name: str) -> str | None:
    """Catalog id from a product name: a chip's own `product_names` first ('NVIDIA H20-3e' -> h20-141g, whose
    name also holds the token h20), else an id among the name's tokens ('NVIDIA A100-SXM4-80GB' -> a100)."""
    nvidia = [c for c in all_chips() if c.vendor == "nvidia"]
    exact = next((c.id for c in nvidia if name.strip().lower() in (n.lower() for n in c.product_names)), None)
    tokens = set(re.split(r"[^a-z0-9]+", name.lower()))
    return exact or next((c.id for c in nvidia if c.id in tokens), None)


def _nvidia(root: Path, pci: list[tuple[str, str, str]]) -> tuple[Accelerator | None, str | None]:
    """NVIDIA GPUs from nvidia-smi's CSV query (name, memory.total, compute_cap, driver_version), else PCI."""
    text = command_output(root, ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap,driver_version",
                                 "--format=csv,noheader"], "nvidia-smi.txt")
    rows = [[c.strip() for c in line.split(",")] for line in (text or "").splitlines() if line.count(",") >= 3]
    if not rows:
        n = sum(1 for v, _, _ in pci if v == "nvidia")
        return (Accelerator("nvidia", None, None, n) if n else None), None
    names = sorted({r[0] for r in rows})
    chip = _nvidia_chip(rows[0][0])
    cap = rows[0][2]
    family = f"sm{cap.replace('.', '')}" if re.fullmatch(r"\d+\.\d+", cap) else NVIDIA_SM.get(chip or "")
    mib = [int(m.group(1)) for r in rows if (m := re.match(r"(\d+)", r[1]))]
    mem = round(min(mib) / 1024, 1) if mib else None
    return Accelerator("nvidia", family, chip, len(rows), mem, names), rows[0][3] or None


def _normalized(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _vendor_chip_lines(vendor: str, text: str | None) -> tuple[str | None, int]:
    """(catalog id, lines naming it) from a vendor tool's output: a line names a chip of that vendor when its id or
    one of its product names appears in it, compared without punctuation and case ('MLU590-M9D' names mlu590,
    'K100_AI' names k100-ai). The vendor's first catalog chip that is named wins."""
    lines = [_normalized(line) for line in (text or "").splitlines()]
    for chip in (c for c in all_chips() if c.vendor == vendor):
        names = [n for n in map(_normalized, (chip.id, *chip.product_names)) if n]
        hits = sum(1 for line in lines if any(n in line for n in names))
        if hits:
            return chip.id, hits
    return None, 0


def _vendor(root: Path, pci: list[tuple[str, str, str]], v: vendor_data.Vendor) -> tuple[Accelerator | None, bool]:
    """One vendor of vendors.yaml: (its devices, whether its tool answered). Present when the tool answered, a
    per-device node exists or a PCI function of the vendor is there. Counted by device nodes, else PCI functions,
    else the tool's lines that name the chip. The chip is named only where the tool names it: a device node or a
    PCI id alone does not say which of a vendor's chips it is."""
    text = command_output(root, [v.tool], f"{v.tool}.txt") if v.tool else None
    dev = Path(root) / "dev"
    nodes = max((len(list(dev.glob(p))) for p in v.per_device), default=0)
    n_pci = sum(1 for name, _, _ in pci if name == v.family)
    chip, lines = _vendor_chip_lines(v.family, text)
    if not (text is not None or nodes or n_pci):
        return None, False
    names = [get_chip(chip).name] if chip else []
    return Accelerator(v.family, v.family, chip, nodes or n_pci or lines, None, names), text is not None


def _vendor_host(root: Path, v: vendor_data.Vendor, tool: bool) -> dict[str, bool]:
    """Which of the vendor's host prerequisites are there: the tool answered, or the path exists under root."""
    return {n.key: tool if n.present == "tool" else (Path(root) / n.present).exists() for n in v.host}


# ---- host facts -----------------------------------------------------------------------------------------


def _cpu(root: Path) -> tuple[str | None, int]:
    """(model, logical cores) from proc/cpuinfo; Arm servers have no 'model name', so name the Kunpeng 920
    from its implementer/part ids (0x48/0xd01) and report other Arm parts by id."""
    text = _read(Path(root) / "proc/cpuinfo") or ""
    cores = len(re.findall(r"^processor\s*:", text, re.M))
    fields = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            fields.setdefault(k.strip().lower(), v.strip())
    model = fields.get("model name") or fields.get("hardware")
    if not model and "cpu implementer" in fields:
        impl, part = fields["cpu implementer"].lower(), fields.get("cpu part", "").lower()
        model = "HiSilicon Kunpeng-920" if (impl, part) == ("0x48", "0xd01") else f"Arm implementer {impl} part {part}"
    return model, cores


def _memory_gib(root: Path) -> float | None:
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", _read(Path(root) / "proc/meminfo") or "", re.M)
    return round(int(m.group(1)) / 2**20, 1) if m else None


def _in_container(root: Path) -> bool:
    """Docker leaves /.dockerenv, podman /run/.containerenv; otherwise cgroup v1 paths name the runtime."""
    root = Path(root)
    if (root / ".dockerenv").exists() or (root / "run/.containerenv").exists():
        return True
    cgroup = _read(root / "proc/1/cgroup") or ""
    return bool(re.search(r"docker|kubepods|containerd|libpod|lxc", cgroup))


def _device_nodes(root: Path) -> list[str]:
    """Device nodes as the host names them (/dev/...): davinci*, devmm_svm, hisi_hdc (all three must be passed
    into an Ascend container), nvidia*, and those vendors.yaml lists for each vendor."""
    dev = Path(root) / "dev"
    patterns = ["davinci*", "devmm_svm", "hisi_hdc", "nvidia*"]
    patterns += [p for v in vendor_data.vendors().values() for p in (*v.per_device, *v.shared)]
    names = {p.name for pat in patterns for p in dev.glob(pat)}
    natural = lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]  # noqa: E731
    return [f"/dev/{n}" for n in sorted(names, key=natural)]


def _cann(root: Path) -> str | None:
    for pattern in CANN_FILES:
        for path in sorted(Path(root).glob(pattern)):
            text = _read(path)
            if path.name == "version.cfg":  # runtime_running_version=[9.1.0.1.242:9.1.0]
                m = re.search(r"running_version=\[[^:\]]*:([^\]]+)\]", text or "")
                version = m.group(1) if m else None
            else:
                version = _kv(text, "version", "version_dir")
            if version:
                return version
    return None


def _cuda(root: Path) -> str | None:
    """CUDA toolkit version from usr/local/cuda/version.json (11.1+) or version.txt (older)."""
    text = _read(Path(root) / "usr/local/cuda/version.json")
    m = re.search(r'"cuda"\s*:\s*\{[^}]*"version"\s*:\s*"([^"]+)"', text or "")
    if not m:
        m = re.search(r"CUDA Version\s+(\S+)", _read(Path(root) / "usr/local/cuda/version.txt") or "")
    return m.group(1) if m else None


def free_disk_gib(root: Path, path: Path | None = None) -> float | None:
    """Free space where the weights will go; only meaningful on the live host (a recording has no disk)."""
    if not _is_live(root):
        return None
    path = Path(path or Path.home())
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return round(shutil.disk_usage(path).free / 2**30, 1)
    except OSError:
        return None


# ---- entry points ---------------------------------------------------------------------------------------


def detect(root: Path = ROOT, disk_path: Path | None = None) -> SystemInfo:
    """Everything the installer needs to know about the host at `root`. Accelerators come first; a host with
    none gets a single `cpu` accelerator so that callers always have something to plan for."""
    root = Path(root)
    pci = pci_devices(root)
    ascend, smi_driver = _ascend(root, pci)
    nvidia, nv_driver = _nvidia(root, pci)
    accels = [a for a in (ascend, nvidia) if a]
    tools, host = {}, {}
    for v in vendor_data.vendors().values():
        found, tools[v.family] = _vendor(root, pci, v)
        accels += [found] if found else []
        host[v.family] = _vendor_host(root, v, tools[v.family])
    known = {"huawei", "nvidia", *vendor_data.vendors()}
    for vendor in sorted({v for v, _, _ in pci} - known):  # a vendor with no entry anywhere: PCI count only
        accels.append(Accelerator(vendor, None, None, sum(1 for v, _, _ in pci if v == vendor)))
    cpu_model, cores = _cpu(root)
    memory = _memory_gib(root)
    if not accels:
        accels.append(Accelerator("cpu", "cpu", "cpu", 1, memory, [cpu_model] if cpu_model else []))
    driver_info = _read(root / "usr/local/Ascend/driver/version.info")
    nv_proc = re.search(r"Kernel Module\s+(\S+)", _read(root / "proc/driver/nvidia/version") or "")
    return SystemInfo(
        accelerators=accels,
        ascend_driver=_kv(driver_info, "Version", "package_version") or smi_driver,
        cann=_cann(root),
        nnal=(root / "usr/local/Ascend/nnal/atb").is_dir(),
        nvidia_driver=nv_driver or (nv_proc.group(1) if nv_proc else None),
        cuda=_cuda(root),
        cpu_model=cpu_model,
        cpu_cores=cores,
        memory_gib=memory,
        in_container=_in_container(root),
        device_nodes=_device_nodes(root),
        free_disk_gib=free_disk_gib(root, disk_path),
        vendor_tools=tools,
        vendor_host=host,
    )


def chip_family(chip: str) -> str | None:
    """The stack family of a catalog id (ascend910c -> A3, h20 -> sm90, cpu -> cpu, c500 -> metax): what the matrix
    keys on. A chip of a vendors.yaml vendor has its `backend:` (the generic backend's family) as its family."""
    if chip in ("cpu", "cpu-edge"):
        return "cpu"
    if chip == "ascend310b":  # the edge SoC: served through ONNX Runtime's CANN EP (flagdeploy/edge)
        return "310B"
    found = NVIDIA_SM.get(chip) or soc_family(chip)
    spec = next((c for c in all_chips() if c.id == chip), None)
    if found is None and spec is not None and vendor_data.get(spec.backend):
        return spec.backend
    return found


def pick_chip(info: SystemInfo, requested: str, present_required: bool = True) -> str:
    """The catalog id to install for. 'auto' takes the first detected chip; a backend name (cuda, ascend) the
    detected chip of that backend. A named chip must exist in the catalog and, when `present_required` (a
    real install rather than a dry run), be on this host: another member of the same Ascend family counts
    (910B4 for 910B), and the CPU is always present."""
    requested = requested.strip().lower()
    if requested == "auto":
        if info.chips:
            return info.chips[0]
        raise ChipNotPresentError(
            f"--chip auto found no device it can name (found: {info.describe()}). Pass --chip with one of: "
            f"{', '.join(c.id for c in all_chips())}.")
    try:
        choice = resolve_chip(requested)
        # a backend name (cuda, ascend) means the chip of that backend found here, else its only catalog chip
        here = [c for c in info.chips if choice.chip is None and get_chip(c).backend == choice.backend]
        chip = get_chip(here[0]) if here else choice.require_chip()
    except UnknownChipError as e:
        raise UnknownChipError(f"{e} Or pass --chip auto to use the detected device.") from None
    if not present_required or chip.id in ("cpu", "cpu-edge") or chip.id in info.chips:
        return chip.id
    family = chip_family(chip.id)
    if chip.vendor == "huawei" and family and any(chip_family(c) == family for c in info.chips):
        return chip.id
    # a vendors.yaml device found by its nodes or PCI id but not named by its tool: the chip may be this one
    if vendor_data.get(family) and any(a.family == family and a.chip is None for a in info.accelerators):
        return chip.id
    raise ChipNotPresentError(
        f"--chip {chip.id} ({chip.name}) is not present on this host; found: {info.describe()}. "
        f"Use --chip auto (or --chip {info.chips[0] if info.chips else 'cpu'}) to install for what is here, or "
        f"add --dry-run to print the plan for {chip.id} without installing.")
