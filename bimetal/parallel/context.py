"""``init_parallel``: from the torchrun environment to a ``ParallelContext`` holding every group.

Steps, the same on every rank: bind the rank's GPU (``topology.local_device``), initialise the world (Gloo for
CPU tensors; NCCL too on an all-one-vendor GPU cluster), exchange topology records over the store (versions
that disagree stop here), lay out (pp, dp, tp) - refused before any group is
created if impossible - then create the groups with their differentiated back-ends. Rank 0 prints the
group table as built (a device-direct group that fell back to cpu-forward is shown as such). No globals:
callers pass the context on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.registry import CPU_FORWARD, DEVICE_DIRECT
from bimetal.parallel.groups import GroupSpec, create_groups, format_group_table, plan_groups
from bimetal.parallel.job import Job
from bimetal.parallel.layout import Layout, ParallelDims, plan_layout
from bimetal.topology import store_exchange
from bimetal.topology.exchange import exchange_topology
from bimetal.topology.local_device import bind_rank_device
from bimetal.topology.records import ClusterView
from bimetal.topology.vendor import detect_vendor, is_simulated

DEFAULT_TIMEOUT = timedelta(seconds=300)


@dataclass
class HierarchicalGroups:
    """Groups for the hierarchical all-reduce of a data-parallel group that spans vendors."""

    island: dist.ProcessGroup | None
    """Native group of this rank's vendor inside its dp group."""
    cross: dist.ProcessGroup | None
    """Cross-vendor group of the ranks holding the same shard position in each island."""
    island_size: int
    num_islands: int


@dataclass
class ParallelContext:
    """Everything a trainer needs to know about where this rank sits and how it talks."""

    rank: int
    world_size: int
    vendor: str
    view: ClusterView
    layout: Layout
    group_specs: list[GroupSpec]
    groups: dict[str, dist.ProcessGroup | None]
    stage: int
    dp_rank: int
    tp_rank: int
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    hierarchical: HierarchicalGroups | None = None
    owns_world: bool = field(default=False, repr=False)
    fallbacks: dict[str, str] = field(default_factory=dict)
    """This rank's groups that were asked for device-direct and run on cpu-forward: name -> the reason."""
    pg_options: dict[str, Any] = field(default_factory=dict)
    """``pg_options`` per back-end for groups made later (the FSDP mesh): the interfaces the user named."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device (``local_device.bind_rank_device``), bound before the world was created."""
    job: Job | None = None
    """The agent's job this rank belongs to (``bimetal.parallel.job``), where the world was made here under an
    agent (torchrun's, or bimetal's launcher)."""

    @property
    def num_stages(self) -> int:
        return self.layout.dims.pp

    @property
    def pp_rank(self) -> int:
        return self.stage

    @property
    def pp_size(self) -> int:
        return self.layout.dims.pp

    @property
    def dp_size(self) -> int:
        """Replicas of this rank's stage (its own with per-stage shapes)."""
        return self.layout.dims.stage_dp(self.stage)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree of this rank's stage."""
        return self.layout.dims.stage_tp(self.stage)

    @property
    def shaped(self) -> bool:
        """Stages of their own shapes: the stages are joined by boundary pairs, not pipeline groups."""
        return self.layout.dims.shaped

    @property
    def dp_spans_vendors(self) -> bool:
        return self.layout.stage_vendors[self.stage] == "mixed"

    @property
    def group_table(self) -> list[GroupSpec]:
        return self.group_specs

    def spec(self, name: str) -> GroupSpec:
        return next(g for g in self.group_specs if g.name == name)

    def built_backend(self, name: str) -> str:
        """The back-end group ``name`` (one of this rank's) runs on: the planned one, or cpu-forward after a
        device-direct fallback."""
        return CPU_FORWARD if name in self.fallbacks else self.spec(name).backend

    def my_group_name(self, axis: str) -> str | None:
        """Name of the group on ``axis`` that holds this rank, if any."""
        for g in self.group_specs:
            if g.axis == axis and self.rank in g.ranks:
                return g.name
        return None

    def destroy(self) -> None:
        """Destroy this context's groups (and the world, if ``init_parallel`` created it)."""
        if not dist.is_initialized():
            return
        for pg in self.groups.values():
            if pg is not None:
                dist.destroy_process_group(pg)
        self.groups.clear()
        if self.owns_world:
            dist.destroy_process_group()


def _world_backend(vendor: str) -> str:
    # A world that may span vendors can only be Gloo; CUDA tensors go through the explicit groups.
    if is_simulated() or vendor == "cpu":
        return "gloo"
    return "cpu:gloo"


def _init_world(backend: str, timeout: timedelta) -> Job | None:
    """``init_process_group`` for this round of the agent's job; returns the job (None outside an agent).

    Where the agent shares its store with the ranks (torch 2.13's default under ``--standalone`` and c10d
    rendezvous; bimetal's launcher), every round of a job gets the same store, which still holds the Gloo addresses
    of the rounds that died; a plain ``init_process_group`` then connects to dead ports and times out. Each round
    takes a prefix of its own there (``Job.round_prefix``: not the restart count, which a node joining later does
    not share). Where it does not (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), rank 0 hosts a new store each round.
    """
    job = Job.connect(timeout)
    if job is None or job.store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return job
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(job.round_prefix(rank, world, timeout), job.store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return job


def transport_options(interfaces: Sequence[str] | None) -> dict[str, Any]:
    """``pg_options`` per bimetal transport that carry the interfaces the config names (none: env, default)."""
    if not interfaces:
        return {}
    from bimetal.comm.device_direct.options import DeviceDirectOptions
    from bimetal.comm.striping import CpuForwardOptions

    return {CPU_FORWARD: CpuForwardOptions(allowed_interfaces=list(interfaces)),
            DEVICE_DIRECT: DeviceDirectOptions(allowed_interfaces=list(interfaces))}


def _table_stripes() -> tuple[int, list[str]]:
    """Stripes per cpu-forward group and the interfaces named per stripe, for the cluster view's 'uses' column."""
    from bimetal.comm.striping import CpuForwardOptions

    opts = CpuForwardOptions().resolved()
    return opts.stripes, list(opts.interfaces)


def init_parallel(
    dims: ParallelDims | Callable[[ClusterView, Any], ParallelDims],
    transports: dict[str, str] | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    print_table: bool = True,
    interfaces: Sequence[str] | None = None,
) -> ParallelContext:
    """Bind this rank's GPU, initialise the world from the torchrun environment and build every group of the
    layout. ``interfaces``: the config's ``parallel.interfaces`` (None: ``BIMETAL_IFACES``, else the default).
    ``dims`` may be a function of the exchanged view and the store: the layout picked for the world the ranks
    found (``parallel.layout = "auto"``), called on every rank once the view is agreed."""
    device = bind_rank_device()
    owns_world = not dist.is_initialized()
    rank = int(os.environ.get("RANK", "0")) if owns_world else dist.get_rank()
    vendor = detect_vendor(rank)
    job = _init_world(_world_backend(vendor), timeout) if owns_world else None
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    view = exchange_topology(store, rank, world, timeout, interfaces=interfaces)
    if callable(dims):
        dims = dims(view, store)
    layout = plan_layout(view, dims)
    specs = plan_groups(view, layout, transports, simulated=is_simulated())
    if print_table and rank == 0:
        stripes, named = _table_stripes()
        print("bimetal cluster view:\n" + view.format_table(stripes, named), flush=True)
    pg_options = transport_options(interfaces)
    groups = create_groups(specs, timeout, pg_options)
    # the table shows the groups as built: a device-direct group that fell back to cpu-forward says so
    fallbacks = {g.name: str(getattr(groups[g.name], "fallback_reason", "")) for g in specs
                 if groups.get(g.name) is not None and getattr(groups[g.name], "fallback_reason", None)}
    for g in specs:
        if g.ranks[0] == rank:
            store_exchange.publish(store, "bimetal/built", g.name, {"fallback": fallbacks.get(g.name, "")})
    if print_table and rank == 0:
        records: list[dict[str, str]] = store_exchange.gather(store, "bimetal/built", [g.name for g in specs])
        built = {g.name: str(r["fallback"]) for g, r in zip(specs, records)}
        shapes = "".join(f"\n  {line}" for line in layout.shape_lines()) if dims.shaped else ""
        print(f"bimetal groups ({dims.describe()}):{shapes}\n" + format_group_table(specs, built), flush=True)
    stage, dp_rank, tp_rank = layout.coords(rank)
    ctx = ParallelContext(
        rank=rank, world_size=world, vendor=vendor, view=view, layout=layout, group_specs=specs,
        groups=groups, stage=stage, dp_rank=dp_rank, tp_rank=tp_rank, owns_world=owns_world, fallbacks=fallbacks,
        pg_options=pg_options, device=device, job=job,
    )
    for axis in ("pp", "dp", "tp"):
        name = ctx.my_group_name(axis)
        setattr(ctx, f"{axis}_group", groups[name] if name else None)
    island, cross = ctx.my_group_name("dp.island"), ctx.my_group_name("dp.cross")
    if cross:  # an island of one rank has no island group: the cross group is the whole exchange
        ctx.hierarchical = HierarchicalGroups(
            island=groups[island] if island else None, cross=groups[cross],
            island_size=len(ctx.spec(island).ranks) if island else 1, num_islands=len(ctx.spec(cross).ranks),
        )
    return ctx
