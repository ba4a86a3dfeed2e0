"""`flagdeploy doctor --nodes` (issue 31): the multi-node preflight. Doctors on loopback that find each other,
a version mismatch named on both nodes, a peer that never comes, interface and HCCL-variable checks on
recorded `ip -j addr` outputs, and hccn_tool parsing from hand-written fixtures (tests/fixtures/multinode)."""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from flagdeploy.installer import peers
from flagdeploy.installer.detect import detect
from flagdeploy.installer.doctor import Finding, format_findings
from flagdeploy.net import free_port

FIXTURES = Path(__file__).parent / "fixtures"
NODE0, NODE1 = FIXTURES / "multinode" / "a2-node0", FIXTURES / "multinode" / "a2-node1"
CPU = detect(FIXTURES / "systems" / "cpu")
A2 = detect(FIXTURES / "systems" / "a2")  # 8 x 910B3, CANN 8.0.RC3, driver 24.1.rc2


def _fails(findings: list[Finding]) -> list[str]:
    return [f.what for f in findings if f.level == "fail"]


def _text(findings: list[Finding]) -> str:
    return format_findings(findings)


def _loopback_nodes(n: int = 2) -> tuple[str, list[int]]:
    ports = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ",".join(f"127.0.0.1:{p}" for p in ports), ports


def _run_together(nodes: str, per_rank: dict[int, dict], **common) -> dict[int, list[Finding]]:
    """One doctor per rank, each in its own thread, started together (as on real nodes)."""
    results: dict[int, list[Finding] | BaseException] = {}

    def go(rank: int, options: dict) -> None:
        try:
            options = {"bind_host": "127.0.0.1", "env": {}, "nodes": nodes, **common, **options}
            results[rank] = peers.preflight(node_rank=rank, **options)
        except BaseException as exc:  # surfaced below, not lost in the thread
            results[rank] = exc

    threads = [threading.Thread(target=go, args=(r, o)) for r, o in per_rank.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in per_rank:
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return results  # type: ignore[return-value]


# ---- the node list -------------------------------------------------------------------------------------


def test_parse_nodes():
    nodes = peers.parse_nodes("10.0.0.11, node-b:29600,[fd00::2]:29700", default_port=29500)
    assert [(n.rank, n.host, n.port) for n in nodes] == [(0, "10.0.0.11", 29500), (1, "node-b", 29600),
                                                         (2, "fd00::2", 29700)]
    assert str(nodes[2]) == "[fd00::2]:29700" and nodes[1].label == "node 1 (node-b:29600)"
    for bad, msg in [("10.0.0.11", "names one node"), ("a:1,a:1", "twice"), ("a,,b", "empty entry"),
                     ("a:70000,b", "out of range"), ("a:b:c,d", "not HOST[:PORT]")]:
        with pytest.raises(peers.NodesError, match=re.escape(msg)):
            peers.parse_nodes(bad)


# ---- peers on loopback ---------------------------------------------------------------------------------


def test_two_doctors_on_loopback_find_each_other_and_agree():
    nodes, ports = _loopback_nodes()
    start = time.monotonic()
    res = _run_together(nodes, {0: {}, 1: {}}, info=CPU, chip_id="cpu", timeout=5)
    assert time.monotonic() - start < 5  # both answered: nobody waited for the timeout
    for rank, other in ((0, 1), (1, 0)):
        assert not _fails(res[rank]), _text(res[rank])
        text = _text(res[rank])
        assert f"node {other} (127.0.0.1:{ports[other]}) reached both ways" in text
        assert "same stack on 2 nodes" in text and "flagdeploy " in text and "chip cpu" in text
        assert "interface lo is up with 127.0.0.1" in text  # a one-host rehearsal may use the loopback


def test_version_mismatch_is_a_failure_naming_the_node_and_both_values():
    nodes, ports = _loopback_nodes()
    mine = peers.package_versions()
    res = _run_together(nodes, {0: {}, 1: {"versions": {"flagdeploy": "0.0.9", "torch": "2.9.0+cpu"}}},
                        info=CPU, chip_id="cpu", timeout=5)
    for rank in (0, 1):
        fails = _fails(res[rank])
        fd = next(f for f in fails if f.startswith("flagdeploy differs across nodes"))
        assert f"{mine['flagdeploy']} on node 0 (127.0.0.1:{ports[0]})" in fd
        assert f"0.0.9 on node 1 (127.0.0.1:{ports[1]})" in fd
        torch_fail = next(f for f in fails if f.startswith("torch differs across nodes"))
        assert "2.9.0+cpu on node 1" in torch_fail and f"{mine['torch']} on node 0" in torch_fail
        assert "(this node)" in fd  # each side marks itself
        assert not any(f.startswith("python") or "unreachable" in f for f in fails)


def test_peer_that_never_comes_is_unreachable_within_the_timeout():
    nodes, ports = _loopback_nodes()
    start = time.monotonic()
    found = peers.preflight(CPU, "cpu", nodes, node_rank=0, timeout=2, env={}, bind_host="127.0.0.1")
    took = time.monotonic() - start
    assert 1.9 < took < 5, took
    fails = _fails(found)
    assert len(fails) == 1, _text(found)
    assert fails[0].startswith(f"node 1 (127.0.0.1:{ports[1]}) unreachable on port {ports[1]} within 2 s")
    assert "connection refused" in fails[0]
    assert "nc -zv 127.0.0.1" in _text(found)


def test_a_port_held_by_another_program_is_named_on_both_sides():
    """Node 1's port is held by something that accepts and never answers (an engine still running)."""
    nodes, ports = _loopback_nodes()
    squatter = socket.create_server(("127.0.0.1", ports[1]))
    try:
        res = _run_together(nodes, {0: {}, 1: {}}, info=CPU, chip_id="cpu", timeout=3)
    finally:
        squatter.close()
    assert any("something other than a flagdeploy doctor holds that port" in f for f in _fails(res[0])), _text(res[0])
    assert any(f.startswith(f"cannot listen on port {ports[1]}") for f in _fails(res[1])), _text(res[1])
    assert "reached both ways" not in _text(res[1])


def test_nodes_given_different_lists_disagree_loudly():
    nodes, ports = _loopback_nodes(3)
    two = ",".join(nodes.split(",")[:2])
    res = _run_together(two, {0: {}, 1: {"nodes": nodes}}, info=CPU, chip_id="cpu", timeout=2)
    assert any(f.startswith(f"node 1 (127.0.0.1:{ports[1]}) was given another --nodes list") for f in _fails(res[0]))
    assert any(f.startswith(f"node 2 (127.0.0.1:{ports[2]}) unreachable") for f in _fails(res[1]))


def test_cli_doctor_nodes_on_this_host():
    from click.testing import CliRunner

    from flagdeploy.cli import main

    nodes, ports = _loopback_nodes()
    peer = threading.Thread(target=lambda: peers.preflight(CPU, "cpu", nodes, node_rank=1, timeout=8, env={},
                                                           bind_host="127.0.0.1"))
    peer.start()
    r = CliRunner().invoke(main, ["doctor", "--chip", "cpu", "--nodes", nodes, "--node-rank", "0", "--timeout", "8"])
    peer.join(timeout=10)
    assert f"node 1 (127.0.0.1:{ports[1]}) reached both ways" in r.output, r.output
    assert "same stack on 2 nodes" in r.output
    assert "[FAIL]" not in r.output and r.exit_code == 0, r.output


# ---- the interface, from recorded `ip -j addr` ---------------------------------------------------------


def test_parse_ip_addr_recorded():
    ifaces = {i.name: i for i in peers.interfaces(NODE0)}
    assert set(ifaces) == {"lo", "eth0", "enp189s0f0", "enp189s0f1", "ens5f0", "docker0"}
    assert ifaces["lo"].loopback and ifaces["lo"].up and "127.0.0.1" in ifaces["lo"].addresses
    assert ifaces["enp189s0f0"].up and ifaces["enp189s0f0"].addresses[0] == "10.0.0.11"
    assert not ifaces["enp189s0f1"].admin_up
    assert ifaces["ens5f0"].admin_up and not ifaces["ens5f0"].carrier
    assert peers.route_source(NODE1, "10.0.0.11") == "10.0.0.12"


def test_live_interfaces_and_sysfs_fallback():
    for found in (peers.interfaces(), peers._sysfs_interfaces(Path("/"))):
        lo = next(i for i in found if i.loopback)
        assert "127.0.0.1" in lo.addresses and lo.admin_up
    assert peers.route_source(Path("/"), "127.0.0.1") == "127.0.0.1"


def _local(root: Path = NODE0, nodes: str = "10.0.0.11,10.0.0.12", **kw) -> peers.Local:
    return peers.local_checks(CPU, "cpu", nodes, root=root, env=kw.pop("env", {}), **kw)


def test_interface_chosen_by_the_route_to_the_first_node():
    loc = _local()
    assert (loc.me.rank, loc.nic.name, loc.address) == (0, "enp189s0f0", "10.0.0.11")
    assert "interface enp189s0f0 is up with 10.0.0.11 (the first node's address)" in _text(loc.findings)
    loc = _local(NODE1)
    assert (loc.me.rank, loc.nic.name, loc.address) == (1, "enp189s0f0", "10.0.0.12")
    assert not _fails(loc.findings)


@pytest.mark.parametrize("nic,expect", [
    ("ib0", "interface ib0 does not exist on this host"),
    ("enp189s0f1", "interface enp189s0f1 is down (administratively)"),
    ("ens5f0", "interface ens5f0 has no link (operstate DOWN)"),
    ("eth0", "node 0 (10.0.0.11:29500) names 10.0.0.11, which is on enp189s0f0, not on the chosen interface eth0"),
])
def test_interface_missing_down_or_with_the_wrong_address(nic, expect):
    loc = _local(nic=nic)
    assert any(f.startswith(expect) for f in _fails(loc.findings)), _text(loc.findings)


def test_own_entry_problems():
    assert any(f.startswith("this host is not in --nodes") for f in _fails(_local(nodes="10.0.0.99,10.0.0.12").findings))
    assert any("--node-rank 5 is not a position" in f for f in _fails(_local(node_rank=5).findings))
    wrong = _local(node_rank=1)  # node 1's entry is 10.0.0.12, not an address of node 0
    assert any("10.0.0.12 is not an address of this host" in f for f in _fails(wrong.findings))
    lo = _local(nodes="localhost,10.0.0.12")  # a name that maps to the loopback
    assert any("node 0 (localhost:29500) resolves to the loopback" in f for f in _fails(lo.findings)), _text(lo.findings)


def test_gloo_interface_variables_on_cpu():
    loc = _local(NODE1, env={"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "enp189s0f0"})
    assert any(f.startswith("GLOO_SOCKET_IFNAME=eth0 does not select enp189s0f0") for f in _fails(loc.findings))
    loc = _local(NODE1)
    warn = next(f for f in loc.findings if f.what == "GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME not set")
    assert warn.level == "warn" and "export GLOO_SOCKET_IFNAME=enp189s0f0 TP_SOCKET_IFNAME=enp189s0f0" in warn.fix


# ---- Ascend: hccn_tool and the HCCL variables ----------------------------------------------------------


def test_hccn_tool_parsers_on_the_fixtures():
    cmd0, cmd1 = NODE0 / ".commands", NODE1 / ".commands"
    assert peers.parse_link((cmd0 / "hccn_tool-i0-link.txt").read_text()) == "UP"
    assert peers.parse_link((cmd0 / "hccn_tool-i3-link.txt").read_text()) == "DOWN"
    assert peers.parse_net_health((cmd0 / "hccn_tool-i0-net_health.txt").read_text()) == "Success"
    assert peers.parse_net_health((cmd0 / "hccn_tool-i3-net_health.txt").read_text()) == "Fault"
    assert peers.parse_ip((cmd1 / "hccn_tool-i7-ip.txt").read_text()) == ("10.20.0.27", "255.255.255.0")
    assert peers.parse_tls((cmd0 / "hccn_tool-i2-tls.txt").read_text()) == "0"
    good = peers.parse_ping((cmd0 / "hccn_tool-i0-ping-10.20.0.20.txt").read_text())
    bad = peers.parse_ping((cmd0 / "hccn_tool-i3-ping-10.20.0.23.txt").read_text())
    assert (good.sent, good.received, good.loss, good.ok) == (3, 3, 0.0, True)
    assert (bad.sent, bad.received, bad.loss, bad.ok) == (3, 0, 100.0, False)  # '0.00% packet loss' is in '100.00%'
    assert peers.parse_ping("recv time out seq=0\nrecv time out seq=1\n").ok is False
    assert peers.parse_link("") is None and peers.parse_ping(None) is None and peers.parse_ip("") == (None, None)

    ports = peers.hccn_ports(NODE0, 8)
    assert [p.device for p in ports] == list(range(8))
    assert [(p.link, p.health) for p in ports if p.device == 3] == [("DOWN", "Fault")]
    assert [p.ip for p in ports] == [f"10.20.0.{10 + i}" for i in range(8)]
    assert peers.hccn_ping(NODE1, 3, "10.20.0.13").ok is False
    assert peers.hccn_ports(FIXTURES / "systems" / "a2", 8) is None  # no hccn_tool recorded there


def test_hccn_local_findings():
    node0 = peers.local_checks(A2, "ascend910b", "10.0.0.11,10.0.0.12", root=NODE0, env={})
    fails = _fails(node0.findings)
    assert "NPU RoCE link not up on device 3 (DOWN)" in fails
    assert "NPU network health not Success on device 3 (Fault)" in fails
    node1 = peers.local_checks(A2, "ascend910b", "10.0.0.11,10.0.0.12", root=NODE1, env={})
    assert not _fails(node1.findings) and "8 NPU RoCE links up, healthy, with device IPs" in _text(node1.findings)
    bare = peers.local_checks(A2, "ascend910b", "10.0.0.11,10.0.0.12", root=FIXTURES / "systems" / "a2", env={})
    assert any(f.what.startswith("hccn_tool not found") and f.level == "warn" for f in bare.findings)


@pytest.mark.parametrize("env,level,what,fix", [
    ({}, "warn", "GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, HCCL_SOCKET_IFNAME not set",
     "not HCCL_IF_IP: with NPU direct-out RoCE"),
    ({"HCCL_IF_IP": "10.0.0.12"}, "warn", "HCCL_IF_IP is set while this node's NPUs have their own RoCE ports",
     "unset HCCL_IF_IP; export HCCL_SOCKET_IFNAME=enp189s0f0"),
    ({"HCCL_IF_IP": "10.9.9.9"}, "fail", "HCCL_IF_IP=10.9.9.9 is not an address of this host", "HCCL_IF_IP=10.0.0.12"),
    ({"HCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "enp189s0f0", "TP_SOCKET_IFNAME": "enp189s0f0"}, "fail",
     "HCCL_SOCKET_IFNAME=eth does not select enp189s0f0", "export HCCL_SOCKET_IFNAME=enp189s0f0"),
    ({"HCCL_SOCKET_IFNAME": "enp189", "GLOO_SOCKET_IFNAME": "enp189s0f0", "TP_SOCKET_IFNAME": "enp189s0f0"}, "ok",
     "interface variables select enp189s0f0", ""),  # HCCL takes a prefix, like NCCL
    ({"HCCL_SOCKET_IFNAME": "^eth,docker", "GLOO_SOCKET_IFNAME": "enp189s0f0", "TP_SOCKET_IFNAME": "enp189s0f0"},
     "ok", "interface variables select enp189s0f0", ""),
])
def test_hccl_if_ip_versus_socket_ifname(env, level, what, fix):
    loc = peers.local_checks(A2, "ascend910b", "10.0.0.11,10.0.0.12", root=NODE1, env=env)
    f = next((f for f in loc.findings if f.what.startswith(what)), None)
    assert f is not None, _text(loc.findings)
    assert f.level == level and fix in f.fix
    if level == "ok":
        assert not _fails(loc.findings)


def test_without_npu_device_ips_hccl_if_ip_is_offered(tmp_path):
    box = tmp_path / "node1"
    shutil.copytree(NODE1, box)
    for f in (box / ".commands").glob("hccn_tool-i*-ip.txt"):
        f.write_text("")
    loc = peers.local_checks(A2, "ascend910b", "10.0.0.11,10.0.0.12", root=box, env={})
    assert any(f.startswith("no device IP on NPU 0, 1, 2, 3, 4, 5, 6, 7") for f in _fails(loc.findings))
    warn = next(f for f in loc.findings if f.what.endswith("HCCL_SOCKET_IFNAME not set"))
    assert "or HCCL_IF_IP=10.0.0.12" in warn.fix


def test_ascend_nodes_exchange_device_ips_and_ping_each_other():
    """Both recorded A2 nodes on loopback: node 0's NPU 3 link is down, so each side's ping of the other's
    NPU 3 fails and is named; node 0 also runs the whole doctor (no generic HCCL warning with --nodes)."""
    from flagdeploy.installer import doctor as doc

    nodes, ports = _loopback_nodes()
    results = {}

    def node0():
        results[0] = doc.run(A2, "ascend910b", nodes=nodes, node_rank=0, nic="lo", timeout=5, root=NODE0, env={},
                             bind_host="127.0.0.1")

    t = threading.Thread(target=node0)
    t.start()
    results[1] = peers.preflight(A2, "ascend910b", nodes, node_rank=1, nic="lo", timeout=5, root=NODE1, env={},
                                 bind_host="127.0.0.1")
    t.join(timeout=30)
    t0, t1 = _text(results[0]), _text(results[1])
    assert f"NPU ping to node 1 (127.0.0.1:{ports[1]}) fails: NPU 3 -> 10.20.0.23 (0/3 received)" in _fails(results[0])
    assert f"NPU ping to node 0 (127.0.0.1:{ports[0]}) fails: NPU 3 -> 10.20.0.13 (0/3 received)" in _fails(results[1])
    assert "NPU 2 ->" not in t0 + t1
    assert "NPU TLS switch (hccn_tool -tls -g) 0" in t1 and "driver 24.1.rc2, CANN 8.0.RC3" in t1
    assert "HCCL_SOCKET_IFNAME / HCCL_IF_IP not set" not in t0  # the single-node warning gives way to --nodes


def test_tls_switch_and_duplicate_device_ips_across_nodes(tmp_path):
    box = tmp_path / "node1"
    shutil.copytree(NODE1, box)
    for i in range(8):
        (box / ".commands" / f"hccn_tool-i{i}-tls.txt").write_text(f"dev_id:{i}, tls switch[0]:1[enable]\n")
    (box / ".commands" / "hccn_tool-i5-ip.txt").write_text("ipaddr:10.20.0.15\nnetmask:255.255.255.0\n")  # node 0's
    nodes, ports = _loopback_nodes()
    res = _run_together(nodes, {0: {"root": NODE0}, 1: {"root": box}}, info=A2, chip_id="ascend910b", nic="lo",
                        timeout=5)
    for rank in (0, 1):
        fails = _fails(res[rank])
        tls = next(f for f in fails if f.startswith("NPU TLS switch (hccn_tool -tls -g) differs across nodes"))
        assert f"0 on node 0 (127.0.0.1:{ports[0]})" in tls and f"1 on node 1 (127.0.0.1:{ports[1]})" in tls
        assert "the same NPU device IP on several NPUs: 10.20.0.15 on node 0 NPU 5, node 1 NPU 5" in fails
