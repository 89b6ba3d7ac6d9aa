"""Which NIC each GPU of a node is paired with, read from the PCI topology in sysfs (as NCCL and RCCL pair them).

On an 8-GPU node each GPU usually shares a PCIe switch with one NIC (DGX H100: four switches, each with two GPUs
and two NICs; MI300X platforms: a switch per GPU with its NIC), and traffic between a GPU and a NIC under
another switch crosses the CPU's root complexes, or the link between sockets. Names say nothing of this:
``ens1f0np0`` may sit next to GPU 5. So each device's **place** is read from sysfs:

* its chain of PCI bridges from the root port down to itself: the path its sysfs directory resolves to
  (``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0``), reached through
  ``/sys/bus/pci/devices/<bdf>`` (a GPU), ``/sys/class/net/<if>/device`` (an interface) or
  ``/sys/class/infiniband/<dev>/device`` (an RDMA device);
* its root complex (``pci0000:00``) and NUMA node (``numa_node``; -1 where the kernel does not say).

GPUs: every PCI device of vendor 0x10de (NVIDIA) or 0x1002 (AMD) whose class is a display, 3D or processing
accelerator (0x0300, 0x0302, 0x0380, 0x1200); a rank's own GPU by the PCI address its runtime reports
(``torch.cuda.get_device_properties(i).pci_domain_id/pci_bus_id/pci_device_id``, on CUDA and ROCm builds alike).

Pairing (``assign``), all GPUs of the node at once so that every rank of it computes the same answer: the pairs
sharing the deepest PCI bridge first (same PCIe switch), then the same root complex, then the same NUMA node,
then the rest; at most ceil(GPUs / NICs) GPUs per NIC (8 GPUs on 4 NICs: two each, by proximity), and where
several NICs are as near, the one with fewer GPUs so far, then the first. A rank whose GPU or whose NICs have no
place (a CPU rank, a simulation, a virtual machine or sandbox without PCI in sysfs, a bond) takes them by
position, as before: NIC ``local rank`` of the list. An explicit setting is never overridden (the callers:
``BIMETAL_CF_IFACES``, ``BIMETAL_DD_HOST``, ``BIMETAL_DD_DEVICES``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bimetal import env

ROOT = Path("/")
"""Where sysfs is mounted, above ``sys`` (tests pass a folder holding a fake tree)."""
GPU_VENDORS = ("0x10de", "0x1002")
GPU_CLASSES = ("0x0300", "0x0302", "0x0380", "0x1200")
BY_POSITION = "by position: no PCI topology"
NO_DEVICE = "no PCI device"
SAME_SWITCH, SAME_ROOT, SAME_NUMA = "same PCIe switch", "same root complex", "same NUMA node"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class Place:
    """Where a PCI device sits: its bridges from the root port down, its own address last; its root complex
    (``pci0000:00``) and NUMA node (-1: unknown)."""

    chain: tuple[str, ...]
    root: str
    numa: int = -1

    @property
    def bdf(self) -> str:
        return self.chain[-1]


def place_of(device: Path) -> Place | None:
    """The place of the PCI device whose sysfs directory, or a link to it, is ``device``; None when it is no
    PCI device (a virtual interface) or sysfs does not show it."""
    try:
        real = device.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    parts = real.parts
    roots = [i for i, p in enumerate(parts) if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", p)]
    if not roots:
        return None
    chain = tuple(p for p in parts[roots[0] + 1:] if _BDF.match(p))
    if not chain:
        return None
    try:
        numa = int((real / "numa_node").read_text().strip())
    except (OSError, ValueError):
        numa = -1
    return Place(chain, parts[roots[0]], numa)


def closeness(a: Place, b: Place | None) -> tuple[int, int, int]:
    """How near two devices are, larger nearer: (bridges they share, same root complex, same known NUMA node)."""
    if b is None:
        return (-1, 0, 0)
    shared = 0
    for x, y in zip(a.chain, b.chain):
        if x != y:
            break
        shared += 1
    return (shared if a.root == b.root else 0, int(a.root == b.root), int(a.numa >= 0 and a.numa == b.numa))


def reason(a: Place, b: Place | None) -> str:
    """Why ``b`` is as near ``a`` as it is, in a few words (what ``bimetal topo`` shows)."""
    if b is None:
        return NO_DEVICE
    shared, same_root, same_numa = closeness(a, b)
    if shared:
        return SAME_SWITCH
    if same_root:
        return SAME_ROOT
    if same_numa:
        return SAME_NUMA
    return "other NUMA node" if a.numa >= 0 and b.numa >= 0 else "no shared PCIe switch or root complex"


def assign(gpus: Sequence[Place], nics: Sequence[Place | None]) -> list[int]:
    """For each GPU, the index of its NIC (module docstring: nearest first, at most ceil(GPUs / NICs) per NIC,
    ties to the NIC with fewer GPUs, then the first). Nearest-first is optimal here: places form a tree
    (NUMA node > root complex > bridges), so pairs under a deeper bridge never compete with shallower ones."""
    if not nics:
        return [-1] * len(gpus)
    cap = -(-len(gpus) // len(nics))
    score = [[closeness(g, n) for n in nics] for g in gpus]
    owner, load = [-1] * len(gpus), [0] * len(nics)
    for level in sorted({s for row in score for s in row}, reverse=True):
        for g, row in enumerate(score):
            if owner[g] >= 0:
                continue
            options = [n for n, s in enumerate(row) if s == level and load[n] < cap]
            if options:
                owner[g] = min(options, key=lambda n: (load[n], n))
                load[owner[g]] += 1
    return owner


def node_gpus(root: Path = ROOT) -> list[Place]:
    """The GPUs of this node (module docstring), in PCI address order; [] where sysfs shows no PCI bus."""
    found = []
    try:
        entries = sorted((root / "sys/bus/pci/devices").iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text().strip().lower()
            kind = (entry / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor in GPU_VENDORS and kind[:6] in GPU_CLASSES:
            place = place_of(entry)
            if place is not None:
                found.append(place)
    return sorted(found, key=lambda p: p.bdf)


def nic_place(name: str, root: Path = ROOT, kind: str = "net") -> Place | None:
    """The place of network interface ``name`` (``kind`` ``net``) or RDMA device ``name`` (``infiniband``)."""
    return place_of(root / "sys/class" / kind / name / "device")


def ranked(names: Sequence[str], local_rank: int, gpu: str | None, root: Path = ROOT,
           kind: str = "net") -> list[tuple[str, str]]:
    """``names`` (this node's candidate interfaces, or RDMA devices with ``kind="infiniband"``) in the order the
    rank whose GPU is at PCI address ``gpu`` prefers them, each with why: its paired NIC first (``assign`` over
    every GPU of the node), then the others nearest first; by position (from NIC ``local_rank``, wrapping) where
    there is no PCI topology to go by."""
    if not names:
        return []
    start = local_rank % len(names)
    rotation = [*range(start, len(names)), *range(start)]
    if not gpu:
        return [(names[i], BY_POSITION) for i in rotation]
    places = [nic_place(n, root, kind) for n in names]
    gpus = node_gpus(root)
    mine = next((g for g in gpus if g.bdf == gpu), None)
    if mine is None:
        mine = place_of(root / "sys/bus/pci/devices" / gpu)
        gpus = sorted([*gpus, mine], key=lambda p: p.bdf) if mine is not None else gpus
    if mine is None or all(p is None for p in places):
        return [(names[i], BY_POSITION) for i in rotation]
    first = assign(gpus, places)[gpus.index(mine)]
    rest = sorted((i for i in rotation if i != first), key=lambda i: closeness(mine, places[i]), reverse=True)
    return [(names[i], reason(mine, places[i])) for i in [first, *rest]]


def sysfs_root() -> Path:
    """Where sysfs is read: ``BIMETAL_SYSFS`` (a fake tree in tests), else ``/``."""
    return Path(env.read("BIMETAL_SYSFS") or ROOT)


def rank_gpu() -> str | None:
    """The PCI address (``0000:18:00.0``) of this rank's GPU as its runtime reports it; in a simulation, the
    node's GPU number ``local rank`` in PCI order (so ``bimetal topo --simulate`` on a node shows the pairing a
    real launch there would use); None on the CPU or where the runtime does not say."""
    import torch

    from bimetal.errors import UserError
    from bimetal.topology import local_device
    from bimetal.topology.vendor import is_simulated

    try:
        if is_simulated():
            gpus, mine = node_gpus(sysfs_root()), local_device.local_rank()
            return gpus[mine].bdf if mine < len(gpus) else None
        device = local_device.rank_device()
    except UserError:
        return None
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    # torch's CUDA and ROCm builds both carry these (torch/numa/binding.py reads them the same way)
    domain, bus, slot = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    if not all(isinstance(v, int) for v in (domain, bus, slot)):
        return None
    return f"{domain:04x}:{bus:02x}:{slot:02x}.0"


def rank_order(names: Sequence[str], local_rank: int, kind: str = "net") -> list[tuple[str, str]]:
    """``ranked`` for this process: its GPU (``rank_gpu``) in this machine's sysfs."""
    return ranked(names, local_rank, rank_gpu(), sysfs_root(), kind)


def rdma_devices(root: Path = ROOT) -> list[str]:
    """The RDMA devices of this node (``/sys/class/infiniband``), in name order."""
    try:
        return sorted(p.name for p in (root / "sys/class/infiniband").iterdir())
    except OSError:
        return []


def rank_rdma(local_rank: int, gpu: str | None = None, root: Path | None = None) -> tuple[str, str] | None:
    """The RDMA device paired with this rank's GPU and why, None where the PCI topology does not say (no RDMA
    device, no GPU, no PCI in sysfs: the engine then opens every device, as it did). What device-direct
    restricts its engine to unless ``BIMETAL_DD_DEVICES`` names devices."""
    root = sysfs_root() if root is None else root
    order = ranked(rdma_devices(root), local_rank, gpu if gpu is not None else rank_gpu(), root, "infiniband")
    return order[0] if order and order[0][1] not in (BY_POSITION, NO_DEVICE) else None


def paired_rdma(local_rank: int) -> tuple[str, ...]:
    """The RDMA devices device-direct's engine is restricted to on this rank when none are named: the one paired
    with its GPU (``rank_rdma``), else () (every device the engine finds)."""
    chosen = rank_rdma(local_rank)
    return (chosen[0],) if chosen else ()
