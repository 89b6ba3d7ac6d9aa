"""Differentiated back-end selection: every parallel group is classified and given a back-end.

* homogeneous groups (one vendor) -> the vendor's native library: ``nccl`` on GPUs (ROCm torch maps it to
  RCCL), ``bimetal_sim_native`` under simulation (Gloo that refuses mixed vendors, as NCCL/RCCL would);
* cross-vendor groups -> a bimetal transport chosen per axis (``cpu-forward``, ``device-direct`` or ``gloo``).

``transports["homogeneous"] = "gloo"`` puts the one-vendor groups on stock Gloo as well (every group on Gloo,
the baseline bimetal is compared with); the default ``native`` keeps them on the vendor library.

A data-parallel group that spans vendors also gets the groups its hierarchical all-reduce needs: one native
group per vendor island inside it, and cross-island groups that join the ranks holding the same shard.

``GroupSpec`` is plain data (testable without a process group); ``create_groups`` makes the real groups,
called by every rank in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal.comm.registry import CPU_FORWARD, SIM_NATIVE, staged_native
from bimetal.errors import UserError
from bimetal.parallel.layout import Layout
from bimetal.topology.records import ClusterView, format_rows
from bimetal.transports import DEFAULT, TRANSPORTS

AXES = ("pp", "dp")
HOMOGENEOUS = ("native", "gloo")


@dataclass(frozen=True)
class GroupSpec:
    """One process group to create: who is in it, what it is, and which back-end carries it."""

    name: str
    """Human-readable description, also the torch ``group_desc`` (e.g. ``pp.dp0``)."""
    axis: str
    """``pp``, ``dp``, ``tp``, ``dp.island`` or ``dp.cross``."""
    ranks: tuple[int, ...]
    vendors: tuple[str, ...]
    kind: str
    """``homogeneous-nvidia``, ``homogeneous-amd``, ``homogeneous-cpu`` or ``cross-vendor``."""
    backend: str


def classify(vendors: tuple[str, ...]) -> str:
    distinct = set(vendors)
    return f"homogeneous-{vendors[0]}" if len(distinct) == 1 else "cross-vendor"


def native_backend(vendor: str, simulated: bool) -> str:
    if simulated:
        return SIM_NATIVE
    return "nccl" if vendor in ("nvidia", "amd") else "gloo"


def resolve_transports(transports: dict[str, str] | None) -> dict[str, str]:
    """Map axis -> torch back-end name for cross-vendor groups; ``UserError`` on unknown names."""
    chosen = {"pp": DEFAULT, "dp": DEFAULT}
    for axis, name in (transports or {}).items():
        if axis == "homogeneous":
            if name not in HOMOGENEOUS:
                raise UserError(f"unknown back-end {name!r} for one-vendor groups; use one of {', '.join(HOMOGENEOUS)}")
            continue
        if axis not in AXES:
            raise UserError(f"unknown parallel axis {axis!r} for a transport; use one of {', '.join(AXES)}")
        if name not in TRANSPORTS:
            raise UserError(f"unknown transport {name!r} for axis {axis}; use one of {', '.join(TRANSPORTS)}")
        chosen[axis] = name
    return {axis: TRANSPORTS[name].backend for axis, name in chosen.items()}


def plan_groups(
    view: ClusterView, layout: Layout, transports: dict[str, str] | None = None, simulated: bool = True
) -> list[GroupSpec]:
    """All groups of the layout (size > 1), in the order every rank must create them."""
    backends = resolve_transports(transports)
    all_gloo = (transports or {}).get("homogeneous", "native") == "gloo"
    specs: list[GroupSpec] = []

    def add(name: str, axis: str, ranks: tuple[int, ...], cross_axis: str) -> None:
        if len(ranks) < 2:
            return
        vendors = tuple(view.vendor_of(r) for r in ranks)
        kind = classify(vendors)
        if kind == "cross-vendor":
            backend = backends[cross_axis]
        else:
            backend = "gloo" if all_gloo else native_backend(vendors[0], simulated)
        specs.append(GroupSpec(name, axis, ranks, vendors, kind, backend))

    dims = layout.dims
    for i, ranks in enumerate(layout.pp_groups()):
        d, t = divmod(i, dims.tp)
        add(f"pp.dp{d}" + (f".tp{t}" if dims.tp > 1 else ""), "pp", ranks, "pp")
    for i, ranks in enumerate(layout.dp_groups()):
        s, t = divmod(i, dims.tp)
        base = f"dp.stage{s}" + (f".tp{t}" if dims.tp > 1 else "")
        add(base, "dp", ranks, "dp")
        if layout.stage_vendors[s] == "mixed":
            islands = _split_islands(view, ranks)
            sizes = {len(members) for members in islands.values()}
            if len(sizes) != 1:
                shape = ", ".join(f"{v}:{len(m)}" for v, m in islands.items())
                raise UserError(
                    f"data-parallel group {base} spans vendor islands of unequal size ({shape}); the "
                    "hierarchical all-reduce needs equal islands - choose dp so each vendor holds the same share"
                )
            for vendor, members in islands.items():
                add(f"{base}.island-{vendor}", "dp.island", members, "dp")
            for j in range(sizes.pop()):
                add(f"{base}.cross{j}", "dp.cross", tuple(m[j] for m in islands.values()), "dp")
    for s, d_ranks in enumerate(layout.tp_groups()):
        s_idx, d = divmod(s, dims.dp)
        add(f"tp.stage{s_idx}.dp{d}", "tp", d_ranks, "dp")
    return specs


def _split_islands(view: ClusterView, ranks: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    islands: dict[str, list[int]] = {}
    for r in ranks:
        islands.setdefault(view.vendor_of(r), []).append(r)
    return {v: tuple(m) for v, m in islands.items()}


def format_group_table(specs: list[GroupSpec], fallbacks: dict[str, str] | None = None) -> str:
    """The group table; ``fallbacks`` (group name -> reason) marks groups that were built on cpu-forward
    instead of device-direct, with the reason under the table. Simulated native groups on cpu-forward's staged
    path (``BIMETAL_SIMULATE_DEVICE=cuda``, ``registry.staged_native``) say so."""
    fallbacks = {k: v for k, v in (fallbacks or {}).items() if v}
    staged = staged_native()
    rows = [("group", "ranks", "vendors", "kind", "backend")]
    for g in specs:
        vendors = ",".join(dict.fromkeys(g.vendors))
        backend = f"{CPU_FORWARD} (fallback from {g.backend})" if g.name in fallbacks else g.backend
        if staged and backend == SIM_NATIVE:
            backend += " (staged: device tensors)"
        rows.append((g.name, ",".join(map(str, g.ranks)), vendors, g.kind, backend))
    notes = [f"  {name}: {why}" for name, why in fallbacks.items()]
    return format_rows(rows) + ("\nfallbacks:\n" + "\n".join(notes) if notes else "")


def create_groups(specs: list[GroupSpec], timeout: timedelta, pg_options: dict[str, Any] | None = None
                  ) -> dict[str, dist.ProcessGroup | None]:
    """Create every group (collectively, same order on all ranks); name -> group, None where not a member.
    ``pg_options``: back-end -> the options its groups get (bimetal's transports: the interfaces named)."""
    groups: dict[str, dist.ProcessGroup | None] = {}
    for g in specs:
        pg = dist.new_group(list(g.ranks), backend=g.backend, timeout=timeout, group_desc=g.name,
                            pg_options=(pg_options or {}).get(g.backend))
        groups[g.name] = pg if dist.get_rank() in g.ranks else None
    return groups
