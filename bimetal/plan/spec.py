"""Cluster spec for the planner: node groups read from TOML, validated with the key and file named.

Each ``[[group]]`` describes identical nodes. Peak BF16 and memory default from the device table;
``efficiency`` (achievable fraction of peak) defaults to measured GEMM ceiling / peak x 0.75, because a
whole training layer reaches less than a bare GEMM (HARDWARE.md: ~60% MFU on H100 vs 80% GEMM ceiling).
A group may instead name a ``profile`` (JSON from ``bimetal profile``, path relative to the spec) and a
``cpu_share`` (lab ranks capped to part of a core): its compute rate is then measured x share.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
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


def _get(table: dict[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    if key not in table:
        if default is None:
            raise UserError(f"{where}: missing key '{key}'; add it to the group.")
        return default
    value = table[key]
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise UserError(f"{where}: key '{key}' must be a {kind.__name__}, got {value!r}.")
    if kind in (int, float) and value <= 0:
        raise UserError(f"{where}: key '{key}' must be positive, got {value!r}.")
    return value


def parse_spec(data: dict[str, Any], path: str) -> ClusterSpec:
    """Validate a decoded TOML document; every error names the file and the key."""
    raw = data.get("group")
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{path}: key 'group' missing; define at least one [[group]] table.")
    groups = []
    for i, t in enumerate(raw):
        where = f"{path}: group[{i}]"
        vendor = _get(t, "vendor", str, where)
        if vendor not in ("nvidia", "amd", "cpu"):
            raise UserError(f"{where}: key 'vendor' must be 'nvidia', 'amd' or 'cpu', got {vendor!r}.")
        gpu = _get(t, "gpu", str, where)
        dev = lookup(gpu)
        if "profile" in t:
            # A measured profile replaces peak x efficiency; cpu_share scales it for capped lab ranks.
            from bimetal.plan.profile import load_profile
            share = _get(t, "cpu_share", float, where, 1.0)
            if share > 1.0:
                raise UserError(f"{where}: key 'cpu_share' is a fraction of a core's time and must be <= 1.")
            peak, eff = load_profile(str(Path(path).parent / _get(t, "profile", str, where)), where), share
        else:
            if dev is None and "peak_bf16_tflops" not in t:
                raise UserError(f"{where}: key 'gpu' = {gpu!r} is not in the device table; set "
                                "'peak_bf16_tflops' and 'memory_gb' for it, or 'profile'.")
            peak = _get(t, "peak_bf16_tflops", float, where, dev.peak_bf16_tflops if dev else None) * 1e12
            eff_default = (dev.measured_bf16_tflops / dev.peak_bf16_tflops * 0.75
                           if dev and dev.measured_bf16_tflops else 0.5)
            eff = _get(t, "efficiency", float, where, eff_default)
            if eff > 1.0:
                raise UserError(f"{where}: key 'efficiency' is a fraction of peak and must be <= 1, got {eff}.")
        if dev is None and "memory_gb" not in t:
            raise UserError(f"{where}: key 'memory_gb' missing for {gpu!r}, which is not in the device table.")
        mem = _get(t, "memory_gb", float, where, dev.memory_gb if dev else None)
        groups.append(NodeGroup(
            name=str(t.get("name", f"{vendor}{i}")), count=_get(t, "count", int, where, 1), vendor=vendor,
            gpu=dev.name if dev else gpu, gpus_per_node=_get(t, "gpus_per_node", int, where),
            peak_flops=peak, memory_bytes=int(mem * 1e9), efficiency=eff,
            nics_per_node=_get(t, "nics_per_node", int, where), nic_gbps=_get(t, "nic_gbps", float, where),
            h2d_gbps=_get(t, "h2d_gbps", float, where, 50.0), intra_gbps=_get(t, "intra_gbps", float, where),
            gpudirect=bool(t.get("gpudirect", False))))
    return ClusterSpec(path=path, groups=tuple(groups))


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec TOML file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster spec {p} not found; pass a TOML file such as configs/clusters/h200_mi325x.toml.")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e}); fix the syntax.") from e
    return parse_spec(data, str(p))
