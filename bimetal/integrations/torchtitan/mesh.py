"""Which back-end carries each torchtitan mesh dimension: bimetal's group classification applied to a mesh.

torchtitan builds one "world" mesh and unflattens it into named dimensions (``pp``, ``batch``, ``dp_shard``,
``tp``, ...). Every dimension's groups are classified as bimetal classifies its own (``parallel.groups``):

* all groups of the dimension vendor-homogeneous -> the native back-end (``nccl``; ``bimetal_sim_native``
  under simulation, which refuses mixed vendors as NCCL/RCCL would);
* ``pp`` groups that span vendors -> per hop (``parallel.groups.plan_pipeline``): each pair of ranks holding
  consecutive stages gets the back-end of its own kind, native inside a vendor and the cross-vendor transport
  chosen (cpu-forward or device-direct) across, including the wrap-around of a looped schedule (its last virtual
  stage sends back to the first rank); a pipeline whose pairs all get one back-end stays one plain group;
* any other dimension that spans vendors -> refused before training, with one sentence.

Pure Python: the same functions check a layout in the launcher (no process group) and choose back-ends
inside the ranks while torchtitan creates its groups (``_torch_hooks``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from bimetal.errors import UserError
from bimetal.parallel.groups import GroupSpec, classify, format_group_table, native_backend, plan_pipeline
from bimetal.transports import BIMETAL, DEFAULT, PER_HOP, TRANSPORTS

CROSS_VENDOR_DIMS = ("pp",)
"""Mesh dimensions that may span vendors (on a bimetal transport); every other one must not."""


class MixedVendorDimensionError(UserError):
    """A mesh dimension other than pp would put ranks of two vendors in one native group."""


def unflatten_groups(sizes: tuple[int, ...], names: tuple[str, ...]) -> dict[str, list[tuple[int, ...]]]:
    """Groups of every dimension when ranks ``0..prod(sizes)-1`` are unflattened row-major into ``sizes``."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    out: dict[str, list[tuple[int, ...]]] = {}
    for d, name in enumerate(names):
        others = [range(s) for i, s in enumerate(sizes) if i != d]
        groups = []
        for idx in itertools.product(*others):
            base = sum(j * strides[i] for i, j in zip([i for i in range(len(sizes)) if i != d], idx))
            groups.append(tuple(base + k * strides[d] for k in range(sizes[d])))
        out[name] = groups
    return out


@dataclass
class MeshBackends:
    """Chooses the back-end of each mesh dimension and remembers the groups made, for the table."""

    vendors: list[str]
    """Vendor of every global rank."""
    pp_transport: str = DEFAULT
    """Transport of pp groups that span vendors: ``cpu-forward`` or ``device-direct``."""
    simulated: bool = True
    all_gloo: bool = False
    """Reference run: every dimension on plain Gloo, no vendor rules (simulation only)."""
    stage_owners: list[int] | None = None
    """pp position of each (virtual) stage (``plan.titan_split.part_ranks``); None: one stage per pp rank."""
    timeout_s: float = 300.0
    """Timeout of the per-hop pipeline groups bimetal creates itself (``pipelines``)."""
    made: list[GroupSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.pp_transport not in BIMETAL:
            raise UserError(f"pp transport {self.pp_transport!r} is unknown; use cpu-forward or device-direct")

    def choose(self, dim: str, groups: list[tuple[int, ...]]) -> str:
        """The back-end for all groups of ``dim``; ``MixedVendorDimensionError`` if it cannot be native."""
        if self.all_gloo:
            return "gloo"
        kinds = {classify(tuple(self.vendors[r] for r in g)) for g in groups}
        if "cross-vendor" not in kinds:
            return native_backend(self.vendors[groups[0][0]], self.simulated)
        if dim in CROSS_VENDOR_DIMS:
            return TRANSPORTS[self.pp_transport].backend
        bad = next(g for g in groups if classify(tuple(self.vendors[r] for r in g)) == "cross-vendor")
        mix = ", ".join(f"{r}:{self.vendors[r]}" for r in bad)
        raise MixedVendorDimensionError(
            f"torchtitan mesh dimension {dim!r} would put ranks of different vendors ({mix}) in one group on the "
            f"native back-end, which NCCL/RCCL cannot form; put the vendor boundary on pp (make "
            f"parallelism.pipeline_parallel_degree a multiple of the vendor count, with every vendor holding "
            f"whole stages)"
        )

    def pipelines(self, groups: list[tuple[int, ...]]) -> list[GroupSpec]:
        """The specs of every pp group (in order; ``parallel.groups.plan_pipeline``): per hop where its pairs need
        different back-ends, else one plain group each."""
        if self.all_gloo:
            return []
        cross = TRANSPORTS[self.pp_transport].backend
        specs: list[GroupSpec] = []
        for i, g in enumerate(groups):
            vendors = tuple(self.vendors[r] for r in g)
            specs += plan_pipeline(f"pp.{i}" if len(groups) > 1 else "pp", g, vendors, cross,
                                   lambda v: native_backend(v, self.simulated), self.stage_owners)
        return specs

    def per_hop(self, groups: list[tuple[int, ...]]) -> list[GroupSpec]:
        """``pipelines(groups)`` when one of them is per hop (bimetal then creates the pp groups), else []."""
        specs = self.pipelines(groups)
        return specs if any(s.backend == PER_HOP for s in specs) else []

    def record_specs(self, specs: list[GroupSpec]) -> None:
        self.made += [s for s in specs if s not in self.made]

    def record(self, dim: str, groups: list[tuple[int, ...]], backend: str) -> None:
        for i, g in enumerate(groups):
            if len(g) < 2:
                continue  # a group of one rank carries no traffic; the table lists real groups only
            name = f"{dim}.{i}" if len(groups) > 1 else dim
            spec = GroupSpec(name, dim, g, tuple(self.vendors[r] for r in g),
                             classify(tuple(self.vendors[r] for r in g)), backend)
            if spec not in self.made:
                self.made.append(spec)

    def table(self) -> str:
        return format_group_table(self.made)


def dense_degrees(degrees: dict[str, int], world: int) -> dict[str, int]:
    """torchtitan's degrees with ``dp_shard=-1`` resolved (it takes the ranks the others leave)."""
    out = dict(degrees)
    if out.get("dp_shard", 1) < 0:
        rest = out.get("dp_replicate", 1) * out.get("cp", 1) * out.get("tp", 1) * out.get("pp", 1)
        out["dp_shard"] = max(world // rest, 1)
    return out


def preflight(degrees: dict[str, int], vendors: list[str], pp_transport: str, simulated: bool,
              stage_owners: list[int] | None = None) -> MeshBackends:
    """Check torchtitan's dense mesh on these vendors before any rank starts (raises ``UserError``).

    Covers the dimensions torchtitan 0.3.0 unflattens for dense models (``pp, batch, cp, tp`` and
    ``pp, dp_replicate, dp_shard, cp, tp``); the same rules run again on the real groups inside the ranks.
    """
    d = dense_degrees(degrees, len(vendors))
    product = d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"]
    if product != len(vendors):
        raise UserError(
            f"pp={d['pp']} x dp_replicate={d['dp_replicate']} x dp_shard={d['dp_shard']} x cp={d['cp']} x "
            f"tp={d['tp']} = {product} does not match the {len(vendors)} ranks of the cluster"
        )
    mb = MeshBackends(vendors, pp_transport, simulated, stage_owners=stage_owners)
    meshes = [
        (("pp", "batch", "cp", "tp"), (d["pp"], d["dp_replicate"] * d["dp_shard"], d["cp"], d["tp"])),
        (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (d["pp"], d["dp_replicate"], d["dp_shard"], d["cp"], d["tp"])),
    ]
    for names, sizes in meshes:
        for name, groups in unflatten_groups(sizes, names).items():
            if len(groups[0]) > 1:
                per_hop = mb.per_hop(groups) if name == "pp" else []
                if per_hop:
                    mb.record_specs(per_hop)
                else:
                    mb.record(name, groups, mb.choose(name, groups))
    return mb
