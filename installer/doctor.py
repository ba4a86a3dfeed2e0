"""`flagdeploy doctor`: the install checks plus the mistakes users actually trip on, each as a finding
that says what is wrong, why it matters and how to fix it."""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from flagdeploy.chips import get_chip

from . import hdk
from . import vendors as vendor_data
from .detect import SystemInfo
from .findings import Finding


def _ascend(info: SystemInfo, chip, multi_node: bool = False) -> list[Finding]:
    out = []
    if info.in_container and not any("davinci" in d for d in info.device_nodes):
        out.append(Finding("fail", "no Ascend device nodes inside this container",
                           "the NPUs may exist on the host (and even show on its PCI bus) but were not passed in, so no "
                           "process here can open them",
                           "start the container with --device /dev/davinci0 (one per die) --device /dev/davinci_manager "
                           "--device /dev/devmm_svm --device /dev/hisi_hdc and mount /usr/local/Ascend/driver "
                           "(`flagdeploy deploy docker --chip ...` writes the command)"))
    elif not any(a.vendor == "huawei" for a in info.accelerators):
        out.append(Finding("fail", f"no Ascend NPU found for {chip.id}", "nothing to run on",
                           "check `npu-smi info` and the driver install; `flagdeploy install --dry-run` shows what is needed"))
    if not info.ascend_driver:
        out.append(Finding("fail", "Ascend driver not found (/usr/local/Ascend/driver/version.info)",
                           "torch_npu cannot open a device without it", "install the NPU driver and firmware (see `flagdeploy install --dry-run`)"))
    if not info.cann:
        out.append(Finding("fail", "CANN toolkit not found", "torch_npu's kernels come from CANN",
                           "install Ascend-cann-toolkit and `source /usr/local/Ascend/ascend-toolkit/set_env.sh`"))
    elif info.ascend_driver:
        out.append(_driver_pairing(info.cann, info.ascend_driver))
    if not info.nnal:
        out.append(Finding("warn", "NNAL (libatb) not installed", "torch_npu's _npu_* ATB ops and vLLM-Ascend need it",
                           "install Ascend-cann-nnal and `source /usr/local/Ascend/nnal/atb/set_env.sh`"))
    # with --nodes the multi-node preflight checks these against the interface it finds (installer/peers.py)
    if not multi_node and not os.environ.get("HCCL_SOCKET_IFNAME") and not os.environ.get("HCCL_IF_IP"):
        out.append(Finding("warn", "HCCL_SOCKET_IFNAME / HCCL_IF_IP not set",
                           "multi-node HCCL picks the first interface, often not the RoCE one, and hangs at init",
                           "for multi-node serving export HCCL_SOCKET_IFNAME=<the RoCE NIC> (and GLOO_SOCKET_IFNAME)"))
    return out


def _vendor(info: SystemInfo, chip, vendor: vendor_data.Vendor) -> list[Finding]:
    """A vendors.yaml family (the generic backend's chips): its device nodes inside a container, its devices, its
    host prerequisites, and a word on what of it is not confirmed. One function for every such vendor: what differs
    is data."""
    out = []
    have = [d.removeprefix("/dev/") for d in info.device_nodes]
    seen = lambda pattern: any(fnmatch.fnmatch(h, pattern) for h in have)  # noqa: E731
    missing = [f"/dev/{p}" for p in vendor.shared if not seen(p)]
    if vendor.per_device and not any(seen(p) for p in vendor.per_device):
        missing.insert(0, f"/dev/{vendor.per_device[0]}")
    if info.in_container and missing:
        out.append(Finding("fail", f"{vendor.name} device nodes missing inside this container: {', '.join(missing)}",
                           "the devices may exist on the host but were not passed in, so no process here can open them",
                           f"start the container with the device nodes {', '.join(vendor.device_node_paths())} "
                           f"(`flagdeploy deploy docker --chip {chip.id} ...` writes the command)"))
    elif not any(a.family == vendor.family for a in info.accelerators):
        tool = f"`{vendor.tool}`" if vendor.tool else "the vendor's tool"
        out.append(Finding("fail", f"no {vendor.name} device found for {chip.id}",
                           f"nothing to run on: {tool} did not answer and no device node "
                           f"({', '.join(vendor.device_node_paths())}) or PCI function of the vendor is here",
                           f"check {tool} and the driver install; `flagdeploy install --dry-run --chip {chip.id}` shows "
                           "what is needed"))
    found = info.vendor_host.get(vendor.family, {})
    for need in vendor.host:
        if not found.get(need.key):
            where = f"`{vendor.tool}` did not answer" if need.present == "tool" else f"/{need.present} is missing"
            out.append(Finding("fail", f"{need.what}: not found ({where})",
                               f"the {chip.id} stack (installer/matrix.yaml) runs on it", need.how))
    if vendor.unconfirmed:
        out.append(Finding("warn", f"{vendor.name}: these checks use {', '.join(vendor.unconfirmed)} that no stored "
                           "source confirms (installer/vendors.yaml), and nothing of this family ran on its silicon",
                           f"where they differ on this host, a finding above may be wrong: {vendor.source}",
                           "correct installer/vendors.yaml (one line per fact) and report it"))
    return out


def _driver_pairing(cann: str, driver: str) -> Finding:
    p = hdk.pairing(cann, driver)
    if p.supported is None:
        return Finding("warn", f"CANN {cann} with driver {driver}: pairing not checked",
                       "a CANN newer than its driver fails at device init with an opaque error, and flagdeploy's "
                       "table (installer/hdk.yaml) has no row for this CANN",
                       "compare both versions with the CANN release notes on hiascend.com ('CANN and Ascend HDK "
                       "Version Compatibility')")
    if p.supported:
        return Finding("ok", f"CANN {cann} with driver {driver}: a listed pairing", "; ".join(p.sources))
    other = hdk.cann_for(driver)
    return Finding("fail", f"driver {driver} is not one CANN {cann} supports",
                   f"CANN {cann} is listed with Ascend HDK {', '.join(p.drivers)} (installer/hdk.yaml, from Huawei's "
                   "release notes); with another driver it fails at device init with an opaque error",
                   "install an Ascend HDK driver and firmware from that list"
                   + (f", or a CANN this driver is listed with ({', '.join(other)})" if other else ""))


def run(info: SystemInfo, chip_id: str, model: str | None = None, devices: int | None = None,
        max_model_len: int = 32768, cache_dir: Path | None = None, nodes: str | None = None,
        **node_options) -> list[Finding]:
    """The findings for this host; with `nodes` ('HOST[:PORT],...') also the multi-node preflight, which
    takes node_options (node_rank, nic, port, timeout, root, env, bind_host: see installer/peers.py)."""
    chip = get_chip(chip_id)
    out: list[Finding] = []
    if chip.backend == "ascend":
        out += _ascend(info, chip, multi_node=bool(nodes))
    elif chip.backend == "cuda" and not info.nvidia_driver:
        out.append(Finding("fail", "no NVIDIA driver found", "CUDA cannot see a GPU", "install the NVIDIA driver; check `nvidia-smi`"))
    elif vendor := vendor_data.get(chip.backend):
        out += _vendor(info, chip, vendor)
    from .install import make_plan

    plan = make_plan(info, chip.id)
    if plan.to_install:
        out.append(Finding("warn", f"packages missing or at other versions: {', '.join(plan.to_install)}",
                           "the matrix row pins what is known to work together", f"flagdeploy install --chip {chip.id}"))
    if model:  # planned on what this host has, where it was detected (the catalog's figures are nominal)
        found = next((a for a in info.accelerators if a.chip == chip.id), None)
        memory = (found.memory_gib if found else None) or (info.memory_gib if chip.backend == "cpu" else None)
        out += _model(chip, model, devices or (found.count if found else chip.devices_per_node), max_model_len,
                      cache_dir, memory)
    if nodes:
        out += run_nodes(info, chip.id, nodes, **node_options)
    if not any(f.level != "ok" for f in out):
        out.append(Finding("ok", f"no problem found for {chip.id}" + (" on these nodes" if nodes else "")))
    return out


def run_nodes(info: SystemInfo, chip_id: str, nodes: str, **options) -> list[Finding]:
    """The multi-node preflight alone (`doctor --nodes`): this node's interface, the interface variables,
    the NPUs' RoCE ports, then every peer reached on its port with the versions compared."""
    from .peers import preflight

    return preflight(info, chip_id, nodes, **options)


def _model(chip, model: str, devices: int, max_model_len: int, cache_dir: Path | None,
           memory_gib: float | None = None) -> list[Finding]:
    from flagdeploy.planner import PlanRequest, make_plan

    plan = make_plan(PlanRequest(model, chip.id, devices, max_model_len=max_model_len, concurrency=1,
                                 memory_gib=memory_gib))
    out = []
    if plan.chosen is None:
        out.append(Finding("fail", f"{plan.model_name} does not fit on {devices} x {chip.id} at --max-model-len "
                           f"{max_model_len}", "the server would fail while loading or at the first long request",
                           "; ".join(plan.suggestions)))
    else:
        out.append(Finding("ok", f"{plan.model_name} fits on {devices} x {chip.id} as {plan.chosen.layout}"))
    path = cache_dir or Path(os.environ.get("FLAGDEPLOY_CACHE", Path.home() / ".cache" / "flagdeploy"))
    probe = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if free < plan.weight_bytes * 1.1:
        out.append(Finding("fail", f"{free / 2**30:.0f} GiB free at {probe}, the weights need "
                           f"{plan.weight_bytes / 2**30:.0f} GiB", "the download or conversion stops half-way",
                           "free space or point FLAGDEPLOY_CACHE at a larger disk"))
    return out


def format_findings(findings: list[Finding]) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    lines = []
    for f in findings:
        lines.append(f"[{mark[f.level]}] {f.what}")
        if f.why:
            lines.append(f"       why: {f.why}")
        if f.fix:
            lines.append(f"       fix: {f.fix}")
    return "\n".join(lines)
