"""`flagdeploy doctor --nodes`: what would make a multi-node start hang, found in seconds instead of after a
30-minute rendezvous timeout.

Run on every node at about the same time, each naming all nodes (itself included). Each doctor

1. finds its own entry (`--node-rank`, else the entry whose address is one of this host's) and the network
   interface the engine will use (`--nic`, else the one owning the local address that routes to the first
   node), and checks that the interface exists, is up and has that address;
2. checks the interface variables (GLOO/TP/NCCL/HCCL_SOCKET_IFNAME, HCCL_IF_IP) against that interface;
3. on Ascend, reads each NPU's RoCE port from `hccn_tool` (link, net health, device IP, TLS switch);
4. listens on its rendezvous port and connects to every peer's, exchanging a JSON fingerprint (versions,
   chip, device count, the NPUs' device IPs): a peer that never answers is named, and so is every version
   that differs between nodes;
5. on Ascend, pings each peer's device IPs from the local NPU of the same index (`hccn_tool -ping`).

Everything read from the OS goes through `root` the way installer/detect.py does: on a recorded system
(tests) `ip -j addr`, `ip -j route get` and `hccn_tool` answers are the files `root/.commands/<record>`.
Facts and sources: /work/shared/docs/speculative-multimodal-multinode.md section 3 (vLLM-Ascend
installation.md pre-flight, the GLM5 two-node tutorial's variables, vllm#5094, vllm-ascend#16754).
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import platform
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flagdeploy import __version__
from flagdeploy.chips import get_chip
from flagdeploy.errors import FlagdeployError

from .detect import ROOT, SystemInfo, chip_family, command_output
from .findings import Finding

__all__ = ["DEFAULT_PORT", "NodeAddr", "Interface", "HccnPort", "PingResult", "Exchange", "parse_nodes",
           "parse_ip_addr", "interfaces", "route_source", "fingerprint", "exchange", "hccn_ports", "hccn_ping",
           "parse_link", "parse_net_health", "parse_ip", "parse_tls", "parse_ping", "local_checks", "preflight"]

DEFAULT_PORT = 29500
PROTOCOL = "flagdeploy-doctor/1"
HCCN_TOOL = "/usr/local/Ascend/driver/tools/hccn_tool"  # where the driver package puts it (VA installation.md)
PACKAGES = {"flagdeploy": "flagdeploy", "torch": "torch", "torch_npu": "torch-npu", "vllm": "vllm",
            "vllm_ascend": "vllm-ascend", "sglang": "sglang"}
# Fingerprint fields compared across nodes: a difference in these fails, in the others it warns.
MUST_MATCH = ("flagdeploy", "torch", "torch_npu", "vllm", "vllm_ascend", "sglang", "python", "chip", "driver",
              "cann", "hccn_tls")
SHOULD_MATCH = ("devices", "cuda")
LABELS = {"cann": "CANN", "driver": "driver", "cuda": "CUDA toolkit", "devices": "device count", "chip": "chip",
          "python": "Python", "hccn_tls": "NPU TLS switch (hccn_tool -tls -g)"}
# `hccn_tool -net_health -g` values other than Success (Huawei's documented set) all mean the port cannot talk.
HEALTHY = "success"


class NodesError(FlagdeployError):
    """--nodes / --node-rank / --nic that cannot describe a deployment."""


# ---- the node list -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeAddr:
    rank: int
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self})"


def parse_nodes(text: str | list[str], default_port: int = DEFAULT_PORT) -> list[NodeAddr]:
    """'HOST[:PORT],HOST[:PORT],...' (an IPv6 address in brackets: [fd00::1]:29500) -> entries, rank = position."""
    items = text.split(",") if isinstance(text, str) else list(text)
    nodes = []
    for rank, item in enumerate(i.strip() for i in items):
        if not item:
            raise NodesError(f"--nodes has an empty entry at position {rank}: give HOST[:PORT],HOST[:PORT],...")
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", item) or re.fullmatch(r"([^:\s]+)(?::(\d+))?", item)
        if not m:
            raise NodesError(f"--nodes entry {item!r} is not HOST[:PORT] (write an IPv6 address as [ADDR]:PORT)")
        port = int(m.group(2)) if m.group(2) else default_port
        if not 0 < port < 65536:
            raise NodesError(f"--nodes entry {item!r}: port {port} is out of range")
        nodes.append(NodeAddr(rank, m.group(1), port))
    if len(nodes) < 2:
        raise NodesError("--nodes names one node: list every node of the deployment, this one included")
    if len({(n.host, n.port) for n in nodes}) < len(nodes):
        raise NodesError(f"--nodes names the same HOST:PORT twice: {','.join(map(str, nodes))}")
    return nodes


def _resolve(host: str) -> list[str]:
    """The addresses a name resolves to here ([] when it does not)."""
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


# ---- interfaces ----------------------------------------------------------------------------------------


@dataclass
class Interface:
    name: str
    flags: list[str]
    operstate: str
    addresses: list[str] = field(default_factory=list)

    @property
    def loopback(self) -> bool:
        return "LOOPBACK" in self.flags

    @property
    def admin_up(self) -> bool:
        return "UP" in self.flags

    @property
    def carrier(self) -> bool:
        return "LOWER_UP" in self.flags and "NO-CARRIER" not in self.flags

    @property
    def up(self) -> bool:
        return self.admin_up and self.carrier


def parse_ip_addr(text: str) -> list[Interface]:
    """Interfaces from `ip -j addr` (iproute2's JSON: ifname, flags, operstate, addr_info[].local)."""
    try:
        rows = json.loads(text)
    except ValueError:
        return []
    out = []
    for r in rows if isinstance(rows, list) else []:
        if not isinstance(r, dict) or not r.get("ifname"):
            continue
        addrs = [a["local"] for a in r.get("addr_info") or [] if isinstance(a, dict) and a.get("local")
                 and a.get("family") in ("inet", "inet6")]
        out.append(Interface(r["ifname"], list(r.get("flags") or []), str(r.get("operstate", "UNKNOWN")), addrs))
    return out


def _sysfs_interfaces(root: Path) -> list[Interface]:
    """Without `ip`: names, flags and carrier from /sys/class/net, IPv4 addresses through SIOCGIFADDR."""
    import fcntl
    import struct

    out = []
    for dev in sorted((Path(root) / "sys/class/net").glob("*")):
        try:
            bits = int((dev / "flags").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        try:
            carrier = (dev / "carrier").read_text().strip() == "1"
        except OSError:  # reading carrier of an interface that is down fails with EINVAL
            carrier = False
        flags = [f for f, on in (("UP", bits & 0x1), ("LOOPBACK", bits & 0x8), ("LOWER_UP", carrier)) if on]
        state = ((dev / "operstate").read_text().strip().upper() if (dev / "operstate").exists() else "UNKNOWN")
        addrs = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", dev.name.encode()[:15])
                addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))  # SIOCGIFADDR
            except OSError:
                pass
        out.append(Interface(dev.name, flags, state, addrs))
    return out


def interfaces(root: Path = ROOT) -> list[Interface]:
    """This host's interfaces: `ip -j addr` (recorded as root/.commands/ip-j-addr.json), else sysfs."""
    text = command_output(root, ["ip", "-j", "addr"], "ip-j-addr.json")
    found = parse_ip_addr(text) if text else []
    if not found and Path(root).resolve() == ROOT:
        found = _sysfs_interfaces(Path(root))
    return found


def route_source(root: Path, dest: str) -> str | None:
    """The local address the kernel would use to reach `dest`: a UDP connect on the live host (nothing is
    sent), else `prefsrc` of the recorded `ip -j route get DEST` (root/.commands/ip-j-route-get.json)."""
    if Path(root).resolve() != ROOT:
        text = command_output(root, ["ip", "-j", "route", "get", dest], "ip-j-route-get.json")
        try:
            rows = json.loads(text or "[]")
            return next((r.get("prefsrc") for r in rows if isinstance(r, dict) and r.get("prefsrc")), None)
        except ValueError:
            return None
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _owner(ifaces: list[Interface], addr: str) -> Interface | None:
    return next((i for i in ifaces if addr in i.addresses), None)


def _ifname_matches(value: str, nic: str, prefix: bool) -> bool:
    """Whether an *_SOCKET_IFNAME value selects `nic`. NCCL's documented syntax: a comma list of prefixes,
    `=` for exact names, `^` to exclude; HCCL_SOCKET_IFNAME is taken to follow it (UNCONFIRMED for HCCL).
    Gloo and TensorPipe take exact names."""
    value = value.strip()
    exclude = value.startswith("^")
    exact = not prefix
    body = value.lstrip("^")
    if body.startswith("="):
        exact, body = True, body[1:]
    names = [n.strip() for n in body.split(",") if n.strip()]
    hit = any(nic == n if exact else nic.startswith(n) for n in names)
    return not hit if exclude else hit


# ---- fingerprint and the exchange ----------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    """Versions of the Python packages whose mismatch across nodes breaks a distributed start."""
    out: dict[str, str | None] = {}
    for key, dist in PACKAGES.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    out["flagdeploy"] = out["flagdeploy"] or __version__
    return out


def fingerprint(info: SystemInfo, chip_id: str, versions: dict | None = None) -> dict:
    """What must be the same on every node, from detection (SystemInfo) and the installed packages."""
    chip = get_chip(chip_id)
    acc = next((a for a in info.accelerators if a.chip == chip_id), None) or next(
        (a for a in info.accelerators if a.vendor == chip.vendor), None)
    fp = {
        "chip": chip_id,
        "devices": acc.count if acc else None,
        "driver": info.ascend_driver if chip.backend == "ascend" else info.nvidia_driver,
        "cann": info.cann,
        "cuda": info.cuda,
        "python": ".".join(platform.python_version_tuple()[:2]),
        **package_versions(),
    }
    fp.update(versions or {})
    return fp


@dataclass
class Exchange:
    answers: dict[int, dict] = field(default_factory=dict)  # rank dialled -> its message
    seconds: dict[int, float] = field(default_factory=dict)  # rank dialled -> time until it answered
    inbound: dict[int, dict] = field(default_factory=dict)  # rank it claimed -> message of a peer that dialled us
    errors: dict[int, str] = field(default_factory=dict)  # rank dialled -> last failure
    listen_error: str | None = None


def _read_message(conn: socket.socket) -> dict | None:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < 1 << 20:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    try:
        msg = json.loads(buf.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return msg if isinstance(msg, dict) and msg.get("protocol") == PROTOCOL and isinstance(msg.get("rank"), int) else None


def _why(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (the host answers but nothing listens on that port)"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timed out (packets dropped: a firewall, a wrong address or no route)"
    if isinstance(exc, socket.gaierror):
        return f"the name does not resolve ({exc.strerror or exc})"
    return exc.strerror or str(exc) or type(exc).__name__


def exchange(me: NodeAddr, nodes: list[NodeAddr], message: dict, timeout: float,
             bind_host: str | None = None) -> Exchange:
    """Listen on `me.port` and dial every other node until each peer has answered and has dialled us, or
    `timeout` seconds pass. Each side sends `message` (one JSON line) and gets the other's back."""
    peers = [n for n in nodes if n.rank != me.rank]
    ex, lock, stop = Exchange(), threading.Lock(), threading.Event()
    deadline = time.monotonic() + timeout
    payload = (json.dumps({**message, "protocol": PROTOCOL, "rank": me.rank}) + "\n").encode()

    server = None
    if bind_host is None and socket.has_dualstack_ipv6():
        try:
            server = socket.create_server(("::", me.port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:  # IPv6 off in the kernel, or the port taken: IPv4 says which
            server = None
    if server is None:
        try:
            server = socket.create_server((bind_host or "0.0.0.0", me.port))
        except OSError as exc:
            ex.listen_error = exc.strerror or str(exc)
    if server:
        server.settimeout(0.2)

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5.0)
                msg = _read_message(conn)
                if msg is None:
                    return
                conn.sendall(payload)
            except OSError:
                return
            with lock:
                ex.inbound[msg["rank"]] = msg

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def dial(peer: NodeAddr) -> None:
        start = time.monotonic()
        other = "something other than a flagdeploy doctor holds that port (an engine still running?)"
        while (left := deadline - time.monotonic()) > 0:
            try:
                s = socket.create_connection((peer.host, peer.port), timeout=min(2.0, left))
            except OSError as exc:
                err = _why(exc)
            else:
                with s:
                    try:
                        s.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
                        s.sendall(payload)
                        msg = _read_message(s)
                    except OSError:  # connected, then silence or a reset: not a doctor
                        msg = None
                if msg is not None:
                    with lock:
                        ex.answers[peer.rank] = msg
                        ex.seconds[peer.rank] = time.monotonic() - start
                        ex.errors.pop(peer.rank, None)
                    return
                err = other
            with lock:
                ex.errors[peer.rank] = err
            time.sleep(max(0.0, min(0.25, deadline - time.monotonic())))

    serving = threading.Thread(target=serve, daemon=True) if server else None
    if serving:
        serving.start()
    dialers = [threading.Thread(target=dial, args=(p,), daemon=True) for p in peers]
    for t in dialers:
        t.start()
    while time.monotonic() < deadline:
        with lock:
            heard = set(ex.inbound)
        if not any(t.is_alive() for t in dialers) and (server is None or {p.rank for p in peers} <= heard):
            break
        time.sleep(0.05)
    stop.set()
    for t in dialers:
        t.join(timeout=2.5)
    if server:
        server.close()
        serving.join(timeout=1.0)
    return ex


# ---- hccn_tool -----------------------------------------------------------------------------------------


@dataclass
class HccnPort:
    """One NPU's RoCE port as `hccn_tool -i N -link|-net_health|-ip|-tls -g` reports it."""

    device: int
    link: str | None
    health: str | None
    ip: str | None
    netmask: str | None
    tls: str | None


@dataclass
class PingResult:
    sent: int
    received: int
    loss: float | None  # percent

    @property
    def ok(self) -> bool:
        return self.sent > 0 and self.received == self.sent


def parse_link(text: str | None) -> str | None:
    m = re.search(r"link status\s*:\s*(\w+)", text or "", re.I)
    return m.group(1).upper() if m else None


def parse_net_health(text: str | None) -> str | None:
    m = re.search(r"net health status\s*:\s*(.+?)\s*$", text or "", re.I | re.M)
    return m.group(1) if m else None


def parse_ip(text: str | None) -> tuple[str | None, str | None]:
    ip = re.search(r"^\s*ipaddr\s*:\s*(\S+)", text or "", re.M)
    mask = re.search(r"^\s*netmask\s*:\s*(\S+)", text or "", re.M)
    return (ip.group(1) if ip else None), (mask.group(1) if mask else None)


def parse_tls(text: str | None) -> str | None:
    m = re.search(r"tls switch\s*\[\d+\]\s*:\s*(\d+)", text or "", re.I)
    return m.group(1) if m else None


def parse_ping(text: str | None) -> PingResult | None:
    """The summary line '3 packets transmitted, 3 received, 0.00% packet loss'. The numbers are read, never
    substring-matched ('0.00% packet loss' is inside '100.00% packet loss')."""
    m = re.search(r"(\d+)\s+packets?\s+transmitted,\s*(\d+)\s+received(?:,\s*([\d.]+)%\s*packet loss)?",
                  text or "", re.I)
    if m:
        return PingResult(int(m.group(1)), int(m.group(2)), float(m.group(3)) if m.group(3) else None)
    timeouts = len(re.findall(r"recv time out", text or "", re.I))
    return PingResult(timeouts, 0, 100.0) if timeouts else None


def _hccn(root: Path) -> str | None:
    """The hccn_tool to run ('hccn_tool' on PATH, else the driver's copy), or None when absent."""
    if Path(root).resolve() != ROOT:
        return "hccn_tool" if (Path(root) / ".commands" / "hccn_tool-i0-link.txt").exists() else None
    if shutil.which("hccn_tool"):
        return "hccn_tool"
    return HCCN_TOOL if Path(HCCN_TOOL).exists() else None


def hccn_ports(root: Path, count: int) -> list[HccnPort] | None:
    """Each NPU's RoCE port (devices 0..count-1; an A3 node has 16 dies), or None without hccn_tool."""
    exe = _hccn(root)
    if not exe:
        return None

    def one(i: int) -> HccnPort:
        get = lambda what: command_output(root, [exe, "-i", str(i), f"-{what}", "-g"],  # noqa: E731
                                          f"hccn_tool-i{i}-{what}.txt", any_returncode=True)
        ip, mask = parse_ip(get("ip"))
        return HccnPort(i, parse_link(get("link")), parse_net_health(get("net_health")), ip, mask, parse_tls(get("tls")))

    with ThreadPoolExecutor(max_workers=min(16, max(count, 1))) as pool:
        return list(pool.map(one, range(count)))


def hccn_ping(root: Path, device: int, address: str, timeout: float = 15) -> PingResult | None:
    """`hccn_tool -i DEVICE -ping -g address ADDRESS` (recorded as hccn_tool-iDEVICE-ping-ADDRESS.txt)."""
    exe = _hccn(root)
    if not exe:
        return None
    text = command_output(root, [exe, "-i", str(device), "-ping", "-g", "address", address],
                          f"hccn_tool-i{device}-ping-{address}.txt", timeout=timeout, any_returncode=True)
    return parse_ping(text)


# ---- the checks ----------------------------------------------------------------------------------------


@dataclass
class Local:
    """What the local checks found, for the exchange and the peer checks."""

    nodes: list[NodeAddr]
    me: NodeAddr | None = None
    nic: Interface | None = None
    address: str | None = None
    all_loopback: bool = False
    ports: list[HccnPort] | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def npu_ips(self) -> dict[str, str]:
        return {str(p.device): p.ip for p in self.ports or [] if p.ip}


def _own_entry(nodes: list[NodeAddr], node_rank: int | None, local_addrs: set[str], resolved: dict[str, list[str]],
               out: list[Finding]) -> NodeAddr | None:
    if node_rank is not None:
        if not 0 <= node_rank < len(nodes):
            out.append(Finding("fail", f"--node-rank {node_rank} is not a position in --nodes (0..{len(nodes) - 1})",
                               "each node is its position in the list, the same list on every node",
                               "pass the position of this host's entry"))
            return None
        me = nodes[node_rank]
        addrs = resolved[me.host]
        if addrs and not set(addrs) & local_addrs:
            out.append(Finding("fail", f"--node-rank {node_rank} is {me.label}, but {me.host} is not an address of "
                               f"this host ({', '.join(addrs)})",
                               "peers would dial that address and reach another machine, or none",
                               "pass the --node-rank of this host's entry, or fix the entry in --nodes"))
        return me
    mine = [n for n in nodes if set(resolved[n.host]) & local_addrs]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        out.append(Finding("fail", "this host is not in --nodes (no entry is one of its addresses: "
                           f"{', '.join(sorted(local_addrs - {'127.0.0.1', '::1'})) or 'none'})",
                           "each node must name every node, itself included, with the address peers reach it at",
                           "add this host to --nodes, or pass --node-rank R for its entry"))
    else:
        out.append(Finding("fail", f"several --nodes entries are addresses of this host ({', '.join(map(str, mine))})",
                           "the doctor cannot tell which node it is", "pass --node-rank R"))
    return None


def _choose_nic(nodes: list[NodeAddr], me: NodeAddr | None, nic: str | None, ifaces: list[Interface],
                resolved: dict[str, list[str]], root: Path, loc: Local) -> None:
    out = loc.findings
    listed = [a for a in (resolved[me.host] if me else []) if _owner(ifaces, a)]
    if nic:
        found = next((i for i in ifaces if i.name == nic), None)
        if not found:
            out.append(Finding("fail", f"interface {nic} does not exist on this host",
                               "the engine (HCCL/NCCL/gloo) would fail to bind it, or fall back to another one",
                               f"pick one of: {', '.join(i.name for i in ifaces) or '(none found)'}"))
            return
        explicit = True
    else:
        first = nodes[0]
        dest = (resolved[first.host] or [first.host])[0]
        src = route_source(root, dest)
        found = _owner(ifaces, src) if src else None
        if not found:
            out.append(Finding("fail", f"no local interface routes to the first node {first.label}"
                               + (f" (source address {src} is on no interface)" if src else ""),
                               "every node must reach the first one, where the rendezvous runs",
                               "check the route (`ip route get ADDRESS`) or pass --nic"))
            return
        explicit = False
        loc.address = src
    loc.nic = found
    if not found.admin_up:
        out.append(Finding("fail", f"interface {found.name} is down (administratively)",
                           "nothing leaves through it; the collectives would wait for their connect timeout",
                           f"`ip link set {found.name} up`, or pass --nic with the interface that carries the "
                           "inter-node traffic"))
    elif not found.carrier:
        out.append(Finding("fail", f"interface {found.name} has no link (operstate {found.operstate})",
                           "the cable, optical module or switch port is down",
                           "check the cable/transceiver and the switch port, or pass --nic with another interface"))
    if not found.addresses:
        out.append(Finding("fail", f"interface {found.name} has no IP address",
                           "the engine binds the interface's address; there is none to bind",
                           f"configure an address on {found.name} or pass --nic with the interface that has one"))
        return
    if listed and not set(listed) & set(found.addresses):
        where = _owner(ifaces, listed[0])
        out.append(Finding("fail" if explicit else "warn",
                           f"{me.label} names {listed[0]}, which is on {where.name if where else '?'}, not on the chosen "
                           f"interface {found.name} ({', '.join(found.addresses)})",
                           "peers dial the listed address while HCCL/NCCL/gloo bind the chosen interface: the traffic "
                           "takes two paths, and a firewall or route on one of them stalls the start",
                           f"list this node by an address of {found.name}, or pass --nic "
                           f"{where.name if where else 'IFNAME'}"))
        loc.address = loc.address or found.addresses[0]
    else:
        loc.address = next((a for a in listed if a in found.addresses), None) or (
            loc.address if loc.address in found.addresses else found.addresses[0])
    if found.loopback and not loc.all_loopback:
        out.append(Finding("fail", f"the chosen interface is the loopback ({found.name}, {loc.address})",
                           "peers on other machines cannot reach it; gloo then fails with 'connectFullMesh failed'",
                           "pass --nic with the interface that carries the inter-node traffic, and check that no "
                           "node name maps to 127.0.x.x in /etc/hosts"))
    elif found.up:
        how = "" if explicit else (" (the first node's address)" if me and me.rank == 0 else
                                   f" (it routes to the first node, {nodes[0].label})")
        out.append(Finding("ok", f"interface {found.name} is up with {loc.address}{how}"))


def _ifname_env(backend: str, loc: Local, env: dict, ifaces: list[Interface], direct_out: bool) -> list[Finding]:
    """GLOO/TP/NCCL/HCCL_SOCKET_IFNAME and HCCL_IF_IP against the chosen interface."""
    nic, out = loc.nic.name, []
    names = [("GLOO_SOCKET_IFNAME", False), ("TP_SOCKET_IFNAME", False)]
    names += [("NCCL_SOCKET_IFNAME", True)] if backend == "cuda" else []
    names += [("HCCL_SOCKET_IFNAME", True)] if backend == "ascend" else []
    unset = []
    for var, prefix in names:
        value = env.get(var)
        if not value:
            if var != "NCCL_SOCKET_IFNAME":  # NCCL skips lo and docker* itself; gloo resolves the hostname
                unset.append(var)
        elif not _ifname_matches(value, nic, prefix):
            out.append(Finding("fail", f"{var}={value} does not select {nic}, the interface that reaches the other nodes",
                               "ranks bind another interface than the one their peers reach; gloo then fails with "
                               "'connectFullMesh failed' or the collectives hang (vllm#5094)",
                               f"export {var}={nic} on this node (and the matching interface on every node)"))
    if_ip = env.get("HCCL_IF_IP") if backend == "ascend" else None
    if if_ip:
        owner = _owner(ifaces, if_ip)
        if not owner:
            out.append(Finding("fail", f"HCCL_IF_IP={if_ip} is not an address of this host",
                               "HCCL binds its host socket there and fails at init",
                               f"export HCCL_IF_IP={loc.address} or unset it and export HCCL_SOCKET_IFNAME={nic}"))
        elif direct_out:
            out.append(Finding("warn", "HCCL_IF_IP is set while this node's NPUs have their own RoCE ports "
                               "(hccn_tool shows device IPs)",
                               "with NPU direct-out RoCE a two-node A2 start was reported to break at HCCL init with "
                               "HCCL_IF_IP set, and to work with HCCL_SOCKET_IFNAME alone (vllm-ascend#16754)",
                               f"unset HCCL_IF_IP; export HCCL_SOCKET_IFNAME={nic} GLOO_SOCKET_IFNAME={nic} "
                               f"TP_SOCKET_IFNAME={nic}"))
        elif owner.name != nic:
            out.append(Finding("warn", f"HCCL_IF_IP={if_ip} is on {owner.name}, not on {nic}",
                               "HCCL's host traffic would leave by another interface than gloo's and the peers'",
                               f"export HCCL_IF_IP={loc.address}"))
    if backend == "ascend" and not if_ip and "HCCL_SOCKET_IFNAME" in unset:
        advice = f"export HCCL_SOCKET_IFNAME={nic} GLOO_SOCKET_IFNAME={nic} TP_SOCKET_IFNAME={nic}"
        if not direct_out:
            advice += f" (or HCCL_IF_IP={loc.address}: these NPUs show no RoCE device IP, so HCCL_IF_IP is safe here)"
        else:
            advice += " (not HCCL_IF_IP: with NPU direct-out RoCE it was reported to break init, vllm-ascend#16754)"
        out.append(Finding("warn", f"{', '.join(unset)} not set",
                           "multi-node HCCL and gloo then pick an interface themselves (gloo: the one the hostname "
                           "resolves to), often not the one the nodes reach each other by, and hang at init",
                           advice + ", on every node with its own interface"))
    elif unset := [v for v in unset if not (if_ip and v == "HCCL_SOCKET_IFNAME")]:  # HCCL_IF_IP configures HCCL
        out.append(Finding("warn", f"{', '.join(unset)} not set",
                           "gloo then binds the address the hostname resolves to, often loopback or a management "
                           "network, and the start fails with 'connectFullMesh failed' (vllm#5094)",
                           "export " + " ".join(f"{v}={nic}" for v in unset) + ", on every node with its own interface"))
    if not out:
        out.append(Finding("ok", f"interface variables select {nic}"))
    return out


def _hccn_local(ports: list[HccnPort] | None, root: Path, in_container: bool) -> list[Finding]:
    if ports is None:
        return [Finding("warn", "hccn_tool not found: the NPUs' RoCE links were not checked",
                        "a link that is down or an NPU without a device IP shows only as an HCCL timeout",
                        f"run on the host, or mount {HCCN_TOOL} (and /etc/hccn.conf) into the container")]
    out = []
    down = [p for p in ports if p.link != "UP"]
    sick = [p for p in ports if p.health and p.health.lower() != HEALTHY]
    no_ip = [p for p in ports if not p.ip]
    if down:
        out.append(Finding("fail", "NPU RoCE link not up on device " + ", ".join(
                           f"{p.device} ({p.link or 'no answer'})" for p in down),
                           "HCCL's cross-node traffic on those NPUs has nowhere to go; the start hangs until "
                           "HCCL_CONNECT_TIMEOUT", "check the optical module, the cable and the switch port "
                           "(`hccn_tool -i N -link -g`, `-lldp -g`)"))
    if sick:
        out.append(Finding("fail", "NPU network health not Success on device " + ", ".join(
                           f"{p.device} ({p.health})" for p in sick),
                           "the NPU's periodic probe of its detect IP fails: the RoCE path or its configuration is broken",
                           "check `hccn_tool -i N -netdetect -g` and `-gateway -g` and /etc/hccn.conf"))
    if no_ip:
        out.append(Finding("fail", f"no device IP on NPU {', '.join(str(p.device) for p in no_ip)} "
                           "(`hccn_tool -i N -ip -g` shows no ipaddr)",
                           "HCCL addresses each NPU of another node by its device IP",
                           "configure the NPU addresses (/etc/hccn.conf, `hccn_tool -i N -ip -s address A netmask M`)"))
    if not (Path(root) / "etc/hccn.conf").exists() and not in_container:
        out.append(Finding("warn", "/etc/hccn.conf not found", "the NPU network configuration normally lives there",
                           "check the NPU network setup (vLLM-Ascend installation guide, multi-node pre-flight)"))
    if not out:
        out.append(Finding("ok", f"{len(ports)} NPU RoCE links up, healthy, with device IPs"))
    return out


def local_checks(info: SystemInfo, chip_id: str, nodes: str | list[NodeAddr], *, node_rank: int | None = None,
                 nic: str | None = None, port: int = DEFAULT_PORT, root: Path = ROOT,
                 env: dict | None = None) -> Local:
    """Everything this node can check alone: its entry, its interface, the interface variables, hccn_tool."""
    nodes = parse_nodes(nodes, port) if not isinstance(nodes, list) else nodes
    env = dict(os.environ) if env is None else env
    root = Path(root)
    loc = Local(nodes)
    out = loc.findings
    ifaces = interfaces(root)
    local_addrs = {a for i in ifaces for a in i.addresses}
    resolved = {n.host: _resolve(n.host) for n in nodes}
    for n in nodes:
        if not resolved[n.host]:
            out.append(Finding("fail", f"{n.label}: {n.host} does not resolve here",
                               "this node cannot reach it, nor can the engine", "use an IP address, or fix DNS or /etc/hosts"))
    loc.all_loopback = all(resolved[n.host] and all(map(_is_loopback, resolved[n.host])) for n in nodes)
    if not loc.all_loopback:
        for n in nodes:
            if resolved[n.host] and all(map(_is_loopback, resolved[n.host])):
                out.append(Finding("fail", f"{n.label} resolves to the loopback ({', '.join(resolved[n.host])})",
                                   "the other nodes cannot reach a loopback address; a name that /etc/hosts maps to "
                                   "127.0.1.1 makes gloo and the rendezvous bind loopback",
                                   f"list {n.host}'s routable address in --nodes, or fix /etc/hosts"))
    loc.me = _own_entry(nodes, node_rank, local_addrs, resolved, out)
    _choose_nic(nodes, loc.me, nic, ifaces, resolved, root, loc)
    chip = get_chip(chip_id)
    if chip.backend == "ascend" and chip_family(chip.id) not in ("310P", "310B"):  # cards without RoCE ports
        count = next((a.count for a in info.accelerators if a.vendor == "huawei"), None) or chip.devices_per_node or 8
        loc.ports = hccn_ports(root, count)
        out += _hccn_local(loc.ports, root, info.in_container)
    if loc.nic and not loc.all_loopback:
        out += _ifname_env(chip.backend, loc, env, ifaces, direct_out=bool(loc.npu_ips))
    return loc


def _value(v) -> str:
    return "absent" if v in (None, "") else str(v)


def _compare(loc: Local, mine: dict, theirs: dict[int, dict]) -> list[Finding]:
    """One finding per fingerprint field that differs: every node named with its value."""
    me = loc.me
    everyone = {me.rank: mine, **{r: m.get("fingerprint") or {} for r, m in theirs.items()}}
    label = {n.rank: n.label + (" (this node)" if n.rank == me.rank else "") for n in loc.nodes}
    out, same = [], []
    for key in (*MUST_MATCH, *SHOULD_MATCH):
        values = {r: fp.get(key) for r, fp in everyone.items()}
        if key == "hccn_tls" and all(v is None for v in values.values()):
            continue
        if len({_value(v) for v in values.values()}) == 1:
            if values[me.rank] not in (None, ""):
                same.append(f"{LABELS.get(key, key)} {values[me.rank]}")
            continue
        groups: dict[str, list[int]] = {}
        for r in sorted(values):
            groups.setdefault(_value(values[r]), []).append(r)
        listing = "; ".join(f"{v} on {', '.join(label[r] for r in ranks)}" for v, ranks in groups.items())
        name = LABELS.get(key, key)
        out.append(Finding("fail" if key in MUST_MATCH else "warn", f"{name} differs across nodes: {listing}",
                           "every node must run the same stack: ranks exchange pickled objects and compiled kernels, "
                           "and mismatched collectives libraries hang or fail at the first all-reduce"
                           if key in MUST_MATCH else "nodes with different devices get different shards and limits",
                           f"install the same {name} on every node (one image, pinned by digest, or "
                           "`flagdeploy install --chip ...` on each)"))
    if len(everyone) > 1 and not any(f.level == "fail" for f in out):
        out.append(Finding("ok", f"same stack on {len(everyone)} nodes: {', '.join(same)}"))
    return out


def _ping_peers(root: Path, loc: Local, theirs: dict[int, dict]) -> list[Finding]:
    """Each peer's device i IP pinged from local NPU i (the same RoCE plane), in parallel."""
    mine = {p.device: p for p in loc.ports or [] if p.ip}
    jobs = []
    for rank, msg in sorted(theirs.items()):
        for dev, ip in sorted((msg.get("npu_ips") or {}).items(), key=lambda kv: int(kv[0])):
            if int(dev) in mine:
                jobs.append((rank, int(dev), ip))
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda j: hccn_ping(root, j[1], j[2]), jobs))
    label = {n.rank: n.label for n in loc.nodes}
    out, bad = [], {}
    for (rank, dev, ip), res in zip(jobs, results):
        if res is None or not res.ok:
            what = "no answer from hccn_tool" if res is None else f"{res.received}/{res.sent} received"
            bad.setdefault(rank, []).append(f"NPU {dev} -> {ip} ({what})")
    for rank, items in bad.items():
        out.append(Finding("fail", f"NPU ping to {label[rank]} fails: {'; '.join(items)}",
                           "HCCL's cross-node links between these NPUs cannot be built; the start hangs at link "
                           "establishment (vllm-ascend#9447)",
                           "check both NPUs' links, the switch VLAN and netmask (`hccn_tool -i N -ip -g`), and that "
                           "the TLS switch is the same on both nodes"))
    if not bad:
        out.append(Finding("ok", f"NPU ping: {len(jobs)} device IPs on {len(theirs)} peer(s) answer"))
    return out


def preflight(info: SystemInfo, chip_id: str, nodes: str | list[NodeAddr], *, node_rank: int | None = None,
              nic: str | None = None, port: int = DEFAULT_PORT, timeout: float = 60.0, root: Path = ROOT,
              env: dict | None = None, bind_host: str | None = None, versions: dict | None = None) -> list[Finding]:
    """The multi-node findings for this node: local checks, then the exchange with every peer.

    versions: fingerprint fields to override (tests: a node with another torch)."""
    root = Path(root)
    loc = local_checks(info, chip_id, nodes, node_rank=node_rank, nic=nic, port=port, root=root, env=env)
    out = list(loc.findings)
    if loc.me is None:
        return out
    mine = fingerprint(info, chip_id, versions)
    tls = {p.tls for p in loc.ports or [] if p.tls is not None}
    if tls:
        mine["hccn_tls"] = ",".join(sorted(tls))
    message = {"nodes": [str(n) for n in loc.nodes], "hostname": socket.gethostname(),
               "nic": loc.nic.name if loc.nic else None, "address": loc.address,
               "fingerprint": mine, "npu_ips": loc.npu_ips}
    ex = exchange(loc.me, loc.nodes, message, timeout, bind_host)
    me = loc.me
    if ex.listen_error:
        out.append(Finding("fail", f"cannot listen on port {me.port} ({ex.listen_error})",
                           "the peers cannot reach this node there; if another process holds the port (an engine "
                           "still running?) the engine's rendezvous fails the same way",
                           f"free port {me.port} (`ss -ltnp | grep {me.port}`) or list another port for {me.label}"))
    peers = [n for n in loc.nodes if n.rank != me.rank]
    theirs: dict[int, dict] = {}
    for p in peers:
        answer = ex.answers.get(p.rank)
        came = ex.inbound.get(p.rank)
        if answer is None:
            out.append(Finding("fail", f"{p.label} unreachable on port {p.port} within {timeout:g} s: "
                               f"{ex.errors.get(p.rank, 'no answer')}",
                               "the engine's rendezvous would wait for it until its own timeout (often 30 minutes) "
                               "and then fail",
                               f"start `flagdeploy doctor --nodes ...` on {p.host} too, at about the same time; check "
                               f"the address, that port {p.port} is open (`nc -zv {p.host} {p.port}`) and that containers "
                               "use --net=host"))
            if came:
                theirs[p.rank] = came
            continue
        theirs[p.rank] = answer
        if answer["rank"] != p.rank:
            out.append(Finding("fail", f"{p} answered as node {answer['rank']}, but it is entry {p.rank} in --nodes",
                               "two nodes would take the same rank, or none the missing one; the start hangs",
                               "give each node the same --nodes list and its own --node-rank"))
        if answer.get("nodes") != message["nodes"]:
            out.append(Finding("fail", f"{p.label} was given another --nodes list: {','.join(answer.get('nodes') or [])}",
                               "the nodes disagree on who is rank 0 and on the world size",
                               f"run every node with --nodes {','.join(message['nodes'])}"))
        if came is None and not ex.listen_error:
            out.append(Finding("fail", f"{p.label} answered, but never reached this node at {me}",
                               "traffic flows one way only: a firewall on this node (or a route on the peer) blocks "
                               f"port {me.port} inbound; the engine needs both ways",
                               f"open port {me.port} on this node; from {p.host} check `nc -zv {me.host} {me.port}`"))
        elif came is not None:
            out.append(Finding("ok", f"{p.label} reached both ways in {ex.seconds[p.rank]:.1f} s"))
    if theirs:
        out += _compare(loc, mine, theirs)
        ips: dict[str, list[str]] = {}
        for rank, fp in sorted([(me.rank, {"npu_ips": loc.npu_ips}), *theirs.items()], key=lambda kv: kv[0]):
            for dev, ip in (fp.get("npu_ips") or {}).items():
                ips.setdefault(ip, []).append(f"node {rank} NPU {dev}")
        dup = {ip: who for ip, who in ips.items() if len(who) > 1}
        if dup:
            out.append(Finding("fail", "the same NPU device IP on several NPUs: " + "; ".join(
                               f"{ip} on {', '.join(who)}" for ip, who in dup.items()),
                               "HCCL cannot tell the NPUs apart; links go to the wrong NPU or fail",
                               "give every NPU of the deployment its own address (/etc/hccn.conf)"))
        if loc.ports:
            out += _ping_peers(root, loc, theirs)
    return out
