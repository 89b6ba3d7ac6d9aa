"""Cluster spec for the planner: node groups read from TOML, validated with the key and file named.

Each ``[[group]]`` describes identical nodes. Peak BF16 and memory default from the device table;
``efficiency`` (achievable fraction of peak) defaults to measured GEMM ceiling / peak x 0.75, because a
whole training layer reaches less than a bare GEMM (HARDWARE.md: ~60% MFU on H100 vs 80% GEMM ceiling).
A group may instead name a ``profile`` (JSON from ``bimetal profile``, path relative to the spec) and a
``cpu_share`` (lab ranks capped to part of a core): its compute rate is then measured x share.
Host-path keys (``tcp_conn_gbps``, ``tcp_iface_gbps``, ``host_copy_gbps``, ``msg_latency_us``) are described
in ``bimetal.plan.hostpath``; ``bimetal plan fit`` sets them from measurements. An unknown key is refused
with the key and the file named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field

from bimetal.errors import UserError
from bimetal.schema import SHAPE, Problem, check, read_toml
from bimetal.topology.devices import lookup


@dataclass(frozen=True)
class NodeGroup:
    """A set of identical nodes of one vendor."""

    name: str
    count: int
    vendor: str
    gpu: str
    gpus_per_node: int
    peak_flops: float
    memory_bytes: int
    efficiency: float
    nics_per_node: int
    nic_gbps: float
    h2d_gbps: float
    """Pinned host-device copy bandwidth, GB/s."""
    intra_gbps: float
    """Intra-node GPU-GPU (all-reduce bus) bandwidth, GB/s."""
    gpudirect: bool
    tcp_conn_gbps: float = 2.0
    """GB/s one TCP connection reaches (HARDWARE.md: Gloo over TCP ~1-2.4 GB/s per connection)."""
    tcp_iface_gbps: float = float("inf")
    """GB/s the TCP stack moves through one interface, all its connections together (default: line rate)."""
    host_copy_gbps: float = float("inf")
    """Host memory bandwidth the node's concurrent staging copies share (default: gpus_per_node x h2d_gbps)."""
    msg_latency_us: float = 30.0
    """Per-message cost of the TCP path, microseconds."""

    @property
    def gpus(self) -> int:
        return self.count * self.gpus_per_node

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.efficiency


@dataclass(frozen=True)
class ClusterSpec:
    """All node groups of one cluster, in file order."""

    path: str
    groups: tuple[NodeGroup, ...]

    @property
    def total_gpus(self) -> int:
        return sum(g.gpus for g in self.groups)


N = TypeVar("N", int, float)
Positive = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(gt=0)]


@dataclass(frozen=True)
class GroupTable:
    """One ``[[group]]`` table as written; absent keys are None and take their defaults in ``parse_spec``."""

    __pydantic_config__ = SHAPE

    vendor: Literal["nvidia", "amd", "cpu"]
    gpu: str
    gpus_per_node: Count | None = None  # required: refused in parse_spec when absent, after the device checks
    nics_per_node: Count | None = None  # (required)
    nic_gbps: Positive | None = None  # (required)
    intra_gbps: Positive | None = None  # (required)
    name: str | None = None
    count: Count | None = None
    peak_bf16_tflops: Positive | None = None
    memory_gb: Positive | None = None
    efficiency: Positive | None = None
    profile: str | None = None
    cpu_share: Positive | None = None
    h2d_gbps: Positive | None = None
    gpudirect: bool = False
    tcp_conn_gbps: Positive | None = None
    tcp_iface_gbps: Positive | None = None
    host_copy_gbps: Positive | None = None
    msg_latency_us: Positive | None = None


@dataclass(frozen=True)
class SpecFile:
    """A cluster spec file: its ``[[group]]`` tables and nothing else."""

    __pydantic_config__ = SHAPE

    group: Annotated[list[GroupTable], Field(min_length=1)]


GROUP_KEYS = frozenset(f.name for f in fields(GroupTable))


def _explain(path: str) -> Callable[[Problem], str]:
    """The spec's sentences: ``<file>: group[i]: key 'k' ...``, every one naming the file and the key."""
    def explain(p: Problem) -> str:
        if not p.key.startswith("group["):
            if p.key == "group" or p.key.startswith("group."):
                return f"{path}: key 'group' missing; define at least one [[group]] table."
            return f"{path}: unknown key '{p.key}'; a cluster spec holds only [[group]] tables."
        group, _, key = p.key.partition(".")
        where = f"{path}: {group}"
        if not key:
            return f"{where} must be a table of keys."
        if p.kind == "unknown":
            return f"{where}: unknown key '{key}'; known keys: {', '.join(sorted(GROUP_KEYS))}."
        if p.kind == "missing":
            return f"{where}: missing key '{key}'; add it to the group."
        if key == "vendor":
            return f"{where}: key 'vendor' must be 'nvidia', 'amd' or 'cpu', got {p.value!r}."
        if p.kind == "type":
            return f"{where}: key '{key}' must be a {p.want}, got {p.value!r}."
        return f"{where}: key '{key}' must be positive, got {p.value!r}."
    return explain


def parse_spec(data: dict[str, Any], path: str) -> ClusterSpec:
    """Validate a decoded TOML document; every error names the file and the key."""
    if not isinstance(data.get("group"), list) or not data["group"]:  # before its other keys: no groups, no spec
        raise UserError(f"{path}: key 'group' missing; define at least one [[group]] table.")
    spec = check(SpecFile, data, path, _explain(path))
    groups = []
    for i, t in enumerate(spec.group):
        where = f"{path}: group[{i}]"
        vendor, gpu = t.vendor, t.gpu
        dev = lookup(gpu)
        if t.profile is not None:
            # A measured profile replaces peak x efficiency; cpu_share scales it for capped lab ranks.
            from bimetal.plan.profile import load_profile
            share = _or(t.cpu_share, 1.0)
            if share > 1.0:
                raise UserError(f"{where}: key 'cpu_share' is a fraction of a core's time and must be <= 1.")
            peak, eff = load_profile(str(Path(path).parent / t.profile), where), share
        else:
            if dev is None and t.peak_bf16_tflops is None:
                raise UserError(f"{where}: key 'gpu' = {gpu!r} is not in the device table; set "
                                "'peak_bf16_tflops' and 'memory_gb' for it, or 'profile'.")
            peak = _or(t.peak_bf16_tflops, dev.peak_bf16_tflops if dev else 0.0) * 1e12
            eff_default = (dev.measured_bf16_tflops / dev.peak_bf16_tflops * 0.75
                           if dev and dev.measured_bf16_tflops else 0.5)
            eff = _or(t.efficiency, eff_default)
            if eff > 1.0:
                raise UserError(f"{where}: key 'efficiency' is a fraction of peak and must be <= 1, got {eff}.")
        if dev is None and t.memory_gb is None:
            raise UserError(f"{where}: key 'memory_gb' missing for {gpu!r}, which is not in the device table.")
        mem = _or(t.memory_gb, dev.memory_gb if dev else 0.0)
        nics, nic_gbps = _need(t.nics_per_node, "nics_per_node", where), float(_need(t.nic_gbps, "nic_gbps", where))
        gpn, h2d = _need(t.gpus_per_node, "gpus_per_node", where), _or(t.h2d_gbps, 50.0)
        groups.append(NodeGroup(
            name=t.name if t.name is not None else f"{vendor}{i}", count=t.count or 1, vendor=vendor,
            gpu=dev.name if dev else gpu, gpus_per_node=gpn,
            peak_flops=peak, memory_bytes=int(mem * 1e9), efficiency=eff,
            nics_per_node=nics, nic_gbps=nic_gbps, h2d_gbps=h2d,
            intra_gbps=float(_need(t.intra_gbps, "intra_gbps", where)),
            gpudirect=t.gpudirect,
            tcp_conn_gbps=_or(t.tcp_conn_gbps, 2.0),
            tcp_iface_gbps=_or(t.tcp_iface_gbps, nic_gbps / 8),
            host_copy_gbps=_or(t.host_copy_gbps, gpn * h2d),
            msg_latency_us=_or(t.msg_latency_us, 30.0)))
    return ClusterSpec(path=path, groups=tuple(groups))


def _or(value: float | None, default: float) -> float:
    return float(default if value is None else value)


def _need(value: N | None, key: str, where: str) -> N:
    if value is None:
        raise UserError(f"{where}: missing key '{key}'; add it to the group.")
    return value


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec TOML file."""
    p = Path(path)
    data = read_toml(p, f"cluster spec {p} not found; pass a TOML file such as configs/clusters/h200_mi325x.toml.",
                     f"{p}: not valid TOML ({{error}}); fix the syntax.")
    return parse_spec(data, str(p))
