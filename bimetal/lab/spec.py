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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
from bimetal.schema import SHAPE, Problem, check, read_toml
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


@dataclass(frozen=True)
class LabTable:
    """The ``[lab]`` table as written: the lab id and the defaults of every node."""

    __pydantic_config__ = SHAPE

    name: str | None = None
    nics: float | None = None
    rate_mbit: float | None = None
    latency_ms: float | None = None


@dataclass(frozen=True)
class NodeTable:
    """One ``[[node]]`` table as written; absent keys take the ``[lab]`` defaults."""

    __pydantic_config__ = SHAPE

    name: str | None = None
    vendor: str | None = None
    ranks: float | None = None
    nics: float | None = None
    rate_mbit: float | None = None
    latency_ms: float | None = None
    cpu_share: float | list[float] | None = None


@dataclass(frozen=True)
class LabFile:
    """A lab spec file: one ``[lab]`` table and the ``[[node]]`` tables."""

    __pydantic_config__ = SHAPE

    lab: LabTable = field(default_factory=LabTable)
    node: list[NodeTable] = field(default_factory=list)


def _explain(source: str) -> Callable[[Problem], str]:
    """The spec's sentences for what the schema refuses, each naming the file and the key."""
    def explain(p: Problem) -> str:
        head, _, key = p.key.partition(".")
        if p.kind == "unknown" and not key:
            return f"{source}: unknown key {p.key!r}; the spec has a [lab] table and [[node]] tables"
        if head == "lab":
            if not key:
                return f"{source}: key 'lab' must be a table ([lab])"
            if p.kind == "unknown":
                return f"{source}: unknown key 'lab.{key}'; known: {', '.join(p.known)}"
            return f"{source}: key 'lab.{key}' is {p.value!r}; give a {_WANT.get(key, p.want)}"
        if not head.startswith("node["):
            return f"{source}: key 'node' must be a list of [[node]] tables"
        where = f"{source}: {head}"
        if not key:
            return f"{where} must be a table"
        if p.kind == "unknown":
            return f"{where}: unknown key {key!r}; known: {', '.join(p.known)}"
        leaf = key.split("[", 1)[0]
        return f"{where}: key {leaf!r} is {p.value!r}; give a {_WANT.get(leaf, p.want)}"
    return explain


_WANT = {"name": "name of lower-case letters and digits", "vendor": f"vendor, one of {', '.join(SIMULATED_VENDORS)}",
         "cpu_share": "number of CPUs per rank, or one per rank", "ranks": "whole number", "nics": "whole number",
         "rate_mbit": "number (Mbit/s)", "latency_ms": "number (ms)"}


def _number(value: float | None, key: str, where: str, default: float | None, lo: float, hi: float) -> float:
    value = default if value is None else value
    if value is None:
        raise UserError(f"{where}: key {key!r} is missing; give a number between {lo:g} and {hi:g}")
    if not lo <= value <= hi:
        raise UserError(f"{where}: key {key!r} is {value!r}; give a number between {lo:g} and {hi:g}")
    return float(value)


def parse_spec(data: dict[str, Any], source: str = "<dict>", default_id: str = "lab") -> LabSpec:
    """Validate a spec already parsed from TOML; ``source`` names the file in every message."""
    spec = check(LabFile, data, source, _explain(source))
    lab = spec.lab
    lab_id = lab.name if lab.name is not None else default_id
    if not _ID.match(lab_id):
        raise UserError(f"{source}: key 'lab.name' is {lab_id!r}; use 1-12 lower-case letters or digits")
    if not spec.node:
        raise UserError(f"{source}: no [[node]] tables; give at least one node (name, vendor, ranks)")
    if len(spec.node) > MAX_NODES:
        raise UserError(f"{source}: {len(spec.node)} nodes; the lab supports at most {MAX_NODES}")

    nodes: list[NodeSpec] = []
    for i, raw in enumerate(spec.node):
        where = f"{source}: node[{i}]"
        name = raw.name if raw.name is not None else f"n{i}"
        if not _NODE.match(name) or name == "hub":
            raise UserError(
                f"{where}: key 'name' is {name!r}; use 1-8 lower-case letters or digits, starting with a letter"
            )
        if any(n.name == name for n in nodes):
            raise UserError(f"{where}: key 'name' {name!r} is used by an earlier node; node names must be unique")
        vendor = raw.vendor
        if vendor not in SIMULATED_VENDORS:
            raise UserError(f"{where}: key 'vendor' is {vendor!r}; use one of {', '.join(SIMULATED_VENDORS)}")
        ranks = int(_number(raw.ranks, "ranks", where, None, 1, MAX_RANKS))
        if ranks != raw.ranks:
            raise UserError(f"{where}: key 'ranks' is {raw.ranks!r}; give a whole number")
        nics = int(_number(raw.nics, "nics", where, lab.nics if lab.nics is not None else 1, 1, MAX_NICS))
        rate = _number(raw.rate_mbit, "rate_mbit", where, lab.rate_mbit, 1, 100_000)
        latency = _number(raw.latency_ms, "latency_ms", where, lab.latency_ms if lab.latency_ms is not None else 0,
                          0, 10_000)
        shares: list[float | None]
        if raw.cpu_share is None:
            shares = [None] * ranks
        elif isinstance(raw.cpu_share, list):
            if len(raw.cpu_share) != ranks:
                raise UserError(f"{where}: key 'cpu_share' lists {len(raw.cpu_share)} values for {ranks} ranks")
            shares = [_number(s, "cpu_share", where, None, 0.01, 64) for s in raw.cpu_share]
        else:
            shares = [_number(raw.cpu_share, "cpu_share", where, None, 0.01, 64)] * ranks
        nodes.append(NodeSpec(name, vendor, ranks, nics, rate, latency, tuple(shares)))
    return LabSpec(lab_id, tuple(nodes), source)


def load_spec(path: str | Path, lab_id: str | None = None) -> LabSpec:
    """Read and validate a spec file; ``lab_id`` overrides ``lab.name``."""
    path = Path(path)
    data = read_toml(path, f"lab spec {path} does not exist; pass an existing TOML file (see configs/lab/)",
                     f"lab spec {path} is not valid TOML ({{error}})")
    spec = parse_spec(data, str(path), default_id=re.sub(r"[^a-z0-9]", "", path.stem.lower())[:12] or "lab")
    if lab_id is not None:
        if not _ID.match(lab_id):
            raise UserError(f"lab id {lab_id!r} is not valid; use 1-12 lower-case letters or digits")
        spec = LabSpec(lab_id, spec.nodes, spec.source)
    return spec
