"""Layout: which global rank holds which (pipeline stage, data-parallel replica, tensor-parallel shard).

Pure data and pure Python: built from a ``ClusterView`` and ``ParallelDims`` with no process group, so it
can be tested on any cluster shape. Rules:

* a tensor-parallel group never leaves a node or a vendor;
* pipeline stages are vendor-homogeneous wherever island sizes allow it, so cross-vendor traffic lands on
  the pipeline axis (small, point-to-point);
* a stage that must mix vendors makes its data-parallel groups span vendors - allowed only when the user
  says so (they then use the hierarchical all-reduce), and never in strict mode;
* per-stage shapes (``tp_per_stage``, ``dp_per_stage``): each stage has its own (tp, dp), the world size is the
  sum over stages, and every stage must be one vendor (its shape must fit the island it lands on). The mesh
  is then ragged: ``mesh[s]`` has ``dp_s`` replicas of ``tp_s`` ranks; neighbouring stages are joined by the
  boundary pairs of ``bimetal.parallel.boundary`` instead of one pipeline group per (replica, shard).

An impossible request is refused before any group exists, with one sentence that names the numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from bimetal.config import TrainConfig
from bimetal.errors import UserError
from bimetal.topology.records import ClusterView


class LayoutError(UserError):
    """The requested degrees cannot be laid out on this cluster."""


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees and layout policy."""

    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    dp: int = 1
    """Data-parallel degree (replicas of each stage)."""
    tp: int = 1
    """Tensor-parallel degree (shards inside a node)."""
    allow_cross_vendor_dp: bool = False
    """Allow data-parallel groups that span vendors (hierarchical all-reduce)."""
    strict: bool = False
    """Refuse any layout whose stages are not vendor-homogeneous."""
    tp_per_stage: tuple[int, ...] = ()
    """Tensor-parallel degree of each stage; empty: ``tp`` everywhere."""
    dp_per_stage: tuple[int, ...] = ()
    """Data-parallel degree of each stage; empty: ``dp`` everywhere."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.strict and self.allow_cross_vendor_dp:
            raise LayoutError("strict mode and allow_cross_vendor_dp contradict each other; choose one")
        for name in ("tp_per_stage", "dp_per_stage"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            if values and len(values) != self.pp:
                raise LayoutError(f"{name}={list(values)} has {len(values)} entries for pp={self.pp} stages; give one "
                                  "per stage")
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise LayoutError(f"{name}={list(values)} must hold positive integers")
        if self.shaped and self.allow_cross_vendor_dp:
            raise LayoutError("per-stage shapes keep each stage in one vendor island; drop allow_cross_vendor_dp")

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> ParallelDims:
        """The dims of a training config: per-stage lists where its stages differ in tp or dp (only dp_shard
        differing keeps the uniform layout: FSDP is per stage inside it)."""
        p = cfg.parallel
        shapes = cfg.stage_shapes()
        tps, dps = tuple(t for t, _, _ in shapes), tuple(d for _, d, _ in shapes)
        if len(set(tps)) == 1 and len(set(dps)) == 1:
            return cls(pp=p.pp, dp=dps[0], tp=tps[0], allow_cross_vendor_dp=p.allow_cross_vendor_dp)
        return cls(pp=p.pp, dp=p.dp, tp=p.tp, allow_cross_vendor_dp=p.allow_cross_vendor_dp, tp_per_stage=tps,
                   dp_per_stage=dps)

    @property
    def shaped(self) -> bool:
        """Whether stages have their own shapes (the mesh may be ragged)."""
        return bool(self.tp_per_stage or self.dp_per_stage)

    def stage_tp(self, s: int) -> int:
        return self.tp_per_stage[s] if self.tp_per_stage else self.tp

    def stage_dp(self, s: int) -> int:
        return self.dp_per_stage[s] if self.dp_per_stage else self.dp

    @property
    def world_size(self) -> int:
        return sum(self.stage_dp(s) * self.stage_tp(s) for s in range(self.pp))

    def describe(self) -> str:
        if self.shaped:
            shapes = " + ".join(f"(dp={self.stage_dp(s)} x tp={self.stage_tp(s)})" for s in range(self.pp))
            return f"pp={self.pp}: {shapes} = {self.world_size}"
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} = {self.world_size}"


def _islands(view: ClusterView) -> list[tuple[str, list[int]]]:
    """Ranks grouped by vendor (in order of first appearance), each ordered by host then local rank."""
    host_order = {h: i for i, h in enumerate(view.hosts)}
    islands = []
    for vendor in view.vendors:
        ranks = [r.rank for r in view.records if r.vendor == vendor]
        ranks.sort(key=lambda r: (host_order[view.host_of(r)], view[r].local_rank))
        islands.append((vendor, ranks))
    return islands


def _island_summary(islands: list[tuple[str, list[int]]]) -> str:
    return ", ".join(f"{v}:{len(rs)}" for v, rs in islands)


@dataclass(frozen=True)
class Layout:
    """``mesh[stage][replica][shard]`` = global rank, plus what the layout implies."""

    dims: ParallelDims
    mesh: tuple[tuple[tuple[int, ...], ...], ...]
    stage_vendors: tuple[str, ...]
    """Vendor of each stage, or ``"mixed"``."""

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, shard) of a global rank."""
        for s, stage in enumerate(self.mesh):
            for d, replica in enumerate(stage):
                if rank in replica:
                    return s, d, replica.index(rank)
        raise KeyError(f"rank {rank} is not in the layout")

    def pp_groups(self) -> list[tuple[int, ...]]:
        """One pipeline group per (replica, shard): the same position in every stage (none when shaped: the
        stages are joined by ``boundary.boundary_pairs``)."""
        if self.dims.shaped:
            return []
        return [
            tuple(self.mesh[s][d][t] for s in range(self.dims.pp))
            for d in range(self.dims.dp)
            for t in range(self.dims.tp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """One data-parallel group per (stage, shard)."""
        return [
            tuple(self.mesh[s][d][t] for d in range(self.dims.stage_dp(s)))
            for s in range(self.dims.pp)
            for t in range(self.dims.stage_tp(s))
        ]

    def tp_groups(self) -> list[tuple[int, ...]]:
        """One tensor-parallel group per (stage, replica)."""
        return [self.mesh[s][d] for s in range(self.dims.pp) for d in range(self.dims.stage_dp(s))]

    def stage_ranks(self, s: int) -> list[int]:
        return [r for replica in self.mesh[s] for r in replica]

    def shape_lines(self) -> list[str]:
        """One line per stage: its vendor, shape and ranks (``bimetal topo``, the group table's header)."""
        d = self.dims
        return [f"stage {s}: {self.stage_vendors[s]} dp={d.stage_dp(s)} x tp={d.stage_tp(s)} ranks "
                f"{self.stage_ranks(s)}" for s in range(d.pp)]

    @property
    def dp_spans_vendors(self) -> bool:
        return "mixed" in self.stage_vendors

    def to_dict(self) -> dict:
        return {"dims": asdict(self.dims), "mesh": [[list(r) for r in s] for s in self.mesh],
                "stage_vendors": list(self.stage_vendors)}


def plan_layout(view: ClusterView, dims: ParallelDims) -> Layout:
    """Assign ranks to (stage, replica, shard); raises ``LayoutError`` naming the numbers if impossible."""
    world = view.world_size
    if dims.world_size != world:
        raise LayoutError(f"{dims.describe()} does not match the world size {world}")
    islands = _islands(view)
    if dims.shaped:
        return _plan_shaped(view, dims, islands)
    stage_size = dims.dp * dims.tp

    if dims.tp > 1:
        for vendor, ranks in islands:
            per_host = Counter(view.host_of(r) for r in ranks)
            bad = {h: n for h, n in per_host.items() if n % dims.tp}
            if bad:
                host, n = next(iter(bad.items()))
                raise LayoutError(
                    f"tp={dims.tp} does not divide the {n} {vendor} ranks on host {host!r}; "
                    "a tensor-parallel group must stay inside one node and one vendor"
                )

    homogeneous = all(len(ranks) % stage_size == 0 for _, ranks in islands)
    if not homogeneous:
        summary = _island_summary(islands)
        if dims.strict:
            raise LayoutError(
                f"strict mode: {dims.pp} stages of dp*tp = {stage_size} ranks cannot each be one vendor on "
                f"a cluster of {summary}; every vendor's rank count must be a multiple of {stage_size}"
            )
        if not dims.allow_cross_vendor_dp:
            raise LayoutError(
                f"{dims.describe()} needs stages that mix vendors on a cluster of {summary} (stage size "
                f"{stage_size}), so data-parallel groups would span vendors; allow it with "
                "allow_cross_vendor_dp (hierarchical all-reduce) or choose degrees whose dp*tp divides "
                "every vendor's rank count"
            )

    ordered = [r for _, ranks in islands for r in ranks]
    mesh = []
    stage_vendors = []
    for s in range(dims.pp):
        block = ordered[s * stage_size:(s + 1) * stage_size]
        replicas = tuple(tuple(block[d * dims.tp:(d + 1) * dims.tp]) for d in range(dims.dp))
        for shard in replicas:
            hosts = {view.host_of(r) for r in shard}
            vendors = {view.vendor_of(r) for r in shard}
            if len(hosts) > 1 or len(vendors) > 1:
                raise LayoutError(
                    f"tensor-parallel group of ranks {list(shard)} would cross "
                    f"{'nodes' if len(hosts) > 1 else 'vendors'} ({', '.join(sorted(hosts | vendors))}); "
                    f"choose tp that divides the ranks per node and per vendor"
                )
        vendors = {view.vendor_of(r) for r in block}
        stage_vendors.append(vendors.pop() if len(vendors) == 1 else "mixed")
        mesh.append(replicas)
    return Layout(dims=dims, mesh=tuple(mesh), stage_vendors=tuple(stage_vendors))


def _plan_shaped(view: ClusterView, dims: ParallelDims, islands: list[tuple[str, list[int]]]) -> Layout:
    """Per-stage shapes: stages take the islands' ranks in order, each stage inside one vendor island and each
    tp group inside one node; the refusal names the stage and the key."""
    ordered = [r for _, ranks in islands for r in ranks]
    mesh, stage_vendors, at = [], [], 0
    for s in range(dims.pp):
        tp, dp = dims.stage_tp(s), dims.stage_dp(s)
        block = ordered[at:at + tp * dp]
        at += tp * dp
        vendors = sorted({view.vendor_of(r) for r in block})
        if len(vendors) > 1:
            raise LayoutError(
                f"stage {s} (parallel.dp_per_stage[{s}]={dp} x parallel.tp_per_stage[{s}]={tp}) would take ranks "
                f"{block} of "
                f"{' and '.join(vendors)} on a cluster of {_island_summary(islands)}; each stage's shape must fit "
                "the vendor island it lands on, so change the stage shapes to add up island by island")
        replicas = tuple(tuple(block[d * tp:(d + 1) * tp]) for d in range(dp))
        for shard in replicas:
            hosts = sorted({view.host_of(r) for r in shard})
            if len(hosts) > 1:
                raise LayoutError(
                    f"stage {s}: parallel.tp_per_stage[{s}]={tp} puts ranks {list(shard)} on hosts "
                    f"{', '.join(hosts)}; a "
                    "tensor-parallel group must stay inside one node, so choose a tp that divides the GPUs per node")
        mesh.append(replicas)
        stage_vendors.append(vendors[0])
    return Layout(dims=dims, mesh=tuple(mesh), stage_vendors=tuple(stage_vendors))
