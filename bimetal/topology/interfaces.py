"""Which network interfaces the cross-vendor transports may use, and which one each rank takes.

Candidates of a node (``candidate_nics``), first that applies:

1. the interfaces the user names: ``parallel.interfaces`` in the config (or ``--parallel.interfaces``), else
   ``BIMETAL_IFACES``. Each entry is a name or a shell pattern (``ib*``); the node takes every interface that
   matches one, so one list can serve nodes whose NICs are named differently (a CUDA node's ``ib0``, a ROCm
   node's ``ens1f0np0``). A list that matches nothing on a node is one sentence naming the node and what it has;
2. otherwise every IPv4 interface that is up, less: loopback (unless it is all there is: one machine, a
   simulation), bridges, bridge ports and bond members, tunnels (not Ethernet or InfiniBand), tun/tap, and the
   container and overlay families (docker, CNI, flannel, calico, veth pairs, libvirt, ...). Kinds are read from
   ``/sys/class/net/<if>`` where that directory describes this network namespace (same ifindex and MAC; a
   process in a namespace entered without remounting /sys sees the host's), by name otherwise.

Per group (``usable_toward``): of the candidates, the ones whose subnet holds an address of every peer on
another node; when none does (a routed fabric: per-rail /31s, L3 between racks), all candidates, and the
start-up probe (``reach``) is the judge. A rank takes ``pick(usable, local_rank, k, prefer)``: the k it prefers,
its GPU's NIC first by the PCI topology (``bimetal.topology.pci``: same PCIe switch, then root complex, then
NUMA node), or k consecutive ones starting at its local rank where sysfs shows no PCI topology.
``GLOO_SOCKET_IFNAME`` is torch's: it binds the world group (and any stock Gloo group), not bimetal's transports.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bimetal import env
from bimetal.errors import UserError
from bimetal.topology import pci

ENV_IFACES = "BIMETAL_IFACES"
SYSFS = Path("/sys/class/net")
CONTAINER_PREFIXES = ("docker", "br-", "virbr", "veth", "cni", "flannel", "cali", "vxlan", "weave", "kube-",
                      "cilium", "lxc", "lxd", "podman", "vnet", "tun", "tap", "genev", "tunl", "nodelocaldns",
                      "dummy", "antrea", "ovs-", "vmnet", "zt", "tailscale", "wg")
"""Names of container, overlay and VPN interfaces (the fallback when sysfs cannot say)."""
_ETHER, _INFINIBAND, _LOOPBACK = 1, 32, 772  # ARPHRD_* in /sys/class/net/<if>/type


@dataclass(frozen=True)
class NicInfo:
    """One network interface a rank may use: its kernel name, IPv4/IPv6 address and subnet prefix length."""

    name: str
    address: str
    prefix: int = 32
    """Prefix length of the address's subnet (``24`` for a /24); 32 (128 for IPv6): the address alone."""

    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_interface(f"{self.address}/{self.prefix}").network

    def shares_subnet(self, other: NicInfo) -> bool:
        """True when ``other``'s address lies in this interface's subnet (one hop on the same segment)."""
        return ipaddress.ip_address(other.address) in self.network()


def _prefix(netmask: str | None, address: str) -> int:
    full = 128 if ":" in address else 32
    if not netmask:
        return full
    try:
        return ipaddress.ip_network(f"0.0.0.0/{netmask}" if full == 32 else f"::/{netmask}").prefixlen
    except ValueError:
        return full


def up_interfaces() -> list[NicInfo]:
    """Every IPv4 interface of this host (or network namespace) that is up, loopback included, in name order."""
    import psutil

    stats = psutil.net_if_stats()
    found: list[NicInfo] = []
    for name, addrs in sorted(psutil.net_if_addrs().items(), key=lambda kv: natural_key(kv[0])):
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family == socket.AF_INET:
                found.append(NicInfo(name, addr.address, _prefix(addr.netmask, addr.address)))
                break
    return found


def natural_key(name: str) -> list[object]:
    """``eth2`` before ``eth10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def is_loopback(nic: NicInfo) -> bool:
    return ipaddress.ip_address(nic.address).is_loopback


def local_nics(include_loopback: bool | None = None) -> list[NicInfo]:
    """Up IPv4 interfaces in name order; loopback only when it is all there is, or when asked for."""
    found = up_interfaces()
    others = [n for n in found if not is_loopback(n)]
    if include_loopback is None:
        return others or [n for n in found if is_loopback(n)]
    return found if include_loopback else others


def _mac(name: str) -> str | None:
    import psutil

    for addr in psutil.net_if_addrs().get(name, []):
        if addr.family == getattr(psutil, "AF_LINK", -1):
            return str(addr.address).lower()
    return None


def interface_kind(name: str, sysfs: Path = SYSFS, ifindex: int | None = None, mac: str | None = None) -> str | None:
    """What ``/sys/class/net/<name>`` says the interface is: ``loopback``, ``bridge``, ``bridge-port`` (also a
    bond member), ``tunnel``, ``tun``, ``physical`` (a device behind it), ``bond`` or ``virtual`` (veth, vxlan,
    vlan, macvlan...); None when sysfs has no such interface or describes another namespace's (its ifindex
    or MAC differ from ours: ``ifindex``/``mac`` default to this namespace's)."""
    d = sysfs / name
    try:
        index = int((d / "ifindex").read_text())
        kind_type = int((d / "type").read_text())
        their_mac = (d / "address").read_text().strip().lower()
    except (OSError, ValueError):
        return None
    try:
        ours = ifindex if ifindex is not None else socket.if_nametoindex(name)
    except OSError:
        return None
    mine = mac if mac is not None else _mac(name)
    if index != ours or (mine is not None and their_mac != mine):
        return None
    if kind_type == _LOOPBACK:
        return "loopback"
    if (d / "bridge").is_dir():
        return "bridge"
    if (d / "brport").exists() or (d / "master").exists():
        return "bridge-port"
    if kind_type not in (_ETHER, _INFINIBAND):
        return "tunnel"
    if (d / "tun_flags").exists():
        return "tun"
    if (d / "device").exists():
        return "physical"
    if (d / "bonding").is_dir():
        return "bond"
    return "virtual"


EXCLUDED_KINDS = ("loopback", "bridge", "bridge-port", "tunnel", "tun")


def why_excluded(nic: NicInfo, sysfs: Path = SYSFS) -> str | None:
    """Why the default leaves ``nic`` out (a short phrase), or None when it is a candidate."""
    if is_loopback(nic):
        return "loopback"
    kind = interface_kind(nic.name, sysfs)
    if kind in EXCLUDED_KINDS:
        return kind
    if nic.name.startswith(CONTAINER_PREFIXES):
        return "container or virtual network"
    return None


def named_interfaces(configured: Sequence[str] | None = None) -> tuple[list[str], str]:
    """The names the user gave and where: the config's list, else ``BIMETAL_IFACES``; ``([], "")`` when none."""
    if configured:
        return [str(n).strip() for n in configured], "parallel.interfaces"
    raw = env.read(ENV_IFACES)
    if raw:
        return [s.strip() for s in raw.split(",") if s.strip()], ENV_IFACES
    return [], ""


def candidate_nics(configured: Sequence[str] | None = None, host: str = "", sysfs: Path = SYSFS,
                   found: list[NicInfo] | None = None) -> list[NicInfo]:
    """This node's candidate interfaces (module docstring, steps 1 and 2), in name order."""
    found = up_interfaces() if found is None else found
    names, source = named_interfaces(configured)
    if names:
        chosen = [n for n in found if any(fnmatch.fnmatchcase(n.name, pattern) for pattern in names)]
        if not chosen:
            have = ", ".join(n.name for n in found) or "none"
            where = f"host {host}" if host else "this host"
            raise UserError(f"{source} names {','.join(names)} but {where} has no such interface that is up with an "
                            f"IPv4 address (it has {have}); name interfaces this node has.")
        return chosen
    kept = [n for n in found if why_excluded(n, sysfs) is None]
    if kept:
        return kept
    return [n for n in found if is_loopback(n)]


def unmatched(names: Sequence[str], have: Sequence[str]) -> list[str]:
    """The entries of ``names`` (names or patterns) that match none of ``have`` (every node's interfaces)."""
    return [p for p in names if not any(fnmatch.fnmatchcase(n, p) for n in have)]


def usable_toward(mine: Sequence[NicInfo], peers: Sequence[Sequence[NicInfo]]) -> list[NicInfo]:
    """Of ``mine``, those whose subnet holds an address of every peer (each peer: its candidates); all of
    ``mine`` when no peer is given or none qualifies (a routed fabric: the probe decides)."""
    if not peers:
        return list(mine)
    shared = [n for n in mine if all(any(n.shares_subnet(p) for p in theirs) for theirs in peers)]
    return shared or list(mine)


def pick(usable: Sequence[NicInfo], local_rank: int, count: int = 1, prefer: Sequence[str] = ()) -> list[NicInfo]:
    """``count`` interfaces for local rank ``local_rank``: in the rank's order of preference ``prefer`` (names:
    its GPU's NIC first, ``pci.ranked``) where it has one, else consecutive ones from its own (one NIC per GPU)."""
    if not usable:
        return []
    start = local_rank % len(usable)
    order = [usable[(start + i) % len(usable)] for i in range(len(usable))]
    if prefer:
        at = {name: i for i, name in enumerate(prefer)}
        order.sort(key=lambda n: at.get(n.name, len(at)))
    return [order[i % len(order)] for i in range(count)]


def preference(nics: Sequence[NicInfo], local_rank: int) -> list[str]:
    """This rank's order of preference over ``nics`` (its candidates): nearest its GPU in the PCI topology first
    (``bimetal.topology.pci``), by position where sysfs cannot say."""
    return preferred_names(pci.rank_order([n.name for n in nics], local_rank))


def preferred_names(order: Sequence[tuple[str, str]]) -> list[str]:
    """The names of a ranked ``order`` (``pci.ranked``) as ``pick``'s preference; none where the order is only
    by position: that rotation was taken over all the rank's candidates, and ``pick`` rotates over the ones
    usable toward the peers instead (local rank i starts at the i-th of those, as before PCI pairing)."""
    if all(why == pci.BY_POSITION for _, why in order):
        return []
    return [name for name, _ in order]


def named_nics(names: Sequence[str], source: str = "BIMETAL_CF_IFACES", host: str = "") -> list[NicInfo]:
    """The up interfaces called ``names``, in that order (one per stripe); one sentence for a name this node
    lacks."""
    found = up_interfaces()
    out = []
    for name in names:
        nic = by_name(name, found)
        if nic is None:
            have = ", ".join(n.name for n in found) or "none"
            where = f"host {host}" if host else "this host"
            raise UserError(f"{source} names interface {name!r}, which {where} does not have up with an IPv4 address "
                            f"(it has {have}); name interfaces this node has.")
        out.append(nic)
    return out


def by_name(name: str, found: list[NicInfo] | None = None) -> NicInfo | None:
    """The up interface called ``name`` (or owning address ``name``), None when there is none."""
    for nic in up_interfaces() if found is None else found:
        if name in (nic.name, nic.address):
            return nic
    return None

