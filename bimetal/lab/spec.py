"""The lab spec: which emulated nodes, vendors, ranks, NICs and link speeds, read from TOML and validated.

A spec file looks like::

    [lab]
    name = "pair"        # lab id (default: the file's stem); names every namespace and cgroup
    nics = 2             # NICs per node (default for every node)
    rate_mbit = 400      # line rate of each NIC, both directions
    latency_ms = 0       # one-way added latency (netem, else NFQUEUE through bimetal.lab.delay)

    [[node]]
    name = "n0"
    vendor = "nvidia"    # simulated vendor of the node's ranks
    ranks = 2
    cpu_share = 1.0      # optional: CPUs per rank (0.5 = half a core), a number or one per rank

Every mistake is a ``UserError`` naming the file and the key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
from bimetal.topology.vendor import SIMULATED_VENDORS

_ID = re.compile(r"^[a-z0-9]{1,12}$")
_NODE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
MAX_NODES = 16
MAX_NICS = 8
MAX_RANKS = 16


@dataclass(frozen=True)
class NodeSpec:
    """One emulated node: a network namespace holding ``ranks`` ranks of one simulated vendor."""

    name: str
    vendor: str
    ranks: int
    nics: int
    rate_mbit: float
    """Line rate of each NIC in Mbit/s, shaped in both directions."""
    latency_ms: float
    cpu_share: tuple[float | None, ...] = field(default_factory=tuple)
    """CPUs per local rank (None = unlimited); length ``ranks``."""


@dataclass(frozen=True)
class LabSpec:
    """A whole lab: its id (prefix of every kernel object it creates) and its nodes, in node-rank order."""

    lab_id: str
    nodes: tuple[NodeSpec, ...]
    source: str = "<dict>"

    @property
    def world_size(self) -> int:
        return sum(n.ranks for n in self.nodes)

    @property
    def max_nics(self) -> int:
        return max(n.nics for n in self.nodes)

    def simulate_string(self) -> str:
        """The ``--simulate`` form of the lab's vendors by global rank (``nvidia:2,amd:2``)."""
        return ",".join(f"{n.vendor}:{n.ranks}" for n in self.nodes)


def _number(table: dict[str, Any], key: str, where: str, default: float | None, lo: float, hi: float) -> float:
    value = table.get(key, default)
    if value is None:
        raise UserError(f"{where}: key {key!r} is missing; give a number between {lo:g} and {hi:g}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise UserError(f"{where}: key {key!r} is {value!r}; give a number between {lo:g} and {hi:g}")
    return float(value)


def parse_spec(data: dict[str, Any], source: str = "<dict>", default_id: str = "lab") -> LabSpec:
    """Validate a spec already parsed from TOML; ``source`` names the file in every message."""
    known_top = {"lab", "node"}
    for key in data:
        if key not in known_top:
            raise UserError(f"{source}: unknown key {key!r}; the spec has a [lab] table and [[node]] tables")
    lab = data.get("lab", {})
    if not isinstance(lab, dict):
        raise UserError(f"{source}: key 'lab' must be a table ([lab])")
    for key in lab:
        if key not in ("name", "nics", "rate_mbit", "latency_ms"):
            raise UserError(f"{source}: unknown key 'lab.{key}'; known: name, nics, rate_mbit, latency_ms")
    lab_id = lab.get("name", default_id)
    if not isinstance(lab_id, str) or not _ID.match(lab_id):
        raise UserError(f"{source}: key 'lab.name' is {lab_id!r}; use 1-12 lower-case letters or digits")
    nodes_raw = data.get("node")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise UserError(f"{source}: no [[node]] tables; give at least one node (name, vendor, ranks)")
    if len(nodes_raw) > MAX_NODES:
        raise UserError(f"{source}: {len(nodes_raw)} nodes; the lab supports at most {MAX_NODES}")

    nodes: list[NodeSpec] = []
    for i, raw in enumerate(nodes_raw):
        where = f"{source}: node[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{where} must be a table")
        for key in raw:
            if key not in ("name", "vendor", "ranks", "nics", "rate_mbit", "latency_ms", "cpu_share"):
                raise UserError(
                    f"{where}: unknown key {key!r}; known: name, vendor, ranks, nics, rate_mbit, latency_ms, cpu_share"
                )
        name = raw.get("name", f"n{i}")
        if not isinstance(name, str) or not _NODE.match(name) or name == "hub":
            raise UserError(
                f"{where}: key 'name' is {name!r}; use 1-8 lower-case letters or digits, starting with a letter"
            )
        if any(n.name == name for n in nodes):
            raise UserError(f"{where}: key 'name' {name!r} is used by an earlier node; node names must be unique")
        vendor = raw.get("vendor")
        if vendor not in SIMULATED_VENDORS:
            raise UserError(f"{where}: key 'vendor' is {vendor!r}; use one of {', '.join(SIMULATED_VENDORS)}")
        ranks = int(_number(raw, "ranks", where, None, 1, MAX_RANKS))
        if ranks != raw["ranks"]:
            raise UserError(f"{where}: key 'ranks' is {raw['ranks']!r}; give a whole number")
        nics = int(_number(raw, "nics", where, lab.get("nics", 1), 1, MAX_NICS))
        rate = _number(raw, "rate_mbit", where, lab.get("rate_mbit"), 1, 100_000)
        latency = _number(raw, "latency_ms", where, lab.get("latency_ms", 0), 0, 10_000)
        share_raw = raw.get("cpu_share")
        shares: list[float | None]
        if share_raw is None:
            shares = [None] * ranks
        elif isinstance(share_raw, list):
            if len(share_raw) != ranks:
                raise UserError(f"{where}: key 'cpu_share' lists {len(share_raw)} values for {ranks} ranks")
            shares = [_number({"cpu_share": s}, "cpu_share", where, None, 0.01, 64) for s in share_raw]
        else:
            shares = [_number(raw, "cpu_share", where, None, 0.01, 64)] * ranks
        nodes.append(NodeSpec(name, str(vendor), ranks, nics, rate, latency, tuple(shares)))
    return LabSpec(lab_id, tuple(nodes), source)


def load_spec(path: str | Path, lab_id: str | None = None) -> LabSpec:
    """Read and validate a spec file; ``lab_id`` overrides ``lab.name``."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"lab spec {path} does not exist; pass an existing TOML file (see configs/lab/)") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"lab spec {path} is not valid TOML ({exc})") from None
    spec = parse_spec(data, str(path), default_id=re.sub(r"[^a-z0-9]", "", path.stem.lower())[:12] or "lab")
    if lab_id is not None:
        if not _ID.match(lab_id):
            raise UserError(f"lab id {lab_id!r} is not valid; use 1-12 lower-case letters or digits")
        spec = LabSpec(lab_id, spec.nodes, spec.source)
    return spec
