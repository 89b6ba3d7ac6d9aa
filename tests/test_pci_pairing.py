"""GPU-NIC pairing from the PCI topology (``bimetal.topology.pci``), on fake sysfs trees of the shipped cluster
shapes (``tests/fake_sysfs.py``: 8 GPUs and 8 NICs per node, laid out as a DGX H100 and an MI300X platform), a
node whose NIC names sort in another order than their PCI addresses, and a node with fewer NICs than GPUs; then
through ``bimetal topo --simulate`` on such a tree, with an explicit setting winning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_sysfs import Tree, h100_node, mi300x_node

from bimetal.topology import pci
from bimetal.topology.interfaces import NicInfo, candidate_nics, pick

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def first_choices(root: Path, gpus: list[str], names: list[str], kind: str = "net") -> list[tuple[str, str]]:
    """Each local rank's NIC (rank i drives GPU i) and why."""
    return [pci.ranked(names, i, gpu, root, kind)[0] for i, gpu in enumerate(gpus)]


def test_h100_layout_pairs_each_gpu_with_a_nic_of_its_own_switch(tmp_path: Path) -> None:
    gpus, nics = h100_node(tmp_path)
    got = first_choices(tmp_path, gpus, nics)
    # GPUs 2s and 2s+1 sit on switch s with NICs 2s and 2s+1: each takes one of them, never the same one
    assert [name for name, _ in got] == nics, got
    assert {why for _, why in got} == {pci.SAME_SWITCH}
    # the RDMA devices of the same functions pair the same way
    rdma = [pci.rank_rdma(i, gpu, tmp_path) for i, gpu in enumerate(gpus)]
    assert rdma == [(f"mlx5_{i}", pci.SAME_SWITCH) for i in range(8)]
    # after its own NIC, a rank prefers its switch's other NIC, then its NUMA node's, then the other socket's
    order = pci.ranked(nics, 0, gpus[0], tmp_path)
    assert [why for _, why in order] == [pci.SAME_SWITCH] * 2 + [pci.SAME_NUMA] * 2 + ["other NUMA node"] * 4, order
    assert [name for name, _ in order][:4] == nics[:4]


def test_mi300x_layout_pairs_each_gpu_with_the_nic_behind_its_switch(tmp_path: Path) -> None:
    gpus, nics = mi300x_node(tmp_path)
    assert first_choices(tmp_path, gpus, nics) == [(n, pci.SAME_SWITCH) for n in nics]
    order = pci.ranked(nics, 0, gpus[0], tmp_path)
    # GPU 0: its own switch's NIC, then GPU 1's (same root complex), then NUMA node 0's, then the other node's
    assert [why for _, why in order] == [pci.SAME_SWITCH, pci.SAME_ROOT, pci.SAME_NUMA, pci.SAME_NUMA] + \
        ["other NUMA node"] * 4, order


def test_nic_names_that_sort_against_pci_order_are_paired_by_pci_not_by_name(tmp_path: Path) -> None:
    # the NICs in PCI order are called ens7np0, ens3np0, ...: the name-sorted list (what the candidates are) puts
    # another NIC at every position, so pairing by position would send every rank's traffic across switches
    shuffled = ["ens7np0", "ens3np0", "ens5np0", "ens0np0", "ens6np0", "ens1np0", "ens4np0", "ens2np0"]
    gpus, in_pci_order = mi300x_node(tmp_path, names=shuffled)
    by_name = sorted(in_pci_order)
    got = first_choices(tmp_path, gpus, by_name)
    assert got == [(n, pci.SAME_SWITCH) for n in in_pci_order], got
    position = [pick([NicInfo(n, "10.0.0.1", 24) for n in by_name], i)[0].name for i in range(8)]
    assert sum(p != g for p, (g, _) in zip(position, got)) == 8  # position pairing: wrong for every rank


def test_fewer_nics_than_gpus_two_gpus_per_nic_by_proximity(tmp_path: Path) -> None:
    gpus, nics = h100_node(tmp_path, nics_per_switch=1)
    assert len(gpus) == 8 and len(nics) == 4
    got = first_choices(tmp_path, gpus, nics)
    assert [name for name, _ in got] == [nics[g // 2] for g in range(8)], got  # the two GPUs of a switch share
    assert {why for _, why in got} == {pci.SAME_SWITCH}


def test_assign_spreads_ties_and_caps_each_nic() -> None:
    # four GPUs and two NICs on one switch: two GPUs per NIC, alternating, not the first NIC for all
    sw = ("0000:00:01.0", "0000:01:00.0")
    gpus = [pci.Place((*sw, f"0000:02:0{i}.0", f"0000:0{3 + i}:00.0"), "pci0000:00", 0) for i in range(4)]
    nics = [pci.Place((*sw, f"0000:02:1{i}.0", f"0000:1{i}:00.0"), "pci0000:00", 0) for i in range(2)]
    assert pci.assign(gpus, nics) == [0, 1, 0, 1]
    # a NIC with no PCI device (a bond) is taken only where the near ones are full
    assert pci.assign(gpus[:2], [None, nics[0], nics[1]]) == [1, 2]
    assert pci.assign(gpus, []) == [-1] * 4


def test_no_pci_topology_falls_back_to_position(tmp_path: Path) -> None:
    names = ["eth0", "eth1", "eth2"]
    assert pci.ranked(names, 1, None, tmp_path) == [(n, pci.BY_POSITION) for n in ("eth1", "eth2", "eth0")]
    gpus, nics = mi300x_node(tmp_path / "node")
    Tree(tmp_path / "node").virtual("bond0")
    # a GPU whose NICs have no PCI device (only a bond): by position; the bond among real NICs comes last
    assert pci.ranked(["bond0"], 3, gpus[3], tmp_path / "node") == [("bond0", pci.BY_POSITION)]
    order = pci.ranked(["bond0", *nics], 0, gpus[0], tmp_path / "node")
    assert order[0] == (nics[0], pci.SAME_SWITCH) and order[-1] == ("bond0", "no PCI device")
    assert pci.rank_rdma(0, None, tmp_path) is None  # no RDMA device: the engine opens every one, as before
    # pick follows the order it is given, position where it is given none
    usable = [NicInfo(n, "10.0.0.1", 24) for n in ("eth0", "eth1", "eth2")]
    assert [n.name for n in pick(usable, 0, 2, ["eth2", "eth0", "eth1"])] == ["eth2", "eth0"]
    assert [n.name for n in pick(usable, 2, 2)] == ["eth2", "eth0"]


def test_topo_simulate_shows_each_ranks_gpu_and_nic_with_the_reason(tmp_path: Path) -> None:
    """``bimetal topo --simulate nvidia:8`` on a fake H100 node whose NICs are up: simulated local rank i stands
    for the node's GPU i, so the table shows the pairing a real launch there uses; BIMETAL_CF_IFACES wins."""
    mine = [n.name for n in candidate_nics()][:1]  # this machine's interface, made GPU 0's NIC in the fake tree
    gpus, nics = h100_node(tmp_path / "sys-root", names=mine + [f"ibx{i}" for i in range(8 - len(mine))])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BIMETAL_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                    "MASTER_"))}
    env["BIMETAL_SYSFS"] = str(tmp_path / "sys-root")
    cmd = [sys.executable, "-m", "bimetal.cli", "topo", "--simulate", "nvidia:2", "--dp", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    # GPUs 0 and 1 share a switch with the one interface up here: both take it, and say so
    assert all(f"{mine[0]}  same PCIe switch" in rows[r] for r in "01"), rows
    assert "cuda:" not in rows["0"] and f"({gpus[0]})" in rows["0"] and "same PCIe switch" in rows["0"], rows
    assert "mlx5_0 (same PCIe switch)" in rows["0"] and "mlx5_1 (same PCIe switch)" in rows["1"], rows
    env["BIMETAL_CF_IFACES"] = mine[0]
    env["BIMETAL_DD_DEVICES"] = "mlx5_7"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert all("explicit BIMETAL_CF_IFACES" in r and "mlx5_7 (explicit BIMETAL_DD_DEVICES)" in r
               for r in rows.values()), rows
