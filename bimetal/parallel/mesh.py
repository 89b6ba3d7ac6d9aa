"""The stage-local DeviceMesh: this rank's data-parallel ranks as ``(dp_replicate, dp_shard)``.

Sharded data parallel (FSDP2) works inside one pipeline stage: the stage's ``dp`` replicas are split into
``dp / dp_shard`` replica groups of ``dp_shard`` ranks each. Ranks ``d = r * dp_shard + i`` (``i`` < dp_shard)
form shard group ``r``; ranks with the same ``i`` form replicate group ``i``. Because the layout orders a
stage's replicas island by island, a shard group is a run of neighbouring ranks: inside one vendor island
whenever ``dp_shard`` divides each island's share of the dp group, and that is required - a shard group's
all-gather and reduce-scatter run on the vendor's native library. Replicate groups (HSDP's gradient
all-reduce) may cross vendors when the dp group does; they then take the dp transport (the hierarchical path:
reduce-scatter in the island, all-reduce of the shard across islands).

Every group is classified and given its back-end exactly as ``groups.plan_groups`` does (the spec list is
plain data, testable without a process group), created collectively by every rank, and assembled with
``DeviceMesh.from_group`` so each mesh dimension keeps its own back-end. A tensor-parallel dimension is
appended last (torchtitan's order: replicate, shard, tp), from ``ParallelContext.tp_group``: FSDP shards over
the dp dimensions of the same mesh whose tp dimension tensor parallelism splits over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bimetal.errors import UserError
from bimetal.parallel.groups import GroupSpec, classify, create_groups, native_backend, resolve_transports
from bimetal.parallel.layout import Layout
from bimetal.topology.records import ClusterView

SHARD, REPLICATE = "dp.shard", "dp.replicate"


def dp_mesh_ranks(layout: Layout, stage: int, tp_rank: int, dp_shard: int) -> list[list[int]]:
    """Global ranks of one stage's dp mesh as ``[replica group][shard position]``."""
    dp = layout.dims.stage_dp(stage)
    ranks = [layout.mesh[stage][d][tp_rank] for d in range(dp)]
    return [ranks[r * dp_shard:(r + 1) * dp_shard] for r in range(dp // dp_shard)]


def _per_stage(layout: Layout, dp_shard: int | Sequence[int]) -> list[int]:
    """The shard degree of every stage (one number for all, or one per stage: ``parallel.dp_shard_per_stage``)."""
    return [dp_shard] * layout.dims.pp if isinstance(dp_shard, int) else list(dp_shard)


def plan_dp_mesh_groups(view: ClusterView, layout: Layout, dp_shard: int | Sequence[int],
                        transports: dict[str, str] | None = None, simulated: bool = True) -> list[GroupSpec]:
    """Shard and replicate groups of every stage (size > 1), in the order every rank creates them.
    ``dp_shard``: one degree for every stage, or one per stage.

    Raises ``UserError`` if ``dp_shard`` does not divide ``dp`` or a shard group would mix vendors.
    """
    dims = layout.dims
    shards = _per_stage(layout, dp_shard)
    for s, n in enumerate(shards):
        if n < 1 or dims.stage_dp(s) % n:
            key = "parallel.dp_shard" if isinstance(dp_shard, int) else f"stage {s}: parallel.dp_shard_per_stage[{s}]"
            raise UserError(f"{key}={n} must be at least 1 and divide the stage's dp={dims.stage_dp(s)}.")
    cross = resolve_transports(transports)["dp"]
    specs: list[GroupSpec] = []

    def add(name: str, axis: str, ranks: list[int]) -> None:
        vendors = tuple(view.vendor_of(r) for r in ranks)
        kind = classify(vendors)
        if axis == SHARD and kind == "cross-vendor":
            raise UserError(
                f"parallel.dp_shard={dp_shard} would put ranks {ranks} of vendors {', '.join(dict.fromkeys(vendors))} "
                "in one shard group; a shard group stays inside one vendor island, so choose a dp_shard that "
                "divides each vendor's share of the data-parallel group.")
        backend = cross if kind == "cross-vendor" else native_backend(vendors[0], simulated)
        specs.append(GroupSpec(name, axis, tuple(ranks), vendors, kind, backend))

    for s in range(dims.pp):
        dp_shard = shards[s]
        for t in range(dims.stage_tp(s)):
            grid = dp_mesh_ranks(layout, s, t, dp_shard)
            suffix = f".tp{t}" if dims.stage_tp(s) > 1 else ""
            if dp_shard > 1:
                for r, row in enumerate(grid):
                    add(f"dp.stage{s}{suffix}.shard{r}", SHARD, row)
            if len(grid) > 1 and dp_shard > 1:
                for i in range(dp_shard):
                    add(f"dp.stage{s}{suffix}.replicate{i}", REPLICATE, [row[i] for row in grid])
    return specs


@dataclass
class StageMesh:
    """This rank's stage-local mesh for FSDP2, and where it sits in it."""

    mesh: DeviceMesh | None
    """None where this rank's stage does not shard (``parallel.dp_shard_per_stage``); else
    ``("dp_shard",)``, ``("dp_replicate", "dp_shard")`` (HSDP), each with a trailing ``"tp"`` when tp > 1."""
    specs: list[GroupSpec]
    """Every group created for the meshes of all stages (for the group table and ``destroy``)."""
    groups: dict[str, dist.ProcessGroup | None]
    """This mesh's groups by name (None where this rank is not a member)."""
    created: list[str]
    """Names of the groups created here (the others belong to the ``ParallelContext``)."""
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    shard_rank: int
    replicate_rank: int
    replicate_spans_vendors: bool

    @property
    def sharding(self) -> bool:
        """Whether this rank's stage shards (else the groups are only held to be destroyed)."""
        return self.mesh is not None

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
        assert self.mesh is not None
        names = [n for n in ("dp_replicate", "dp_shard") if n in (self.mesh.mesh_dim_names or ())]
        return self.mesh if list(self.mesh.mesh_dim_names or ()) == names else self.mesh[tuple(names)]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel dimension of the same mesh, or None at tp=1."""
        if self.mesh is None:
            return None
        return self.mesh["tp"] if "tp" in (self.mesh.mesh_dim_names or ()) else None

    @property
    def dp_shard(self) -> int:
        return self.shard_group.size() if self.shard_group is not None else 1

    @property
    def dp_replicate(self) -> int:
        return self.replicate_group.size() if self.replicate_group is not None else 1

    def destroy(self) -> None:
        for name in self.created:
            pg = self.groups.pop(name, None)
            if pg is not None:
                dist.destroy_process_group(pg)


def build_stage_mesh(ctx: object, dp_shard: int | Sequence[int], device_type: str,
                     transports: dict[str, str] | None = None, timeout: timedelta = timedelta(seconds=300)
                     ) -> StageMesh:
    """Create the shard/replicate groups of every stage (collective: all ranks call it) and this rank's mesh.

    ``ctx`` is the ``ParallelContext``; ``dp_shard``: one degree for all stages (> 1: sharding over one rank is
    plain replication) or one per stage (a rank whose stage does not shard gets a mesh of None).
    """
    from bimetal.parallel.context import ParallelContext
    from bimetal.topology.vendor import is_simulated

    assert isinstance(ctx, ParallelContext)
    specs = plan_dp_mesh_groups(ctx.view, ctx.layout, dp_shard, transports, simulated=is_simulated())
    dp_shard = _per_stage(ctx.layout, dp_shard)[ctx.stage]
    # A shard group equal to a group the context already has (dp_shard = dp: the dp group) is that group.
    existing = {(g.ranks, g.backend): g.name for g in ctx.group_specs}
    specs = [replace(s, name=existing.get((s.ranks, s.backend), s.name)) for s in specs]
    reused = {s.name: ctx.groups[s.name] for s in specs if s.name in ctx.groups}
    groups = {**create_groups([s for s in specs if s.name not in reused], timeout, getattr(ctx, "pg_options", None)),
              **reused}
    if dp_shard == 1:
        return StageMesh(mesh=None, specs=specs, groups=groups,
                         created=[s.name for s in specs if s.name not in reused], shard_group=None,
                         replicate_group=None, shard_rank=0, replicate_rank=0, replicate_spans_vendors=False)
    grid = dp_mesh_ranks(ctx.layout, ctx.stage, ctx.tp_rank, dp_shard)
    row = next(r for r, members in enumerate(grid) if ctx.rank in members)
    pos = grid[row].index(ctx.rank)

    def mine(axis: str) -> tuple[GroupSpec | None, dist.ProcessGroup | None]:
        spec = next((g for g in specs if g.axis == axis and ctx.rank in g.ranks), None)
        return spec, groups[spec.name] if spec else None

    _, shard_pg = mine(SHARD)
    rep_spec, rep_pg = mine(REPLICATE)
    assert shard_pg is not None
    # One mesh over the stage replica's ranks, dims (dp_replicate,) dp_shard (, tp): FSDP and TP DTensors
    # must share a root mesh to compose. Each dimension is an existing group with its own back-end.
    dims = ([("dp_replicate", rep_pg)] if rep_pg is not None else []) + [("dp_shard", shard_pg)]
    tp = ctx.tp_size
    if tp > 1:
        assert ctx.tp_group is not None
        dims.append(("tp", ctx.tp_group))
    if len(dims) == 1:
        mesh = DeviceMesh.from_group(shard_pg, device_type, mesh_dim_names=("dp_shard",))
    else:
        ranks = [[[ctx.layout.mesh[ctx.stage][r * dp_shard + i][t] for t in range(tp)] for i in range(dp_shard)]
                 for r in range(len(grid))]
        shape = [len(grid)] * (rep_pg is not None) + [dp_shard] + [tp] * (tp > 1)
        mesh = DeviceMesh.from_group([g for _, g in dims], device_type,
                                     mesh=torch.tensor(ranks, dtype=torch.int).reshape(shape),
                                     mesh_dim_names=tuple(name for name, _ in dims))
    return StageMesh(mesh=mesh, specs=specs, groups=groups, created=[s.name for s in specs if s.name not in reused],
                     shard_group=shard_pg, replicate_group=rep_pg,
                     shard_rank=pos, replicate_rank=row,
                     replicate_spans_vendors=rep_spec is not None and rep_spec.kind == "cross-vendor")
