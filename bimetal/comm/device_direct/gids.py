"""Whether the RoCE GID an RDMA engine uses can route between nodes, read from sysfs.

On RoCE (RDMA over Ethernet) a queue pair addresses its peer by a GID from the port's GID table,
``/sys/class/infiniband/<dev>/ports/<port>/gids/<i>``, of a type given in ``gid_attrs/types/<i>``. A typical table:
index 0 and 1 are the link-local ``fe80::`` GIDs (RoCE v1, RoCE v2), 2 and 3 the interface's IPv4 address as
``::ffff:a.b.c.d`` (v1, v2). Only a RoCE v2 GID that carries a real address crosses an IP router; a link-local
GID, a zero one, or RoCE v1 (an Ethernet frame, not UDP/IP) stays within one layer-2 segment, so writes between
nodes time out. Mooncake takes the index from ``MC_GID_INDEX``, else ``NCCL_IB_GID_INDEX``, else picks one itself.

``problem`` turns that into one sentence naming the device, the port, the index, where the index came from and
the index to set instead; the start-up probe gives it as the reason when a write to a peer on another node fails
(and logs it when the writes arrive anyway, as they do on one layer-2 segment). InfiniBand ports are not judged:
they route by LID inside a subnet.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Gid:
    """One entry of a port's GID table."""

    index: int
    address: str
    kind: str  # "RoCE v2", "IB/RoCE v1", or "" when the kernel does not say

    @property
    def why_not(self) -> str | None:
        """Why it does not route between nodes, or None when it does."""
        try:
            addr = ipaddress.IPv6Address(self.address)
        except ValueError:
            return "unreadable"
        if int(addr) == 0:
            return "empty"
        if addr.is_link_local:
            return "link-local"
        if self.kind and "v2" not in self.kind:
            return "RoCE v1 (an Ethernet frame, not IP)"
        return None

    def describe(self) -> str:
        addr = ipaddress.IPv6Address(self.address) if self.why_not != "unreadable" else self.address
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        return f"{f'::ffff:{mapped}' if mapped else addr}, {self.kind or 'type unknown'}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def table(port: Path) -> list[Gid]:
    """The non-empty entries of a port's GID table (``.../ports/<p>``), in index order."""
    try:
        names = sorted(int(p.name) for p in (port / "gids").iterdir() if p.name.isdigit())
    except OSError:
        return []
    found = [Gid(i, _read(port / "gids" / str(i)), _read(port / "gid_attrs" / "types" / str(i))) for i in names]
    return [g for g in found if g.address and g.why_not != "empty"]


def _roce_ports(root: Path, device: str) -> list[Path]:
    try:
        ports = sorted((root / device / "ports").iterdir())
    except OSError:
        return []
    return [p for p in ports if _read(p / "link_layer") == "Ethernet" and
            ("ACTIVE" in _read(p / "state") or not _read(p / "state"))]


def problem(root: Path, devices: Iterable[str], index: int | None, source: str, fix_var: str) -> str | None:
    """Why the GID the engine will use on ``devices`` (RoCE ports) cannot route between nodes, in one clause naming
    ``fix_var`` (the variable to set), or None. ``index``: the GID index in effect (None: the engine picks one);
    ``source``: where it came from, in words."""
    for device in devices:
        for port in _roce_ports(root, device):
            gids = table(port)
            routable = [g for g in gids if g.why_not is None]
            where = f"RDMA device {device} port {port.name}"
            if index is None:
                if not routable:
                    return (f"{where} has no RoCE v2 GID with an IP address (its GIDs: "
                            f"{'; '.join(f'{g.index}: {g.describe()}' for g in gids) or 'none'}), so RDMA cannot "
                            "cross nodes; give its network interface an IP address, or set BIMETAL_DD_PROTOCOL=tcp")
                continue
            chosen = next((g for g in gids if g.index == index), None)
            why = "no such entry" if chosen is None else chosen.why_not
            if why is None:
                continue
            what = f"GID index {index} ({source})" + (f": {chosen.describe()}" if chosen is not None else "")
            fix = (f"set {fix_var}={routable[0].index} (RoCE v2 {routable[0].describe().split(',')[0]})" if routable
                   else "give its network interface an IP address (RoCE v2 needs one), or set BIMETAL_DD_PROTOCOL=tcp")
            return f"{where} uses {what}, which is {why} and does not route between nodes; {fix}"
    return None
