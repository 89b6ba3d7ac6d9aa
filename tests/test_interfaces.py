"""Which interfaces the cross-vendor transports use: the candidates of a node (named, or the default that leaves
out loopback, bridges and container networks), the subnet rule toward the peers, the start-up reachability
check over a real store and real sockets, and how the cluster view shows the choice."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from bimetal.errors import UserError
from bimetal.topology import reach
from bimetal.topology.interfaces import NicInfo, candidate_nics, interface_kind, pick, usable_toward
from bimetal.topology.records import ClusterView, RankRecord

pytestmark = pytest.mark.timeout(60)


def fake_sysfs(root: Path, name: str, index: int, *, kind_type: int = 1, device: bool = False,
               bridge: bool = False, brport: bool = False, tun: bool = False, mac: str = "02:00:00:00:00:01") -> None:
    """A directory like ``/sys/class/net/<name>`` (a test double of sysfs: only the entries bimetal reads)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "ifindex").write_text(f"{index}\n")
    (d / "type").write_text(f"{kind_type}\n")
    (d / "address").write_text(f"{mac}\n")
    for present, entry in ((device, "device"), (bridge, "bridge"), (brport, "brport")):
        if present:
            (d / entry).mkdir()
    if tun:
        (d / "tun_flags").write_text("0x1002\n")


def test_sysfs_tells_bridges_ports_tunnels_and_devices_apart(tmp_path: Path) -> None:
    for i, (name, attrs) in enumerate([("docker0", {"bridge": True}), ("vethab12", {"brport": True}),
                                       ("tunl0", {"kind_type": 768}), ("tun0", {"tun": True}),
                                       ("ens1f0", {"device": True}), ("vxlan7", {}), ("lo", {"kind_type": 772})]):
        fake_sysfs(tmp_path, name, i + 2, **attrs)
    kinds = {n: interface_kind(n, tmp_path, ifindex=i + 2, mac="02:00:00:00:00:01")
             for i, n in enumerate(["docker0", "vethab12", "tunl0", "tun0", "ens1f0", "vxlan7", "lo"])}
    assert kinds == {"docker0": "bridge", "vethab12": "bridge-port", "tunl0": "tunnel", "tun0": "tun",
                     "ens1f0": "physical", "vxlan7": "virtual", "lo": "loopback"}
    # sysfs of another network namespace (a process entered with nsenter sees the host's): not believed
    assert interface_kind("ens1f0", tmp_path, ifindex=9, mac="02:00:00:00:00:01") is None
    assert interface_kind("ens1f0", tmp_path, ifindex=6, mac="02:00:00:00:00:99") is None
    assert interface_kind("eth5", tmp_path, ifindex=2) is None


def test_the_default_leaves_out_loopback_bridges_and_container_networks(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BIMETAL_IFACES", raising=False)
    fake_sysfs(tmp_path, "br0", 1, bridge=True)  # a bridge with a name no list knows: found by its attributes
    found = [NicInfo("br0", "192.168.5.1", 24), NicInfo("cni0", "10.244.0.1", 24), NicInfo("docker0", "172.17.0.1", 16),
             NicInfo("eth0", "10.0.0.5", 16), NicInfo("ib0", "10.1.0.5", 16), NicInfo("lo", "127.0.0.1", 8)]
    monkeypatch.setattr("bimetal.topology.interfaces.socket.if_nametoindex", lambda name: 1)
    monkeypatch.setattr("bimetal.topology.interfaces._mac", lambda name: "02:00:00:00:00:01")
    assert [n.name for n in candidate_nics(found=found, sysfs=tmp_path)] == ["eth0", "ib0"]
    only_lo = [NicInfo("lo", "127.0.0.1", 8)]  # one machine, a simulation: loopback is all there is
    assert candidate_nics(found=only_lo, sysfs=tmp_path) == only_lo
    # named (config beats BIMETAL_IFACES): patterns, and nothing left out by the default's rules
    monkeypatch.setenv("BIMETAL_IFACES", "docker0")
    assert [n.name for n in candidate_nics(found=found, sysfs=tmp_path)] == ["docker0"]
    assert [n.name for n in candidate_nics(["ib*", "eth0"], found=found, sysfs=tmp_path)] == ["eth0", "ib0"]
    with pytest.raises(UserError) as caught:
        candidate_nics(["mlx5_*"], host="amd1", found=found, sysfs=tmp_path)
    assert str(caught.value) == ("parallel.interfaces names mlx5_* but host amd1 has no such interface that is up "
                                 "with an IPv4 address (it has br0, cni0, docker0, eth0, ib0, lo); name interfaces "
                                 "this node has.")


def test_an_interface_no_peer_shares_a_subnet_with_is_avoided() -> None:
    mine = [NicInfo("eth0", "10.77.0.1", 24), NicInfo("eth1", "10.77.1.1", 24), NicInfo("mgmt0", "10.99.0.1", 24)]
    peer = [NicInfo("eth0", "10.77.0.2", 24), NicInfo("eth1", "10.77.1.2", 24)]
    usable = usable_toward(mine, [peer])
    assert [n.name for n in usable] == ["eth0", "eth1"]
    assert [n.name for n in pick(usable, 3, 2)] == ["eth1", "eth0"]  # local rank 3 starts at its own NIC
    routed = [NicInfo("eth0", "172.16.8.9", 31)]  # per-rail /31s, L3 between racks: no shared subnet at all
    assert usable_toward(mine, [routed]) == mine  # nothing dropped; the start-up probe decides


def test_the_cluster_view_shows_each_ranks_gpu_and_chosen_interfaces() -> None:
    nv = (NicInfo("eth0", "10.77.0.1", 24), NicInfo("eth1", "10.77.1.1", 24), NicInfo("eth2", "10.78.0.1", 24))
    amd = (NicInfo("eth0", "10.77.0.2", 24), NicInfo("eth1", "10.77.1.2", 24))
    records = [RankRecord(rank=r, local_rank=r % 2, host=["nv", "amd"][r // 2], vendor=["nvidia", "amd"][r // 2],
                          device="H100", memory_bytes=0, nics=[nv, amd][r // 2], device_index=r % 2) for r in range(4)]
    view = ClusterView(records)
    assert [n.name for n in view.chosen_nics(1)] == ["eth1"] and [n.name for n in view.chosen_nics(0, 2)] == \
        ["eth0", "eth1"]
    rows = [line.split() for line in view.format_table().splitlines()[2:]]
    assert [(r[0], r[4], r[7]) for r in rows] == [("0", "cuda:0", "eth0"), ("1", "cuda:1", "eth1"),
                                                  ("2", "cuda:0", "eth0"), ("3", "cuda:1", "eth1")]
    # one list for both kinds of node: an entry that only the other node has is fine, one no node has is a typo
    from dataclasses import replace

    from bimetal.topology.records import TopologyError

    ClusterView(records[:2] + [replace(r, named=("eth2", "eth1")) for r in records[2:]])  # eth2: nv's only
    with pytest.raises(TopologyError) as caught:
        ClusterView(records[:3] + [replace(records[3], named=("eth0", "eht1"))])
    assert str(caught.value) == ("the interface list of rank 3 (host amd) names eht1, which matches no interface on "
                                 "any node of this job; fix the name in parallel.interfaces or BIMETAL_IFACES (each "
                                 "node uses the listed interfaces it has).")


# -- the start-up check, over a real TCPStore and real sockets ---------------------------------------------
def _store(port: int = 0, world: int = 2) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, port == 0, timeout=timedelta(seconds=20), wait_for_workers=False)


def test_members_that_reach_each_other_agree_and_pass() -> None:
    server = _store()
    got: dict[int, object] = {}

    def member(rank: int) -> None:
        store = _store(server.port)
        try:
            got[rank] = reach.choose_and_confirm(store, rank, 2, [10, 11], lambda: [NicInfo("lo", "127.0.0.1", 8)],
                                                 rank, 1, "t", "unit group", timedelta(seconds=20))
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            got[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == {0: [NicInfo("lo", "127.0.0.1", 8)], 1: [NicInfo("lo", "127.0.0.1", 8)]}


def test_a_peer_that_cannot_be_reached_is_one_sentence_naming_both_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is played by hand through the store: it publishes a listener nobody serves (its port is closed),
    as a peer behind an interface that does not reach us would look; rank 0's check fails within its deadline,
    says so, and stops with the sentence."""
    import socket

    monkeypatch.setenv("BIMETAL_HOST", "nv")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    store = _store(world=1)
    store.set("t/listen/1", json.dumps({"host": "amd", "listen": [["eth2", "127.0.0.1", port]]}))
    store.set("t/result/1", json.dumps(""))
    with pytest.raises(reach.UnreachableError) as caught:
        reach.confirm(store, 0, 2, [4, 7], [NicInfo("lo", "127.0.0.1", 8)], "t", "cpu-forward group of ranks [4, 7]",
                      timedelta(seconds=20), deadline=1.0)
    text = str(caught.value)
    assert text.startswith("cpu-forward group of ranks [4, 7]: rank 4 (host nv, interface lo 127.0.0.1) cannot reach "
                           "rank 7 (host amd) on its interface eth2 (127.0.0.1) within 1 s: Connection refused"), text
    assert json.loads(store.get("t/result/0")) == text and "\n" not in text  # rank 7 hears the same sentence


def test_a_member_missing_a_named_interface_stops_the_others_too(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(world=1)
    store.set("t/cand/1", json.dumps({"host": "amd", "error": "BIMETAL_IFACES names ib0 but host amd has none"}))
    with pytest.raises(reach.UnreachableError, match="^BIMETAL_IFACES names ib0 but host amd has none$"):
        reach.agree(store, 0, 2, lambda: [NicInfo("lo", "127.0.0.1", 8)], 0, 1, "t", timedelta(seconds=20))


def test_the_world_group_follows_gloo_socket_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    """bimetal creates the world with ``init_process_group``, whose Gloo binds to ``GLOO_SOCKET_IFNAME``: an
    interface that does not exist fails the world at once, naming it (one rank, in this process)."""
    import socket

    from bimetal.parallel.context import _init_world

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("GLOO_SOCKET_IFNAME", "nosuchnic9")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(RuntimeError, match="nosuchnic9"):
        _init_world("gloo", timedelta(seconds=10))
    assert not dist.is_initialized()


def test_the_config_key_takes_names_and_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    from bimetal.config import load_config
    from bimetal.topology.interfaces import named_interfaces

    cfg = load_config(None, ["--parallel.interfaces=ib*,ens1f0np0"])
    assert cfg.parallel.interfaces == ["ib*", "ens1f0np0"]
    monkeypatch.setenv("BIMETAL_IFACES", "eth0")  # file or command line beat the environment
    assert named_interfaces(cfg.parallel.interfaces) == (["ib*", "ens1f0np0"], "parallel.interfaces")
    assert named_interfaces([]) == (["eth0"], "BIMETAL_IFACES")
    with pytest.raises(UserError, match=r"parallel.interfaces=\['eth0/1'\] holds 'eth0/1', which is no interface"):
        load_config(None, ["--parallel.interfaces=eth0/1"])
