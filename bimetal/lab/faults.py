"""Link and speed faults injected into a running lab, for the reliability work.

Every fault is a plain function on a ``LabCluster`` that takes effect at once, while a job runs:
take a NIC down or up, change a NIC's rate or latency (netem, else ``bimetal.lab.delay``), add packet
loss (netem where the kernel has it, else an iptables ``statistic`` rule on the receiving nodes, so a lost
packet is really lost and TCP retransmits it), slow a rank by changing its CPU quota, or kill a whole node
(``kill_node``: every process in its namespace, as a node that loses power).
``injected(...)`` applies a fault for the length of a ``with`` block and then undoes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from bimetal.lab import cgroup, net

if TYPE_CHECKING:
    from bimetal.lab.cluster import LabCluster


def _ends(lab: LabCluster, node: str, nic: int) -> list[tuple[str, str]]:
    """Both ends of a node's NIC: (namespace, device) in the node and on the hub."""
    i = lab.node_index(node)
    if not 0 <= nic < lab.spec.nodes[i].nics:
        raise net.LabError(f"node {node!r} of lab {lab.spec.lab_id} has no NIC {nic}; it has {lab.spec.nodes[i].nics}")
    return [(lab.namespace(node), net.nic_name(nic)), (lab.hub, net.hub_port(i, nic))]


def nic_down(lab: LabCluster, node: str, nic: int) -> None:
    """Cut a NIC (both ends down, as a pulled cable): connections over it stall until it comes back."""
    for ns, dev in _ends(lab, node, nic):
        net.sh(["ip", "-n", ns, "link", "set", dev, "down"])


def nic_up(lab: LabCluster, node: str, nic: int) -> None:
    """Reconnect a NIC cut with ``nic_down``; its address and shaping come back with it."""
    i = lab.node_index(node)
    ns, dev = _ends(lab, node, nic)[0]
    net.sh(["ip", "-n", lab.hub, "link", "set", net.hub_port(i, nic), "up"])
    net.sh(["ip", "-n", ns, "link", "set", dev, "up"])
    # Taking a link down flushes nothing in tbf, but the kernel drops the subnet route: put it back if gone.
    routes = net.sh(["ip", "-n", ns, "route", "show", "dev", dev])
    if f"{net.SUBNET}.{nic}.0/24" not in routes:
        net.sh(["ip", "-n", ns, "route", "add", f"{net.SUBNET}.{nic}.0/24", "dev", dev], check=False)


def set_link(lab: LabCluster, node: str, nic: int, rate_mbit: float | None = None,
             latency_ms: float | None = None) -> None:
    """Change a NIC's rate and/or one-way latency in both directions (netem, else bimetal.lab.delay)."""
    spec = lab.spec.nodes[lab.node_index(node)]
    rate = spec.rate_mbit if rate_mbit is None else rate_mbit
    latency = spec.latency_ms if latency_ms is None else latency_ms
    if rate <= 0:
        raise net.LabError(f"rate_mbit must be positive, not {rate}; use nic_down to cut a link")
    for (ns, dev), hub in zip(_ends(lab, node, nic), (False, True)):
        net.shape(ns, dev, rate, latency / 2, change=True, hub=hub)


def add_loss(lab: LabCluster, node: str, nic: int, percent: float) -> None:
    """Drop ``percent`` % of packets leaving the node on this NIC (netem loss below the rate limit where the
    kernel has netem; else iptables rules on every other node drop that share of what arrives from it)."""
    if not 0 < percent <= 100:
        raise net.LabError(f"loss percent must be in (0, 100], not {percent:g}")
    spec = lab.spec.nodes[lab.node_index(node)]
    ns, dev = _ends(lab, node, nic)[0]
    if not net.netem_available():
        for other_ns, match, tag in _loss_targets(lab, node, nic):
            net.sh(["iptables", "-I", "INPUT", *match, "-m", "statistic", "--mode", "random", "--probability",
                    f"{percent / 100:.6f}", "-j", "DROP", "-m", "comment", "--comment", tag], ns=other_ns)
        return
    net.sh(["tc", "qdisc", "del", "dev", dev, "root"], ns=ns, check=False)
    net.sh(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "loss", f"{percent:g}%",
            "delay", f"{spec.latency_ms / 2:g}ms"], ns=ns)
    net.sh(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf",
            *net.tbf_args(spec.rate_mbit)], ns=ns)


def clear_loss(lab: LabCluster, node: str, nic: int) -> None:
    """Undo ``add_loss``: its iptables rules go (restoring the link's shaping is what undoes netem loss)."""
    if shutil.which("iptables") is None:
        return
    for other_ns, _, tag in _loss_targets(lab, node, nic):
        listed = net.sh(["iptables", "-S", "INPUT"], ns=other_ns, check=False)
        for line in listed.splitlines():
            if line.startswith("-A INPUT ") and f"--comment {tag}" in line:
                net.sh(["iptables", "-D", *line.split()[1:]], ns=other_ns, check=False)


def _loss_targets(lab: LabCluster, node: str, nic: int) -> list[tuple[str, list[str], str]]:
    """Where loss on ``node``'s NIC ``nic`` is applied: (namespace, match, comment) per other node on that rail."""
    _ends(lab, node, nic)  # validates the node and the NIC
    if shutil.which("iptables") is None:
        raise net.LabError("this kernel has no netem qdisc and iptables is not installed, so links cannot drop "
                           "packets; install iptables (apt-get install iptables) or use nic_down as the fault")
    match = ["-i", net.nic_name(nic), "-s", lab.address(node, nic)]
    return [(lab.namespace(o.name), match, f"bimetal-loss-{node}-{nic}") for o in lab.spec.nodes
            if o.name != node and nic < o.nics]


def restore_link(lab: LabCluster, node: str, nic: int) -> None:
    """Back to the spec's rate and latency, no loss, and up."""
    clear_loss(lab, node, nic)
    nic_up(lab, node, nic)
    set_link(lab, node, nic)


def slow_rank(lab: LabCluster, node: str, local_rank: int, cpu_share: float | None) -> None:
    """Cap (or with None uncap) one rank's CPU share at once: its cgroup's quota changes under it."""
    n = lab.spec.nodes[lab.node_index(node)]
    if not 0 <= local_rank < n.ranks:
        raise net.LabError(f"node {node!r} has no local rank {local_rank}; it has {n.ranks}")
    cgroup.require_cpu_controller()
    cgroup.set_share(cgroup.rank_cgroup(lab.spec.lab_id, node, local_rank), cpu_share)


def restore_rank(lab: LabCluster, node: str, local_rank: int) -> None:
    n = lab.spec.nodes[lab.node_index(node)]
    slow_rank(lab, node, local_rank, n.cpu_share[local_rank])


@contextmanager
def injected(apply: Callable[[], None], undo: Callable[[], None]) -> Iterator[None]:
    """``with injected(lambda: nic_down(lab, "n0", 1), lambda: nic_up(lab, "n0", 1)): ...``"""
    apply()
    try:
        yield
    finally:
        undo()


def kill_node(lab: LabCluster, node: str) -> list[int]:
    """The node dies: SIGKILL every process in its network namespace (its torchrun agent and its ranks: torchrun
    starts each rank in a session of its own, so the agent's process group is not all of them). Returns the pids."""
    out = subprocess.run(["ip", "netns", "pids", lab.namespace(node)], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
