"""What each rank knows about itself, and the validated cluster view all ranks share.

A ``RankRecord`` travels as JSON (never pickle) and is checked field by field on arrival: a record that
fails names its rank and the offending field, so every rank stops with the same sentence. A record of another
``RECORD_VERSION`` (another bimetal) is refused before its fields are read, and records whose software
disagrees (``versions``) stop the job naming two ranks and their versions.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import Field

from bimetal.errors import UserError
from bimetal.schema import SHAPE, Problem, check
from bimetal.topology import versions
from bimetal.topology.interfaces import NicInfo, local_nics, pick, preferred_names, unmatched, usable_toward
from bimetal.topology.vendor import VENDORS
from bimetal.version import __version__

RECORD_VERSION = 3
"""1: before device index, subnet prefixes and versions were carried; 2: before the GPU-NIC pairing."""
_MAX_NICS = 64
_MAX_STR = 256
__all__ = ["RECORD_VERSION", "ClusterView", "NicInfo", "RankRecord", "TopologyError", "format_rows", "local_nics"]


class TopologyError(UserError, ValueError):
    """A rank record or cluster view that fails validation."""


def _local(key: str) -> Any:
    return lambda: versions.local_versions()[key]


@dataclass(frozen=True)
class RankRecord:
    """One rank's self-description, published to every other rank at start-up."""

    rank: int
    local_rank: int
    host: str
    vendor: str
    device: str
    """Device name as the runtime reports it (``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    memory_bytes: int
    """Device memory; 0 when unknown (CPU simulation)."""
    nics: tuple[NicInfo, ...] = field(default_factory=tuple)
    """The node's candidate interfaces for the cross-vendor transports (``interfaces.candidate_nics``)."""
    device_index: int = -1
    """Index of the rank's GPU among those its process sees (``local_device``); -1: the CPU."""
    torch: str = field(default_factory=_local("torch"))
    """``torch.__version__`` (``2.6.0+cu124``)."""
    bimetal: str = field(default_factory=_local("bimetal"))
    engine: str = field(default_factory=_local("engine"))
    """The Mooncake transfer engine's version; empty when none is installed."""
    wire: dict[str, int] = field(default_factory=versions.wire_versions)
    """Protocol version of each of bimetal's transports."""
    named: tuple[str, ...] = ()
    """The interface names or patterns this rank was given (``parallel.interfaces``, else ``BIMETAL_IFACES``)."""
    gpu_pci: str = ""
    """PCI address of the rank's GPU (``0000:18:00.0``); empty: none, or the runtime does not say."""
    nic_order: tuple[tuple[str, str], ...] = ()
    """The rank's candidate interfaces (``nics``) in its order of preference, each with why: its GPU's NIC first
    by the PCI topology (``bimetal.topology.pci``), or by position; empty: ``nics`` by position."""
    rdma: tuple[str, ...] = ()
    """The RDMA device device-direct's engine opens for this rank and why (``(name, reason)``); empty: every
    device the engine finds (no PCI topology to pair by, or no RDMA device)."""

    def software(self) -> dict[str, object]:
        """The versions ``versions.mismatch`` compares."""
        return {"torch": self.torch, "bimetal": self.bimetal, "engine": self.engine, "wire": self.wire}

    def to_json(self) -> str:
        payload = asdict(self)
        payload["version"] = RECORD_VERSION
        return json.dumps(payload, sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes, expected_rank: int | None = None) -> RankRecord:
        where = f"rank {expected_rank}" if expected_rank is not None else "a rank"
        try:
            payload = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TopologyError(f"topology record of {where} is not valid JSON ({exc})") from exc
        return RankRecord.from_dict(payload, expected_rank)

    @staticmethod
    def from_dict(payload: Any, expected_rank: int | None = None) -> RankRecord:
        where = f"rank {expected_rank}" if expected_rank is not None else "a rank"
        if not isinstance(payload, dict):
            raise TopologyError(f"topology record of {where} is a {type(payload).__name__}, not an object")
        got = payload.get("version")
        if got != RECORD_VERSION:  # before the fields: another bimetal's record has other fields
            known = isinstance(got, int) and not isinstance(got, bool)
            age = ("an older" if got < RECORD_VERSION else "a newer") if known else "another"  # type: ignore[operator]
            label = f"a version-{got}" if known else "an unversioned"
            raise TopologyError(f"{where} published {label} topology record but this bimetal "
                                f"({__version__}) reads version {RECORD_VERSION}: {where} runs {age} "
                                "bimetal; install one bimetal release on every node.")

        def fail(key: str, why: str) -> TopologyError:
            return TopologyError(f"topology record of {where}: field {key!r} {why}")

        def explain(p: Problem) -> str:
            key = p.key
            if p.kind == "unknown" and "[" in key:  # a NIC entry with other keys than name and address
                key = key.rsplit(".", 1)[0]
                return str(fail(key, "must be an object with exactly 'name', 'address' and 'prefix'"))
            why = {"unknown": "is not a known field", "missing": "is missing"}.get(p.kind)
            if why is None and key.startswith("nics["):
                why = "must be an object with exactly 'name', 'address' and 'prefix'"
                key = key.split(".", 1)[0]
            if why is None:
                why = {"int": "must be a non-negative integer", "str":
                       f"must be a non-empty string of at most {_MAX_STR} characters",
                       "list": f"must be a list of at most {_MAX_NICS} interfaces"}.get(p.want, p.detail)
                if key != "nics":
                    why += f", got {p.value!r}"
            return str(fail(key, why))

        try:
            wire = check(RecordWire, payload, f"topology record of {where}", explain)
        except UserError as exc:
            raise TopologyError(str(exc)) from None
        if expected_rank is not None and wire.rank != expected_rank:
            raise fail("rank", f"says {wire.rank}, but the record was published by rank {expected_rank}")
        if wire.vendor not in VENDORS:
            raise fail("vendor", f"is {wire.vendor!r}, expected one of {', '.join(VENDORS)}")
        for i, nic in enumerate(wire.nics):
            if not 0 < len(nic.name) <= 15 or not nic.name.isprintable() or "/" in nic.name:
                raise fail(f"nics[{i}].name", f"is not an interface name: {nic.name!r}")
            try:
                full = 32 if ipaddress.ip_address(nic.address).version == 4 else 128
            except ValueError:
                raise fail(f"nics[{i}].address", f"is not an IP address: {nic.address!r}") from None
            if not 0 <= nic.prefix <= full:
                raise fail(f"nics[{i}].prefix", f"is {nic.prefix}, not a prefix length of 0 to {full}")
        if len(wire.rdma) not in (0, 2):
            raise fail("rdma", f"must be empty or [device, reason], got {wire.rdma!r}")
        return RankRecord(rank=wire.rank, local_rank=wire.local_rank, host=wire.host, vendor=wire.vendor,
                          device=wire.device, memory_bytes=wire.memory_bytes,
                          nics=tuple(NicInfo(n.name, n.address, n.prefix) for n in wire.nics),
                          device_index=wire.device_index, torch=wire.torch, bimetal=wire.bimetal,
                          engine=wire.engine, wire=dict(wire.wire), named=tuple(wire.named), gpu_pci=wire.gpu_pci,
                          nic_order=tuple((n, why) for n, why in wire.nic_order), rdma=tuple(wire.rdma))


Count = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1, max_length=_MAX_STR)]


@dataclass(frozen=True)
class NicWire:
    """One interface of a record as it travels."""

    __pydantic_config__ = SHAPE

    name: str
    address: str
    prefix: int


@dataclass(frozen=True)
class RecordWire:
    """A ``RankRecord`` as it travels (JSON): every field required, no other field allowed."""

    __pydantic_config__ = SHAPE

    version: int
    rank: Count
    local_rank: Count
    host: Text
    vendor: Text
    device: Text
    memory_bytes: Count
    nics: Annotated[list[NicWire], Field(max_length=_MAX_NICS)]
    device_index: Annotated[int, Field(ge=-1)]
    torch: Text
    bimetal: Text
    engine: Annotated[str, Field(max_length=_MAX_STR)]
    wire: Annotated[dict[str, Count], Field(max_length=16)]
    named: Annotated[list[Text], Field(max_length=_MAX_NICS)]
    gpu_pci: Annotated[str, Field(max_length=_MAX_STR)]
    nic_order: Annotated[list[tuple[Text, Text]], Field(max_length=_MAX_NICS)]
    rdma: Annotated[list[Text], Field(max_length=2)]


class ClusterView:
    """The records of all ranks, checked for consistency; identical on every rank."""

    def __init__(self, records: list[RankRecord]):
        if not records:
            raise TopologyError("the cluster view is empty")
        ranks = [r.rank for r in records]
        if sorted(ranks) != list(range(len(records))):
            raise TopologyError(f"the cluster view must hold ranks 0..{len(records) - 1} once each, got {ranks}")
        self.records = sorted(records, key=lambda r: r.rank)
        seen: dict[tuple[str, int], int] = {}
        for r in self.records:
            key = (r.host, r.local_rank)
            if key in seen:
                raise TopologyError(
                    f"ranks {seen[key]} and {r.rank} both claim local rank {r.local_rank} on host {r.host!r}"
                )
            seen[key] = r.rank
        every_nic = [n.name for r in self.records for n in r.nics]
        for r in self.records:  # a name no node has is a typo: refused, not skipped in silence
            missing = unmatched(r.named, every_nic)
            if missing:
                raise TopologyError(f"the interface list of rank {r.rank} (host {r.host}) names {', '.join(missing)}, "
                                    "which matches no interface on any node of this job; fix the name in "
                                    "parallel.interfaces or BIMETAL_IFACES (each node uses the listed interfaces it "
                                    "has).")
        first = self.records[0]
        for r in self.records[1:]:
            why = versions.mismatch(first.rank, r.rank, first.software(), r.software())
            if why:
                raise TopologyError(why)

    @property
    def world_size(self) -> int:
        return len(self.records)

    def __getitem__(self, rank: int) -> RankRecord:
        return self.records[rank]

    def vendor_of(self, rank: int) -> str:
        return self.records[rank].vendor

    def host_of(self, rank: int) -> str:
        return self.records[rank].host

    def nics_of(self, rank: int) -> tuple[NicInfo, ...]:
        return self.records[rank].nics

    @property
    def hosts(self) -> list[str]:
        """Host names in order of their first rank."""
        return list(dict.fromkeys(r.host for r in self.records))

    @property
    def vendors(self) -> list[str]:
        """Vendors in order of their first rank."""
        return list(dict.fromkeys(r.vendor for r in self.records))

    def ranks_on(self, host: str) -> list[int]:
        return [r.rank for r in self.records if r.host == host]

    def is_mixed(self) -> bool:
        return len(self.vendors) > 1

    def to_json(self) -> str:
        return json.dumps([json.loads(r.to_json()) for r in self.records])

    def chosen_nics(self, rank: int, count: int = 1) -> list[NicInfo]:
        """The interfaces ``rank`` takes toward the ranks of every other node (``interfaces.usable_toward`` and
        ``pick``): what its cpu-forward stripes and device-direct address use unless a group's peers say
        otherwise."""
        me = self.records[rank]
        peers = [r.nics for r in self.records if r.host != me.host]
        return pick(usable_toward(me.nics, peers), me.local_rank, count, preferred_names(me.nic_order))

    def nic_reason(self, rank: int, name: str) -> str:
        """Why ``rank`` takes interface ``name`` where it prefers it (``same PCIe switch``, ``by position: ...``)."""
        return dict(self.records[rank].nic_order).get(name, "by position")

    def format_table(self, stripes: int = 1, named: Sequence[str] = (), named_by: str = "BIMETAL_CF_IFACES") -> str:
        """One row per rank; ``uses``: the interface(s) it takes for cross-node traffic (``stripes`` of them; the
        ``named`` ones where cpu-forward's stripes are named, ``named_by``) and ``why`` the first; ``rdma``: the
        RDMA device device-direct's engine opens and why (``all``: every one it finds)."""
        rows = [("rank", "local", "host", "vendor", "gpu", "device", "memory", "uses", "why", "rdma", "nics")]
        for r in self.records:
            mem = f"{r.memory_bytes / 2**30:.0f} GiB" if r.memory_bytes else "-"
            nics = " ".join(f"{n.name}={n.address}/{n.prefix}" for n in r.nics) or "-"
            chosen = list(named) or [n.name for n in self.chosen_nics(r.rank, stripes)]
            why = f"explicit {named_by}" if named else self.nic_reason(r.rank, chosen[0]) if chosen else "-"
            gpu = f"cuda:{r.device_index}" if r.device_index >= 0 else "cpu"
            gpu += f" ({r.gpu_pci})" if r.gpu_pci else ""
            rdma = f"{r.rdma[0]} ({r.rdma[1]})" if len(r.rdma) == 2 else "all"
            rows.append((str(r.rank), str(r.local_rank), r.host, r.vendor, gpu, r.device, mem, ",".join(chosen) or "-",
                         why, rdma, nics))
        return format_rows(rows)


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """A plain left-aligned text table; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

