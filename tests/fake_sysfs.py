"""A test double of a node's sysfs PCI tree: directories and symbolic links laid out as the kernel lays them out,
so ``bimetal.topology.pci`` reads it as it reads ``/sys`` (``BIMETAL_SYSFS`` or the ``root`` argument).

* a PCI device is a directory under ``sys/devices/pci<domain>:<bus>/<root port>/.../<bdf>`` holding ``vendor``,
  ``class`` and ``numa_node``, and ``sys/bus/pci/devices/<bdf>`` links to it;
* a network interface is ``<device>/net/<name>`` with a ``device`` link back up to ``<device>``, and
  ``sys/class/net/<name>`` links to it; an RDMA device the same under ``infiniband``.

The shapes are those of the shipped clusters (``configs/clusters``: 8 GPUs and 8 NICs per node).
"""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA, AMD, MELLANOX, BROADCOM = "0x10de", "0x1002", "0x15b3", "0x14e4"
GPU_3D, ACCELERATOR, NIC, BRIDGE = "0x030200", "0x120000", "0x020000", "0x060400"


class Tree:
    """A fake sysfs under ``root``; every method returns the device's bdf."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
        for kind in ("net", "infiniband"):
            (root / "sys/class" / kind).mkdir(parents=True, exist_ok=True)
        self.paths: dict[str, Path] = {}

    def device(self, parent: str, bdf: str, vendor: str = BROADCOM, cls: str = BRIDGE, numa: int = 0) -> str:
        """A PCI device below ``parent`` (a bdf made earlier, or a root complex ``pci0000:00``)."""
        base = self.paths.get(parent, self.root / "sys/devices" / parent)
        d = base / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "numa_node").write_text(f"{numa}\n")
        os.symlink(os.path.relpath(d, self.root / "sys/bus/pci/devices"), self.root / "sys/bus/pci/devices" / bdf)
        self.paths[bdf] = d
        return bdf

    def switch(self, parent: str, up: str, ports: list[str], numa: int) -> list[str]:
        """A PCIe switch: its upstream port ``up`` below ``parent``, its downstream ports below that."""
        self.device(parent, up, numa=numa)
        return [self.device(up, p, numa=numa) for p in ports]

    def gpu(self, parent: str, bdf: str, numa: int, vendor: str = NVIDIA) -> str:
        return self.device(parent, bdf, vendor, GPU_3D if vendor == NVIDIA else ACCELERATOR, numa)

    def nic(self, parent: str, bdf: str, numa: int, name: str, rdma: str = "") -> str:
        """A NIC function with its interface ``name`` (and RDMA device ``rdma``) as the kernel links them."""
        self.device(parent, bdf, MELLANOX, NIC, numa)
        for kind, label in (("net", name), ("infiniband", rdma)):
            if label:
                d = self.paths[bdf] / kind / label
                d.mkdir(parents=True)
                os.symlink("../..", d / "device")
                os.symlink(os.path.relpath(d, self.root / "sys/class" / kind), self.root / "sys/class" / kind / label)
        return bdf

    def virtual(self, name: str) -> None:
        """An interface with no PCI device (a bond, a VLAN): ``sys/devices/virtual/net/<name>``, no device link."""
        d = self.root / "sys/devices/virtual/net" / name
        d.mkdir(parents=True)
        os.symlink(os.path.relpath(d, self.root / "sys/class/net"), self.root / "sys/class/net" / name)


def h100_node(root: Path, nics_per_switch: int = 2, names: list[str] | None = None) -> tuple[list[str], list[str]]:
    """A DGX H100-like node: four PCIe switches (two per NUMA node, each on its own root complex), each with two
    GPUs and ``nics_per_switch`` NICs on its downstream ports. Returns the GPUs' bdfs and the NICs' interface
    names (``names`` in PCI order; default ``ibp<bus>s0``), both in PCI order; RDMA devices ``mlx5_<i>``."""
    t = Tree(root)
    gpus, nics = [], []
    for s, bus in enumerate((0x15, 0x35, 0x95, 0xb5)):  # the switch's upstream bus; GPUs and NICs a few below
        numa = s // 2
        rc = f"pci0000:{bus - 5:02x}"
        rp = t.device(rc, f"0000:{bus - 5:02x}:01.0", numa=numa)
        ports = t.switch(rp, f"0000:{bus:02x}:00.0", [f"0000:{bus + 1:02x}:{p:02x}.0" for p in range(4)], numa)
        gpus.append(t.gpu(ports[0], f"0000:{bus + 2:02x}:00.0", numa))
        gpus.append(t.gpu(ports[2], f"0000:{bus + 4:02x}:00.0", numa))
        for k in range(nics_per_switch):
            i = len(nics)
            bus_nic = bus + 3 + 2 * k
            name = names[i] if names else f"ibp{bus_nic}s0"
            t.nic(ports[1 + 2 * k], f"0000:{bus_nic:02x}:00.0", numa, name, f"mlx5_{i}")
            nics.append(name)
    return gpus, nics


def mi300x_node(root: Path, names: list[str] | None = None) -> tuple[list[str], list[str]]:
    """An MI300X node: eight GPUs, each behind its own PCIe switch with its own NIC (two switches per root
    complex, four per NUMA node). Returns the GPUs' bdfs and the NICs' names, in PCI order (``names``; default
    ``ens<i>np0``); RDMA devices ``rdma<i>``."""
    t = Tree(root)
    gpus, nics = [], []
    for g in range(8):
        numa, bus = g // 4, 0x10 + 0x20 * g
        rc = f"pci0000:{0x10 + 0x40 * (g // 2):02x}"
        rp = t.device(rc, f"0000:{0x10 + 0x40 * (g // 2):02x}:0{1 + g % 2}.1", numa=numa)
        ports = t.switch(rp, f"0000:{bus + 1:02x}:00.0", [f"0000:{bus + 2:02x}:00.0", f"0000:{bus + 2:02x}:01.0"],
                         numa)
        gpus.append(t.gpu(ports[0], f"0000:{bus + 3:02x}:00.0", numa, AMD))
        name = names[g] if names else f"ens{g}np0"
        t.nic(ports[1], f"0000:{bus + 4:02x}:00.0", numa, name, f"rdma{g}")
        nics.append(name)
    return gpus, nics
