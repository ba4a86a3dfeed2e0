"""`flagdeploy install --chip X`: from what this host has to a verified stack for chip X.

The plan comes from detection (installer.detect) and the compatibility matrix (installer.matrix):
what is present, which Python packages to install at which pinned versions, which host prerequisites
(driver, firmware, CANN, NNAL) it cannot install itself, with the commands to do so, and the
environment file to source. Installing is two-phase: every wheel is first downloaded (`pip download`)
and only then installed from that directory with `--no-index`, so a network or resolution failure
leaves the environment as it was. Verification runs in a fresh interpreter: imports, the device
count, on Ascend the SoC family the device reports against the plan's (and, for vLLM-Ascend, the family
its kernels were compiled for), and `flagdeploy ops check` on the device.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

from flagdeploy.chips import get_chip
from flagdeploy.errors import FlagdeployError

from . import hdk
from . import vendors as vendor_data
from .detect import SystemInfo, chip_family
from .matrix import StackRow, resolve

# What a chip's runtime reads from the environment, and what has to be sourced first (ascend-torch-npu.md §4).
_ENV = {
    "ascend": {"source": ["/usr/local/Ascend/ascend-toolkit/set_env.sh", "/usr/local/Ascend/nnal/atb/set_env.sh"],
               "vars": {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1",
                        "HCCL_OP_EXPANSION_MODE": "AIV", "OMP_NUM_THREADS": "1"}},
    "cuda": {"source": [], "vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
    "cpu": {"source": [], "vars": {}},
}
# Host prerequisites pip cannot install: what to check and the commands that install it.
_HOST = {
    "ascend": [
        ("ascend_driver", "Ascend driver and firmware (matching the CANN version, see Huawei's HDK table)",
         "download Ascend-hdk-<chip>-npu-driver_<ver>_linux-<arch>.run and -firmware from https://www.hiascend.com/"
         "hardware/firmware-drivers, then: ./Ascend-hdk-*-npu-driver_*.run --full --install-for-all && "
         "./Ascend-hdk-*-npu-firmware_*.run --full"),
        ("cann", "CANN toolkit (Ascend-cann-toolkit, the version the matrix row needs)",
         "download Ascend-cann-toolkit_<ver>_linux-<arch>.run (and the kernels package for the chip) from "
         "https://www.hiascend.com/developer/download/community/result?module=cann, then: "
         "./Ascend-cann-toolkit_*.run --install && source /usr/local/Ascend/ascend-toolkit/set_env.sh"),
        ("nnal", "NNAL (libatb, for the ATB ops torch_npu and vLLM-Ascend call)",
         "./Ascend-cann-nnal_<ver>_linux-<arch>.run --install && source /usr/local/Ascend/nnal/atb/set_env.sh"),
    ],
    "cuda": [("nvidia_driver", "NVIDIA driver (R550+ for CUDA 12.4+ wheels)",
              "install the driver from https://www.nvidia.com/Download/index.aspx or your distribution's packages")],
    "cpu": [],
}


def runtime_env(backend: str) -> tuple[list[str], dict[str, str]]:
    """What the environment file of `install` holds for a backend (or a vendors.yaml family): the scripts to source
    first and the variables to export (image recipes bake the same into the image)."""
    if vendor := vendor_data.get(backend):
        return list(vendor.env_source), dict(vendor.env_vars)
    env = _ENV.get(backend, {"source": [], "vars": {}})
    return list(env["source"]), dict(env["vars"])


class InstallError(FlagdeployError):
    """The stack could not be installed or verified; the message says which step and how to retry."""


@dataclass
class InstallPlan:
    chip: str
    backend: str
    row: StackRow
    present: dict[str, str]  # package -> installed version (those the row names)
    to_install: list[str]  # pinned requirements not yet satisfied
    host_missing: list[tuple[str, str]] = field(default_factory=list)  # (what, how to install it)
    env: dict[str, str] = field(default_factory=dict)
    source: list[str] = field(default_factory=list)

    @property
    def vendor_to_install(self) -> list[str]:
        """The requirements still to install that are vendor builds (not on PyPI): pip needs the vendor's index
        (--vendor-index-url) or its wheels (--offline) for them."""
        return [req for req in self.to_install if Requirement(req).name in self.row.vendor_packages]

    def describe(self) -> str:
        r = self.row
        lines = [f"chip {self.chip} ({r.family}), engine {r.engine}; versions from: {r.source}",
                 f"  python    {sys.version.split()[0]} (needs {r.python})"]
        if r.unconfirmed:
            lines.append(f"  note      not backed by a stored source yet: {', '.join(r.unconfirmed)}")
        vendor = vendor_data.get(r.family)
        if vendor and vendor.unconfirmed:
            lines.append(f"  note      {vendor.name} in installer/vendors.yaml: {', '.join(vendor.unconfirmed)} not in "
                         "the facts doc either; nothing of this family ran on its silicon")
        lines += [f"  present   {n}=={v}" for n, v in sorted(self.present.items())]
        vendor_todo = self.vendor_to_install
        lines += [f"  install   {req}" + ("   (vendor build, not on PyPI)" if req in vendor_todo else "")
                  for req in self.to_install] or ["  install   nothing: every package is present"]
        for name, label in r.builds.items():
            lines.append(f"  build     {name} must be the +{label} build")
        if vendor_todo:
            origin = r.packages_from or (vendor.packages_from if vendor else "the chip vendor's own builds")
            where = (f"from {r.vendor_index}" if r.vendor_index else
                     f"{origin}; pass --vendor-index-url URL (the vendor's pip index) or --offline DIR (its wheels, "
                     "with the rest from `--download-only`)")
            lines.append(f"  from      {where}")
        for what, how in self.host_missing:
            lines += [f"  host      {what} is missing; flagdeploy cannot install it. Do:", f"            {how}"]
        if r.cann_min:
            lines.append(f"  CANN      >= {r.cann_min}")
        if r.image:
            lines.append(f"  image     {r.image} (the same stack, prebuilt)")
        return "\n".join(lines)


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def make_plan(info: SystemInfo, chip_id: str, engine: str = "builtin") -> InstallPlan:
    chip = get_chip(chip_id)
    if engine == "builtin":  # an edge chip (cpu-edge, ascend310b) installs the ONNX Runtime path
        from flagdeploy.edge import edge_info

        engine = edge_info(chip.id).get("engine", engine)
    family = next((a.family for a in info.accelerators if a.chip == chip.id), None) or chip_family(chip.id)
    row = resolve(family, engine)
    present, todo = {}, []
    for name, spec in row.packages.items():
        req = Requirement(f"{name}{spec}")
        have = _installed(name)
        if have is not None:
            present[name] = have
        cpu_build = name == "torch" and chip.backend == "cuda" and have is not None and have.endswith("+cpu")
        label = row.builds.get(name)
        other_build = label is not None and have is not None and not have.partition("+")[2].startswith(label)
        if have is None or cpu_build or other_build or not req.specifier.contains(have, prereleases=True):
            todo.append(str(req))  # (a CPU or other vendor's build of torch cannot drive the chip, whatever its version)
    missing = []
    for key, what, how in _HOST.get(chip.backend, []):
        if not _host_present(info, key):
            if key == "ascend_driver" and row.cann_min and (drivers := hdk.drivers_for(row.cann_min)):
                what = f"{what}: for CANN {row.cann_min}, Ascend HDK {', '.join(drivers)}"
            missing.append((what, how))
    if vendor := vendor_data.get(chip.backend):
        found = info.vendor_host.get(vendor.family, {})
        missing += [(need.what, need.how) for need in vendor.host if not found.get(need.key)]
    source, env = runtime_env(chip.backend)
    return InstallPlan(chip.id, chip.backend, row, present, todo, missing, env, source)


def _host_present(info: SystemInfo, key: str) -> bool:
    return {"ascend_driver": info.ascend_driver, "cann": info.cann, "nnal": info.nnal,
            "nvidia_driver": info.nvidia_driver}.get(key) not in (None, False, "")


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # pip's own progress, passed through
        print(line, end="", flush=True)
        tail = (tail + [line.rstrip()])[-15:]
    if proc.wait() != 0:
        raise InstallError(f"{what} failed (exit {proc.returncode}). Command: {' '.join(cmd)}\nLast lines:\n"
                           + "\n".join(f"  {t}" for t in tail) + "\nNothing was installed by this step; fix the cause "
                           "(network, index URL, disk) and run the same `flagdeploy install` again, or pass "
                           "--offline DIR with wheels from `flagdeploy install --download-only DIR`.")


def download(plan: InstallPlan, dest: Path, index_url: str | None = None, everything: bool = False,
             vendor_index_url: str | None = None) -> None:
    """Phase 1: every wheel the plan needs, with dependencies, into `dest`. `everything` (--download-only):
    every requirement of the stack, whatever this host has, since the wheels are for another host (all but
    flagdeploy itself, which that host needs already to run `install --offline`). The vendor builds of a row come
    from the vendor's index (`vendor_index_url`, else the row's), searched besides PyPI or its mirror."""
    wanted = ([r for r in plan.row.requirements() if Requirement(r).name != "flagdeploy"] if everything
              else plan.to_install)
    if not wanted:
        return
    vendor = [r for r in wanted if Requirement(r).name in plan.row.vendor_packages]
    vendor_index = vendor_index_url or plan.row.vendor_index
    if vendor and not vendor_index:
        raise InstallError(vendor_source_missing(plan, vendor))
    extra = ["--index-url", index_url] if index_url else []
    extra += ["--extra-index-url", vendor_index] if vendor and vendor_index else []
    _pip(["download", "--dest", str(dest), *extra, *wanted], "downloading the packages")


def vendor_source_missing(plan: InstallPlan, vendor_reqs: list[str]) -> str:
    """Why the vendor builds cannot be fetched, and the two ways to give pip a place to get them."""
    vendor = vendor_data.get(plan.row.family)
    where = plan.row.packages_from or (vendor.packages_from if vendor else "the chip vendor's own index")
    return (f"{', '.join(vendor_reqs)} are vendor builds, not on PyPI ({where}). Pass the vendor's pip index with "
            f"`flagdeploy install --chip {plan.chip} --vendor-index-url URL`, or put its wheels in a directory with the "
            f"rest of the stack and run `flagdeploy install --chip {plan.chip} --offline DIR`.")


def install(plan: InstallPlan, wheels: Path) -> None:
    """Phase 2: install from the downloaded wheels only."""
    if plan.to_install:
        _pip(["install", "--no-index", "--find-links", str(wheels), *plan.to_install], "installing the packages")


def write_env_file(plan: InstallPlan, path: Path) -> Path:
    lines = ["# written by `flagdeploy install`; source it before serving", *[f"[ -f {s} ] && . {s}" for s in plan.source],
             *[f"export {k}={v}" for k, v in plan.env.items()]]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


_VERIFY = """
import json, torch, flagdeploy
from flagdeploy import ops
be = ops.get_backend({backend!r})
facts = {{"runtime": "torch " + torch.__version__, "backend": be.name, "detected": be.detect()}}
if be.name == "cpu":
    facts["devices"] = 1
elif be.name == "ascend":
    import torch_npu
    facts["devices"] = torch.npu.device_count()
    facts["soc_version"] = torch_npu.npu.get_soc_version()
else:  # cuda, and the generic backend on its family's device type (its detect() imported the vendor's plugin)
    mod = getattr(torch, be.device_type, None)
    facts["devices"] = mod.device_count() if mod is not None and mod.is_available() else 0
if {engine!r} == "vllm-ascend":
    # the build's own record, read as a file: importing vllm_ascend would start the whole plugin
    import importlib.util, os, runpy
    spec = importlib.util.find_spec("vllm_ascend")
    info = os.path.join(os.path.dirname(spec.origin), "_build_info.py") if spec and spec.origin else None
    if info and os.path.exists(info):
        build = runpy.run_path(info)
        facts["build_soc"] = build.get("__soc_version__")
        facts["build_device_type"] = build.get("__device_type__")
print(json.dumps(facts))
"""

# torch_npu.npu.get_soc_version() -> family, as vLLM-Ascend's device/hardware.py reads it (ascend-torch-npu.md 1.11)
_SOC_FAMILIES = ((range(220, 226), "A2"), (range(250, 256), "A3"), (range(200, 206), "310P"), (range(260, 261), "950"))


def soc_family(soc_version: int) -> str | None:
    return next((family for versions, family in _SOC_FAMILIES if soc_version in versions), None)


# vLLM-Ascend's build-time SOC string (`_build_info.__soc_version__`, the SOC_VERSION it was compiled for)
# -> family, from the build SOC strings VA's Dockerfiles use (ascend-torch-npu.md 1.11)
_BUILD_FAMILIES = (("ascend910b", "A2"), ("ascend910_93", "A3"), ("ascend310p", "310P"), ("ascend950", "950"))


def build_family(soc: str | None, device_type: str | None = None) -> str | None:
    """The family a vLLM-Ascend build targets: its recorded device type where the build has one, else
    read from the SOC string it was compiled for."""
    if device_type:
        return str(device_type)
    soc = (soc or "").lower()
    return next((family for prefix, family in _BUILD_FAMILIES if soc.startswith(prefix)), None)


def probe(plan: InstallPlan, env: dict | None = None) -> dict:
    """What the installed stack reports in a fresh interpreter; on Ascend, the SoC family must be the
    plan's (an A2 stack on an A3 box imports fine and fails later, in the first kernel)."""
    env = {**os.environ, **plan.env, **(env or {})}
    out = subprocess.run([sys.executable, "-c", _VERIFY.format(backend=plan.chip, engine=plan.row.engine)],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise InstallError(f"the installed stack does not import: {out.stderr.strip().splitlines()[-1:]}. Run "
                           f"`flagdeploy doctor --chip {plan.chip}` for the likely cause.")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    if "soc_version" in facts:
        facts["family"] = soc_family(facts["soc_version"])
        if facts["family"] != plan.row.family:
            raise InstallError(f"the device reports SoC version {facts['soc_version']} ({facts['family'] or 'unknown'}), "
                               f"but this stack was planned for {plan.chip} ({plan.row.family}). Install for the chip "
                               f"that is here: `flagdeploy install --chip auto`.")
    if plan.row.engine == "vllm-ascend":
        _check_build(plan, facts)
    return facts


def _check_build(plan: InstallPlan, facts: dict) -> None:
    """vLLM-Ascend compiles its kernels for one SoC family: an A2 build imports on an A3 box and fails in
    its first custom op, so the build is checked against the chip before anything is served."""
    if "build_soc" not in facts and "build_device_type" not in facts:
        raise InstallError("vllm-ascend is not installed, or its build record (vllm_ascend/_build_info.py) is "
                           f"missing; reinstall it: `flagdeploy install --chip {plan.chip} --engine vllm-ascend`.")
    built = build_family(facts.get("build_soc"), facts.get("build_device_type"))
    facts["build_family"] = built
    if built != plan.row.family:
        image = f" or use the image {plan.row.image}" if plan.row.image else ""
        raise InstallError(f"vllm-ascend here was built for {facts.get('build_soc') or built} ({built or 'unknown'}), "
                           f"but {plan.chip} is {plan.row.family}: its kernels would fail on this chip. Install the "
                           f"{plan.row.family} build (from source with SOC_VERSION set to this chip's SoC){image}.")


def verify(plan: InstallPlan) -> dict:
    """Imports and device count in a fresh interpreter (with the env file's variables), then the op check."""
    env = {**os.environ, **plan.env}
    if plan.row.engine == "onnxruntime":
        return _verify_onnx(plan, env)
    facts = probe(plan)
    if not facts["detected"] or not facts["devices"]:
        raise InstallError(f"the {plan.backend} backend imports but sees no {plan.chip} device (devices: "
                           f"{facts['devices']}). Run `flagdeploy doctor --chip {plan.chip}`.")
    check = subprocess.run([sys.executable, "-m", "flagdeploy.cli", "ops", "check", "--chip", plan.chip],
                           capture_output=True, text=True, env=env, timeout=1800)
    facts["ops_check"] = (check.stdout.strip().splitlines() or ["(no output)"])[-1]
    if check.returncode != 0:
        raise InstallError(f"ops check failed on the device: {facts['ops_check']}. Attach the output of "
                           f"`flagdeploy selftest --chip {plan.chip}` to a bug report.")
    return facts


_VERIFY_ONNX = """
import json, onnxruntime as ort, onnxruntime_genai
print(json.dumps({"onnxruntime": ort.__version__, "providers": ort.get_available_providers()}))
"""


def _verify_onnx(plan: InstallPlan, env: dict) -> dict:
    """The ONNX Runtime path: the package imports and carries the chip's execution provider."""
    from flagdeploy.edge import edge_info

    out = subprocess.run([sys.executable, "-c", _VERIFY_ONNX], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise InstallError(f"onnxruntime does not import: {out.stderr.strip().splitlines()[-1:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    ep = edge_info(plan.chip).get("ort_ep", "CPUExecutionProvider")
    if ep not in facts["providers"]:
        pkg = edge_info(plan.chip).get("package", "the onnxruntime build with it")
        raise InstallError(f"onnxruntime {facts['onnxruntime']} has no {ep} (it has {', '.join(facts['providers'])}); "
                           f"install {pkg} instead of plain onnxruntime.")
    return {"runtime": f"onnxruntime {facts['onnxruntime']}", "devices": 1, "backend": ep,
            "ops_check": f"{ep} present"}

