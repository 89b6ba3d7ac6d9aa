"""Host-path physics of a transfer between two GPUs that is not device-direct RDMA.

Transports as the planner sees them:

* ``gloo``: stock Gloo over TCP. A GPU tensor is copied to host memory, sent over one TCP connection per
  rank pair, copied to the peer GPU, one step after the other (synchronous, no chunk overlap).
* ``cpu-forward``: bimetal's path. The same three stages, cut into chunks (4 MiB) that pipeline, so the
  slowest stage dominates plus one chunk of the others; striped over one Gloo context per NIC used.
* ``device-direct``: RDMA between GPU memories; the NIC line rate, no host copies, no TCP stack.

Terms, each a field of the cluster spec's ``[[group]]`` (``bimetal.plan.spec``): ``tcp_conn_gbps`` (what
one TCP connection reaches), ``tcp_iface_gbps`` (what the kernel's TCP stack moves through one interface,
shared by the K connections on it; never above line rate), ``host_copy_gbps`` (host memory bandwidth the
concurrent staging copies of a node share; each copy also stops at the pinned PCIe rate ``h2d_gbps``),
``msg_latency_us`` (per-message cost), and the NIC count and line rate. How many NICs a pipeline pair uses
is the layout's ``nics`` choice: ``shared`` (all pairs of a node on one NIC), ``per-gpu`` (pair i on NIC i,
pairs share when there are fewer NICs than pairs) or ``striped`` (every pair over every NIC).
"""

from __future__ import annotations

import math

from bimetal.plan.spec import NodeGroup
from bimetal.transports import NAMES

NIC_MODES = ("shared", "per-gpu", "striped")
CHUNK_BYTES = 4 * 2**20
"""cpu-forward's pipelining chunk (``bimetal.comm.striping.DEFAULT_CHUNK_BYTES``)."""


def nic_usage(mode: str, nics: int, pairs: int) -> tuple[int, int]:
    """(NICs one pair's traffic uses, pairs whose traffic each of those NICs carries) for ``pairs`` at once."""
    if mode == "shared":
        return 1, pairs
    if mode == "per-gpu":
        return 1, math.ceil(pairs / nics)
    if mode == "striped":
        return nics, pairs
    raise ValueError(f"unknown NIC mode {mode!r}; use one of {', '.join(NIC_MODES)}")


def wire_gbps(g: NodeGroup, transport: str, mode: str, pairs: int) -> float:
    """GB/s one pair gets on node group ``g``'s side when ``pairs`` pairs of the node send at once.

    TCP transports: per NIC used, min(one connection's ceiling, the interface's TCP ceiling / pairs on it).
    device-direct: the line rate shared by the pairs on each NIC.
    """
    used, load = nic_usage(mode, g.nics_per_node, max(1, pairs))
    line = g.nic_gbps / 8
    if transport == "device-direct":
        return used * line / load
    return used * min(g.tcp_conn_gbps, min(line, g.tcp_iface_gbps) / load)


def copy_gbps(g: NodeGroup, concurrent: int) -> float:
    """GB/s of one staging copy (D2H or H2D) while ``concurrent`` copies of the node share host memory."""
    return min(g.h2d_gbps, g.host_copy_gbps / max(1, concurrent))


def pair_transfer_seconds(nbytes: float, transport: str, src: NodeGroup, dst: NodeGroup, mode: str,
                          pairs: int) -> float:
    """One transfer of ``nbytes`` from a GPU of ``src`` to a GPU of ``dst`` while ``pairs`` pairs transfer.

    gloo: copy out + latency + wire + copy in. cpu-forward: the same parts pipelined over chunks. The wire
    rate is the lower of both ends; each end's copies share its host memory among the ``pairs`` copies.
    """
    wire = min(wire_gbps(src, transport, mode, pairs), wire_gbps(dst, transport, mode, pairs))
    latency = max(src.msg_latency_us, dst.msg_latency_us) * 1e-6
    net = nbytes / (wire * 1e9)
    if transport == "device-direct":
        return latency + net
    if transport not in NAMES:
        raise ValueError(f"unknown transport {transport!r}")
    parts = [nbytes / (copy_gbps(src, pairs) * 1e9), net, nbytes / (copy_gbps(dst, pairs) * 1e9)]
    if transport == "gloo":
        return latency + sum(parts)
    chunks = max(1, math.ceil(nbytes / CHUNK_BYTES))
    return latency + max(parts) + (sum(parts) - max(parts)) / chunks


def gloo_ring_busbw(g: NodeGroup, ranks: int, concurrent: int, spans_nodes: bool) -> float:
    """Bus bandwidth (GB/s) of a Gloo ring all-reduce of GPU tensors on ``ranks`` ranks of group ``g``.

    Every rank sends on one TCP connection; ``concurrent`` rings of the node run at once, so a ring that
    leaves the node shares the node's NICs' TCP ceilings; inside a node (loopback) only the connection
    ceiling binds. The staging copies to and from host memory are added by ``gloo_allreduce_seconds``.
    """
    rate = g.tcp_conn_gbps
    if spans_nodes:
        per_nic = math.ceil(max(1, concurrent) / g.nics_per_node)
        rate = min(rate, min(g.nic_gbps / 8, g.tcp_iface_gbps) / per_nic)
    return rate


def gloo_allreduce_seconds(nbytes: float, g: NodeGroup, ranks: int, concurrent: int, spans_nodes: bool) -> float:
    """Stock Gloo all-reduce of a GPU tensor: copy to host, ring all-reduce over TCP, copy back."""
    if ranks <= 1:
        return 0.0
    copy = 2 * nbytes / (copy_gbps(g, concurrent) * 1e9)
    ring = nbytes * 2 * (ranks - 1) / ranks / (gloo_ring_busbw(g, ranks, concurrent, spans_nodes) * 1e9)
    return copy + ring + 2 * (ranks - 1) * g.msg_latency_us * 1e-6
