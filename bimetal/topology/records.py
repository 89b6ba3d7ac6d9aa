"""What each rank knows about itself, and the validated cluster view all ranks share.

A ``RankRecord`` travels as JSON (never pickle) and is checked field by field on arrival: a record that
fails names its rank and the offending field, so every rank stops with the same sentence.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bimetal.errors import UserError
from bimetal.topology.vendor import VENDORS

RECORD_VERSION = 1
_MAX_NICS = 64
_MAX_STR = 256


class TopologyError(UserError, ValueError):
    """A rank record or cluster view that fails validation."""


@dataclass(frozen=True)
class NicInfo:
    """One network interface a rank may use: its kernel name and IPv4/IPv6 address."""

    name: str
    address: str


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

        def fail(key: str, why: str) -> TopologyError:
            return TopologyError(f"topology record of {where}: field {key!r} {why}")

        expected = {"version", "rank", "local_rank", "host", "vendor", "device", "memory_bytes", "nics"}
        unknown = sorted(set(payload) - expected)
        if unknown:
            raise fail(unknown[0], "is not a known field")
        for key in sorted(expected):
            if key not in payload:
                raise fail(key, "is missing")
        if payload["version"] != RECORD_VERSION:
            raise fail("version", f"is {payload['version']!r}, this bimetal reads version {RECORD_VERSION}")
        for key in ("rank", "local_rank", "memory_bytes"):
            value = payload[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise fail(key, f"must be a non-negative integer, got {value!r}")
        if expected_rank is not None and payload["rank"] != expected_rank:
            raise fail("rank", f"says {payload['rank']}, but the record was published by rank {expected_rank}")
        for key in ("host", "vendor", "device"):
            value = payload[key]
            if not isinstance(value, str) or not value or len(value) > _MAX_STR:
                raise fail(key, f"must be a non-empty string of at most {_MAX_STR} characters, got {value!r}")
        if payload["vendor"] not in VENDORS:
            raise fail("vendor", f"is {payload['vendor']!r}, expected one of {', '.join(VENDORS)}")
        nics_raw = payload["nics"]
        if not isinstance(nics_raw, list) or len(nics_raw) > _MAX_NICS:
            raise fail("nics", f"must be a list of at most {_MAX_NICS} interfaces")
        nics = []
        for i, nic in enumerate(nics_raw):
            if not isinstance(nic, dict) or set(nic) != {"name", "address"}:
                raise fail(f"nics[{i}]", "must be an object with exactly 'name' and 'address'")
            name, address = nic["name"], nic["address"]
            if not isinstance(name, str) or not 0 < len(name) <= 15 or not name.isprintable() or "/" in name:
                raise fail(f"nics[{i}].name", f"is not an interface name: {name!r}")
            try:
                ipaddress.ip_address(address)
            except (ValueError, TypeError):
                raise fail(f"nics[{i}].address", f"is not an IP address: {address!r}") from None
            nics.append(NicInfo(name, address))
        return RankRecord(
            rank=payload["rank"],
            local_rank=payload["local_rank"],
            host=payload["host"],
            vendor=payload["vendor"],
            device=payload["device"],
            memory_bytes=payload["memory_bytes"],
            nics=tuple(nics),
        )


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

    def format_table(self) -> str:
        rows = [("rank", "local", "host", "vendor", "device", "memory", "nics")]
        for r in self.records:
            mem = f"{r.memory_bytes / 2**30:.0f} GiB" if r.memory_bytes else "-"
            nics = " ".join(f"{n.name}={n.address}" for n in r.nics) or "-"
            rows.append((str(r.rank), str(r.local_rank), r.host, r.vendor, r.device, mem, nics))
        return format_rows(rows)


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """A plain left-aligned text table; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def local_nics(include_loopback: bool | None = None) -> list[NicInfo]:
    """IPv4 interfaces of this host (or network namespace) that are up, in name order.

    Loopback is left out unless it is all there is (a laptop, a bare namespace), or asked for.
    """
    import psutil

    stats = psutil.net_if_stats()
    found: list[NicInfo] = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family == socket.AF_INET:
                found.append(NicInfo(name, addr.address))
                break
    loopback = [n for n in found if ipaddress.ip_address(n.address).is_loopback]
    others = [n for n in found if not ipaddress.ip_address(n.address).is_loopback]
    if include_loopback is None:
        return others or loopback
    return found if include_loopback else others
