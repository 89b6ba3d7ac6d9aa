"""Multi-NIC parallel transfer: K Gloo contexts, each bound to one network interface, and the plan that
splits a message into chunks carried by the stripes concurrently.

Interface choice, first that applies:
1. ``CpuForwardOptions.interfaces`` (or ``BIMETAL_CF_IFACES="eth0,eth1"``): stripe i binds to the i-th name;
2. the node's candidates (``bimetal.topology.interfaces``: ``allowed_interfaces`` from ``parallel.interfaces``,
   else ``BIMETAL_IFACES``, else every up interface less loopback, bridges, tunnels and container networks),
   narrowed at group creation to those sharing a subnet with the peers; a rank takes the one paired with its GPU
   by the PCI topology first (``bimetal.topology.pci``: same PCIe switch, root complex, NUMA node), then the
   next nearest, K in all; where sysfs shows no PCI topology, local rank i starts at the i-th and takes K
   consecutive ones (one NIC per GPU by default, all of them for a large stripe count).
The group's creator then proves every pair reaches the other on them (``bimetal.topology.reach``) before any
Gloo context connects. Every stripe is a full ``ProcessGroupGloo`` of the group, built on its own prefix of the
group store (``dist.new_group`` would ignore the device options, see DESIGN.md), bound to its interface; only a
node with no IPv4 interface at all leaves a stripe on Gloo's default device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from bimetal.env import read_flag, read_float, read_int, read_size
from bimetal.errors import UserError
from bimetal.topology import local_device
from bimetal.topology.interfaces import candidate_nics, pick, preference

ENV_STRIPES = "BIMETAL_CF_STRIPES"
ENV_IFACES = "BIMETAL_CF_IFACES"
ENV_CHUNK = "BIMETAL_CF_CHUNK_BYTES"
ENV_POOL = "BIMETAL_CF_POOL_BUFFERS"
ENV_STALL = "BIMETAL_CF_STALL_S"
ENV_CHECKSUM = "BIMETAL_CF_CHECKSUM"

DEFAULT_CHUNK_BYTES = 4 * 2**20


@dataclass
class CpuForwardOptions:
    """Options of a cpu-forward group (``pg_options`` of ``dist.new_group``; env vars fill what is unset)."""

    stripes: int = 0
    """Gloo contexts per group; 0: from ``BIMETAL_CF_STRIPES`` or the interface list, else 1."""
    interfaces: list[str] = field(default_factory=list)
    """Interface name per stripe (``BIMETAL_CF_IFACES``), used exactly; empty: chosen from the candidates."""
    allowed_interfaces: list[str] = field(default_factory=list)
    """The node's interfaces the group may choose from, names or patterns (``parallel.interfaces``); empty:
    ``BIMETAL_IFACES``, else the default candidates (``bimetal.topology.interfaces``)."""
    chunk_bytes: int = 0
    """Chunk size of pipelined transfers (``BIMETAL_CF_CHUNK_BYTES``); 0: 4 MiB."""
    pool_buffers: int = 0
    """Pinned staging buffers per dtype (``BIMETAL_CF_POOL_BUFFERS``); 0: 8."""
    local_rank: int | None = None
    """Used to pick this rank's NIC; None: ``$LOCAL_RANK`` (else ``$SLURM_LOCALID``)."""
    stall_timeout_s: float = 0.0
    """Seconds without progress after which one stripe of a point-to-point transfer counts as stalled: its
    chunks are re-sent on the other stripes and the stripe is left for good (``BIMETAL_CF_STALL_S``);
    0: min(10 s, group timeout / 3). Must exceed two chunks' time on the slowest link."""
    checksum: bool | None = None
    """CRC32 on point-to-point host messages, a mismatch fails the receive instead of training on corrupted data
    (``BIMETAL_CF_CHECKSUM=1``); None: from the variable."""

    def resolved(self) -> CpuForwardOptions:
        env = os.environ
        ifaces = list(self.interfaces) or [s for s in env.get(ENV_IFACES, "").split(",") if s.strip()]
        stripes = self.stripes or read_int(ENV_STRIPES, 0) or len(ifaces) or 1
        chunk = self.chunk_bytes or read_size(ENV_CHUNK, DEFAULT_CHUNK_BYTES)
        pool = self.pool_buffers or read_int(ENV_POOL, 8)
        stall = self.stall_timeout_s or read_float(ENV_STALL, 0.0)
        if not 1 <= stripes <= 62 or chunk < 1024 or pool < 2 or stall < 0:
            raise UserError(f"cpu-forward options out of range: stripes={stripes} (1..62), chunk_bytes={chunk} "
                            f"(>= 1024), pool_buffers={pool} (>= 2), stall_timeout_s={stall:g} (>= 0)")
        if ifaces and len(ifaces) < stripes:
            ifaces = [ifaces[i % len(ifaces)] for i in range(stripes)]
        local = self.local_rank if self.local_rank is not None else local_device.local_rank()
        checksum = self.checksum if self.checksum is not None else read_flag(ENV_CHECKSUM)  # 0 or 1, else refused
        return CpuForwardOptions(stripes, ifaces[:stripes], list(self.allowed_interfaces), chunk, pool, local, stall,
                                 checksum)

    def stall_seconds(self, timeout: timedelta) -> float:
        """The stripe-stall timeout of a group with op timeout ``timeout``."""
        return self.stall_timeout_s or min(10.0, timeout.total_seconds() / 3)


def choose_interfaces(opts: CpuForwardOptions) -> list[str | None]:
    """Interface per stripe from this node alone (no peers asked; the transports' creators use
    ``bimetal.topology.reach``, which also looks at the peers' subnets); ``None``: Gloo's default device."""
    if opts.interfaces:
        return list(opts.interfaces)
    candidates = candidate_nics(opts.allowed_interfaces)
    chosen = pick(candidates, opts.local_rank or 0, opts.stripes, preference(candidates, opts.local_rank or 0))
    return [n.name for n in chosen] if chosen else [None] * opts.stripes


def build_stripes(store: dist.Store, rank: int, size: int, timeout: timedelta,
                  interfaces: list[str | None]) -> list[dist.ProcessGroupGloo]:
    stripes = []
    for i, name in enumerate(interfaces):
        gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gopts._timeout = timeout
        if name is None:
            gopts._devices = [dist.ProcessGroupGloo.create_default_device()]
        else:
            try:
                gopts._devices = [dist.ProcessGroupGloo.create_device(interface=name)]
            except RuntimeError as exc:
                raise UserError(f"cpu-forward stripe {i} cannot bind to interface {name!r} ({exc}); "
                                f"check {ENV_IFACES} or the options' interfaces") from None
        stripes.append(dist.ProcessGroupGloo(dist.PrefixStore(f"stripe{i}", store), rank, size, gopts))
    return stripes


SINGLE_BYTES = 64 * 2**10
"""With K > 1 stripes, a message up to this size rides one stripe as one chunk (latency over bandwidth)."""


def chunk_plan(numel: int, element_size: int, chunk_bytes: int, stripes: int, first: int = 0,
               weights: list[int] | None = None) -> list[tuple[int, int, int]]:
    """``(start, stop, stripe)`` element ranges covering ``numel``, in posting order.

    One stripe: chunks of ``chunk_bytes`` in order. K stripes: a message up to ``SINGLE_BYTES`` is one chunk
    on the ``first``-th stripe (counting only stripes of non-zero weight); a larger one is split by bytes:
    stripe s takes one contiguous range of about ``weights[s] / sum(weights)`` of the message (equal shares
    without weights), cut into equal chunks of at most ``chunk_bytes``, and the chunks are ordered one per
    stripe in turn, so every stripe starts at once and, at the rates the weights describe, finishes at once.
    Sender and receiver compute the same plan from the same numbers, so chunks match without headers.
    """
    per_chunk = max(1, chunk_bytes // max(1, element_size))
    w = list(weights) if weights and any(weights) else [1] * stripes
    if len(w) != stripes or min(w) < 0:
        raise ValueError(f"stripe weights {weights} do not fit {stripes} stripes")
    live = [s for s in range(stripes) if w[s] > 0]
    if numel == 0 or (stripes > 1 and (numel * element_size <= SINGLE_BYTES or numel == 1)):
        return [(0, numel, live[first % len(live)])]
    if stripes == 1:
        return [(a, min(a + per_chunk, numel), 0) for a in range(0, numel, per_chunk)]
    total, acc, bounds = sum(w), 0, [0]
    for s in range(stripes):
        acc += w[s]
        bounds.append(numel * acc // total)
    lanes: list[list[tuple[int, int, int]]] = []
    for s in live:
        a, b = bounds[s], bounds[s + 1]
        n = -(-(b - a) // per_chunk)
        lanes.append([(a + (b - a) * i // n, a + (b - a) * (i + 1) // n, s) for i in range(n)])
    rot = first % len(lanes)
    lanes = lanes[rot:] + lanes[:rot]
    # merged by how far along its own range each chunk is: with a window of chunks in flight, every stripe
    # keeps about its share of the window busy until the end
    keyed = [((2 * i + 1) / (2 * len(lane)), k, lane[i]) for k, lane in enumerate(lanes) for i in range(len(lane))]
    return [chunk for _, _, chunk in sorted(keyed)]
