"""Differentiated back-end selection: every parallel group is classified and given a back-end.

* homogeneous groups (one vendor) -> the vendor's native library: ``nccl`` on GPUs (ROCm torch maps it to
  RCCL), ``bimetal_sim_native`` under simulation (Gloo that refuses mixed vendors, as NCCL/RCCL would);
* cross-vendor groups -> a bimetal transport chosen per axis (``cpu-forward``, ``device-direct`` or ``gloo``).

``transports["homogeneous"] = "gloo"`` puts the one-vendor groups on stock Gloo as well (every group on Gloo,
the baseline bimetal is compared with); the default ``native`` keeps them on the vendor library.

A pipeline group whose neighbouring stages do not all pair the same way (pp=4 over two vendor islands: two hops
inside a vendor, one across) is a ``bimetal_per_hop`` group: each hop gets the back-end of its own kind, the
collectives a whole-group transport (``plan_pipeline``; the groups are made by ``pipeline_groups``).

A data-parallel group that spans vendors also gets the groups its hierarchical all-reduce needs: one native
group per vendor island inside it, and cross-island groups that join the ranks holding the same shard.

``GroupSpec`` is plain data (testable without a process group); ``create_groups`` makes the real groups,
called by every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal.comm.registry import CPU_FORWARD, PER_HOP, SIM_NATIVE, staged_native
from bimetal.errors import UserError
from bimetal.parallel.layout import Layout
from bimetal.parallel.pipeline_groups import PairSpec, collectives_backend, create_pipeline_group, stage_pairs
from bimetal.topology.records import ClusterView, format_rows
from bimetal.transports import DEFAULT, TRANSPORTS

AXES = ("pp", "dp")
HOMOGENEOUS = ("native", "gloo")
HOP, COLLECTIVES = "pp.hop", "pp.collectives"
PAIR = "pp.pair"
"""Axis of a boundary pair of a per-stage layout: two ranks of neighbouring stages that exchange pieces."""
"""Axes of the parts of a ``bimetal_per_hop`` pipeline group: its pairs of neighbouring stages, its collectives."""


@dataclass(frozen=True)
class GroupSpec:
    """One process group to create: who is in it, what it is, and which back-end carries it."""

    name: str
    """Human-readable description, also the torch ``group_desc`` (e.g. ``pp.dp0``)."""
    axis: str
    """``pp``, ``dp``, ``tp``, ``dp.island``, ``dp.cross``, or a part of a per-hop pp group: ``pp.hop`` (two ranks
    of neighbouring stages, earlier stage first) and ``pp.collectives``."""
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


def plan_pipeline(name: str, ranks: tuple[int, ...], vendors: tuple[str, ...], cross: str,
                  one_vendor: Callable[[str], str], owners: Sequence[int] | None = None) -> list[GroupSpec]:
    """The groups of one pipeline group (``ranks`` in stage order, ``vendors`` theirs): one plain group when every
    pair of neighbouring stages gets the same back-end, else the ``bimetal_per_hop`` group, one ``pp.hop`` spec
    per pair (``one_vendor(vendor)`` inside a vendor, ``cross`` across) and the ``pp.collectives`` group.
    ``owners``: the position holding each (virtual) stage (``pipeline_groups.stage_pairs``); default one stage
    per rank."""
    kind = classify(vendors)
    pairs = []
    for i, j in stage_pairs(owners if owners is not None else range(len(ranks))):
        pv = (vendors[i], vendors[j])
        pk = classify(pv)
        backend = cross if pk == "cross-vendor" else one_vendor(pv[0])
        pairs.append(GroupSpec(f"{name}.hop{i}-{j}", HOP, (ranks[i], ranks[j]), pv, pk, backend))
    if len({p.backend for p in pairs}) <= 1:
        plain = cross if kind == "cross-vendor" else one_vendor(vendors[0])
        return [GroupSpec(name, "pp", ranks, vendors, kind, plain)]
    coll = GroupSpec(f"{name}.collectives", COLLECTIVES, ranks, vendors, kind, collectives_backend(cross))
    return [GroupSpec(name, "pp", ranks, vendors, kind, PER_HOP), *pairs, coll]


def pipeline_parts(specs: list[GroupSpec], router: GroupSpec) -> tuple[list[GroupSpec], GroupSpec]:
    """The pair specs and the collectives spec of the per-hop pipeline group ``router``."""
    mine = [g for g in specs if g.name.startswith(router.name + ".") and g.axis in (HOP, COLLECTIVES)]
    return [g for g in mine if g.axis == HOP], next(g for g in mine if g.axis == COLLECTIVES)


def plan_groups(
    view: ClusterView, layout: Layout, transports: dict[str, str] | None = None, simulated: bool = True
) -> list[GroupSpec]:
    """All groups of the layout (size > 1), in the order every rank must create them."""
    backends = resolve_transports(transports)
    all_gloo = (transports or {}).get("homogeneous", "native") == "gloo"
    specs: list[GroupSpec] = []

    def one_vendor(vendor: str) -> str:
        return "gloo" if all_gloo else native_backend(vendor, simulated)

    def add(name: str, axis: str, ranks: tuple[int, ...], cross_axis: str) -> None:
        if len(ranks) < 2:
            return
        vendors = tuple(view.vendor_of(r) for r in ranks)
        kind = classify(vendors)
        backend = backends[cross_axis] if kind == "cross-vendor" else one_vendor(vendors[0])
        specs.append(GroupSpec(name, axis, ranks, vendors, kind, backend))

    dims = layout.dims
    if dims.shaped:  # stages of their own shapes: one group per pair of ranks that exchange boundary pieces
        from bimetal.parallel.boundary import boundary_pairs, pair_name

        for s in range(dims.pp - 1):
            for a, b in boundary_pairs(layout, s):
                add(pair_name(layout, a, b), PAIR, (a, b), "pp")
    for i, ranks in enumerate(layout.pp_groups()):
        d, t = divmod(i, dims.tp)
        if len(ranks) > 1:
            specs += plan_pipeline(f"pp.dp{d}" + (f".tp{t}" if dims.tp > 1 else ""), ranks,
                                   tuple(view.vendor_of(r) for r in ranks), backends["pp"], one_vendor)
    dp_positions = [(s, t) for s in range(dims.pp) for t in range(dims.stage_tp(s))]
    for (s, t), ranks in zip(dp_positions, layout.dp_groups()):
        base = f"dp.stage{s}" + (f".tp{t}" if dims.stage_tp(s) > 1 else "")
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
    tp_positions = [(s, d) for s in range(dims.pp) for d in range(dims.stage_dp(s))]
    for (s_idx, d), d_ranks in zip(tp_positions, layout.tp_groups()):
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
    text = format_rows(rows) + ("\nfallbacks:\n" + "\n".join(notes) if notes else "")
    if any(g.axis == PAIR for g in specs):
        text += ("\npp.b<s> rows: per-stage shapes; each pair of ranks of stages s and s+1 that share microbatch "
                 "rows and hidden columns sends its pieces over its own group")
    if any(g.backend == PER_HOP for g in specs):
        text += (f"\n{PER_HOP}: the pipeline's sends and receives go over the group of each pair of neighbouring "
                 "stages (its .hop rows), its collectives over its .collectives row")
    return text


def create_groups(specs: list[GroupSpec], timeout: timedelta, pg_options: dict[str, Any] | None = None
                  ) -> dict[str, dist.ProcessGroup | None]:
    """Create every group (collectively, same order on all ranks); name -> group, None where not a member.
    ``pg_options``: back-end -> the options its groups get (bimetal's transports: the interfaces named).

    A per-hop pipeline group comes with its parts (``pipeline_groups.create_pipeline_group``): its pairs (the
    second group of a native pair under ``<name>/reverse``), its collectives group, then itself."""
    groups: dict[str, dist.ProcessGroup | None] = {}
    for g in specs:
        if g.axis in (HOP, COLLECTIVES):
            continue  # made with their pipeline group
        if g.backend == PER_HOP:
            pairs, coll = pipeline_parts(specs, g)
            groups |= create_pipeline_group(
                g.name, g.ranks, [PairSpec(p.name, (p.ranks[0], p.ranks[1]), p.backend, p.kind == "cross-vendor")
                                  for p in pairs], coll.backend, coll.name, timeout, pg_options)
            continue
        pg = dist.new_group(list(g.ranks), backend=g.backend, timeout=timeout, group_desc=g.name,
                            pg_options=(pg_options or {}).get(g.backend))
        groups[g.name] = pg if dist.get_rank() in g.ranks else None
    return groups
