"""``parallel.layout = "auto"``: the layout picked for the world a job finds when it starts.

``pick_layout(cfg, world, keep)`` is the one pick: from a config made ready by ``bimetal.config.auto_layout`` and
the world (the vendor and node of every rank) to the config of one fixed layout, and the one line that says
why. It is pure: every rank computes it from the same agreed world, and the checks before ranks start compute
it from the world they can see (``--simulate``'s ranks, or the cluster spec of ``parallel.cluster``).
``agree_layout`` is what a rank runs: the world is the topology view the ranks exchanged as JSON over the store
(``bimetal.topology.exchange``), rank 0 publishes its pick as JSON and every rank checks its own against it.

The pick keeps the trajectory: the global batch and the rows per microbatch are the config's; a layout is a
candidate only if its replicas split the global batch into whole microbatches of those rows (at least one per
stage under 1F1B). Candidates are tried with tp from 1 up, then pp from 1 up (dp takes the rest of the world),
and the first one that passes the one layout check (``bimetal.parallel.layout.plan_layout``: stages of one
vendor unless ``parallel.allow_cross_vendor_dp``, tp inside a node and a vendor), the model (pp at most its layers,
tp dividing its heads and widths) and the kept keys is taken: the most data parallelism, so the fewest pipeline
bubbles and the least tensor-parallel traffic, with cross-vendor traffic left on the pipeline axis. With
``parallel.cluster`` the planner (``bimetal.plan.search.evaluate``) prices every layout that fits on the spec's node
groups cut to the world, each with the FSDP degrees ``bimetal plan`` tries (``search.shard_degrees``: none, the
whole dp group, one node's worth; unless ``parallel.dp_shard`` is kept) and its activation checkpointing modes
(unless ``activation_checkpoint.mode`` is written), refuses those over the device memory, and the fastest is
taken with its balanced split, shard degree and mode: neither changes the trajectory. Per-stage shapes (a tp, dp
or mode per stage) are not searched here: ``bimetal plan --shapes`` does, for a fixed layout to write down.
Without a spec no device numbers are guessed, and nothing is sharded or recomputed that the config did not say.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from bimetal.config import TrainConfig
from bimetal.errors import UserError
from bimetal.parallel.layout import LayoutError, ParallelDims, plan_layout
from bimetal.topology.records import ClusterView, RankRecord

PICK_KEY = "bimetal/layout_auto"
"""Store prefix under which rank 0 publishes its pick."""


@dataclass(frozen=True)
class World:
    """The ranks a job has: (node, vendor) of each global rank, in rank order."""

    ranks: tuple[tuple[str, str], ...]

    @classmethod
    def from_view(cls, view: ClusterView) -> World:
        """The world of the ranks' exchanged topology records."""
        return cls(tuple((r.host, r.vendor) for r in view.records))

    @classmethod
    def simulated(cls, vendors: list[str]) -> World:
        """``--simulate``'s ranks: one node, rank ``r`` playing ``vendors[r]``."""
        return cls(tuple(("localhost", v) for v in vendors))

    @classmethod
    def from_spec(cls, path: str) -> World:
        """One rank per GPU of a cluster spec, in the job's rank order (``bimetal.plan.layout_check``)."""
        from bimetal.plan.layout_check import spec_view
        from bimetal.plan.sbatch import islands
        from bimetal.plan.spec import load_spec

        return cls.from_view(spec_view(islands(load_spec(path))))

    def view(self) -> ClusterView:
        """The world as the layout check takes it (local ranks numbered per node in rank order)."""
        seen: dict[str, int] = {}
        records = []
        for rank, (host, vendor) in enumerate(self.ranks):
            records.append(RankRecord(rank, seen.get(host, 0), host, vendor, "cpu", 0))
            seen[host] = seen.get(host, 0) + 1
        return ClusterView(records)

    def describe(self) -> str:
        """``nvidia:2,amd:2 on 1 node`` (vendor counts in order of first rank)."""
        counts: dict[str, int] = {}
        for _, vendor in self.ranks:
            counts[vendor] = counts.get(vendor, 0) + 1
        nodes = len({host for host, _ in self.ranks})
        return f"{','.join(f'{v}:{n}' for v, n in counts.items())} on {nodes} node{'s' * (nodes > 1)}"


@dataclass(frozen=True)
class Pick:
    """The picked layout: the config that runs it and the sentence rank 0 logs."""

    cfg: TrainConfig
    line: str

    def keys(self) -> dict[str, Any]:
        """The picked values (what ranks compare)."""
        p, d = self.cfg.parallel, self.cfg.data
        return {"pp": p.pp, "dp": p.dp, "tp": p.tp, "dp_shard": p.dp_shard, "layers_per_stage": p.layers_per_stage,
                "microbatches": p.microbatches, "batch_size": d.batch_size, "ac": self.cfg.activation_checkpoint.mode}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _refusal(cfg: TrainConfig, pp: int, dp: int, tp: int, keep: frozenset[str], view: ClusterView,
             n_layers: int, rows: int) -> str | None:
    """Why (pp, dp, tp) cannot run ``cfg`` on ``view``; None when it can."""
    from bimetal.models.args import check_tp

    p = cfg.parallel
    if pp > n_layers:
        return f"pp={pp} stages are more than the model's {n_layers} layers"
    if "dp_shard" in keep and dp % p.dp_shard:
        return f"parallel.dp_shard={p.dp_shard} does not divide dp={dp}"
    if cfg.global_batch % (dp * rows):
        return (f"dp={dp} replicas cannot split the global batch of {cfg.global_batch} rows into microbatches of "
                f"{rows} rows")
    if p.schedule == "1f1b" and pp > 1 and cfg.global_batch // (dp * rows) < pp:
        return (f"pp={pp} x dp={dp} leaves {cfg.global_batch // (dp * rows)} microbatch(es) per replica, fewer than "
                "the stages 1F1B fills")
    try:
        check_tp(_model_args(cfg), tp, f"{cfg.model.family}/{cfg.model.flavour}")
        plan_layout(view, ParallelDims(pp=pp, dp=dp, tp=tp, allow_cross_vendor_dp=p.allow_cross_vendor_dp))
    except (LayoutError, UserError) as exc:
        return str(exc).rstrip(".")
    return None


def _model_args(cfg: TrainConfig) -> Any:
    from bimetal.models import flavour_args

    return flavour_args(cfg.model.family, cfg.model.flavour)


def pick_layout(cfg: TrainConfig, world: World, keep: frozenset[str] = frozenset()) -> Pick:
    """The layout of ``cfg`` (``parallel.layout = "auto"``, made ready by ``bimetal.config.auto_layout``; or any
    uniform config, whose layout is then replaced) for ``world``, keeping its global batch, its rows per
    microbatch and the layout keys ``keep`` as ``cfg`` holds them; ``UserError`` (one sentence naming the world
    and the first reason) when none fits. With ``parallel.cluster`` the planner prices the layouts that fit
    (``_pricing``) and the fastest is taken. Deterministic: the same inputs give the same pick on every rank."""
    p = cfg.parallel
    n = len(world.ranks)
    view = world.view()
    n_layers = _model_args(cfg).n_layers
    rows = cfg.stage_microbatch(0)
    reasons: list[str] = []
    fits: list[tuple[int, int, int]] = []
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if any(k in keep and getattr(p, k) != v for k, v in (("pp", pp), ("dp", dp), ("tp", tp))):
                continue
            why = _refusal(cfg, pp, dp, tp, keep, view, n_layers, rows)
            if why is not None:
                reasons.append(f"pp={pp} x dp={dp} x tp={tp}: {why}")
            else:
                fits.append((pp, dp, tp))
    priced = _pricing(cfg, world, keep, rows, fits, reasons) if fits and p.cluster else None
    if priced is not None:
        fits = [f for f in fits if f in priced]
    if not fits:
        kept = ", ".join(f"{_dotted(k)}={_kept_value(cfg, k)}" for k in sorted(keep))
        first = reasons[0] if reasons else f"no pp x dp x tp with {kept} makes {n} ranks"
        raise UserError(f"parallel.layout='auto' finds no layout for {world.describe()} ({n} ranks)"
                        f"{' keeping ' + kept if kept else ''}: {first}; change the kept keys or the world.")
    if priced is None:
        return _picked(cfg, world, keep, *fits[0], rows)
    best = max(fits, key=lambda f: priced[f].tokens)  # the first of equals: the candidates' order breaks ties
    price = priced[best]
    why = (f"the fastest of {len(fits)} that fit, {price.tokens:,.0f} tokens/s as the planner predicts on "
           f"{p.cluster}")
    return _picked(cfg, world, keep, *best, rows, split=price.split, why=why, shard=price.shard, ac=price.ac)


@dataclass(frozen=True)
class _Price:
    """The planner's best variant of one (pp, dp, tp): its tokens/s, stage split, FSDP degree and AC mode."""

    tokens: float
    split: list[int]
    shard: int
    ac: str


def _pricing(cfg: TrainConfig, world: World, keep: frozenset[str], rows: int, fits: list[tuple[int, int, int]],
             reasons: list[str]) -> dict[tuple[int, int, int], _Price] | None:
    """The planner's prediction of each layout that fits, at its fastest FSDP degree and activation checkpointing
    mode among those not kept (with its balanced stage split unless one is kept), on the node groups of
    ``parallel.cluster`` cut to the world (per vendor: its first group there, with the world's nodes and ranks per
    node); a layout over the device memory in every variant joins ``reasons`` (its least hungry variant's reason).
    None where the planner cannot price: a model it does not know, a vendor the spec lacks, or a vendor's nodes of
    unequal size."""
    from dataclasses import replace

    from bimetal.config import AUTO_AC
    from bimetal.plan import cost
    from bimetal.plan.search import AC_MODES, evaluate, shard_degrees
    from bimetal.plan.spec import ClusterSpec, load_spec

    p = cfg.parallel
    model = next((name for name, m in cost.MODELS.items()
                  if (m.family, m.flavour) == (cfg.model.family, cfg.model.flavour)), None)
    if model is None:
        return None
    spec = load_spec(p.cluster)
    groups = []
    for vendor in dict.fromkeys(v for _, v in world.ranks):
        per_node: dict[str, int] = {}
        for host, v in world.ranks:
            if v == vendor:
                per_node[host] = per_node.get(host, 0) + 1
        group = next((g for g in spec.groups if g.vendor == vendor), None)
        if group is None or len(set(per_node.values())) > 1:
            return None
        groups.append(replace(group, count=len(per_node), gpus_per_node=next(iter(per_node.values()))))
    cut = ClusterSpec(spec.path, tuple(groups))
    modes = [cfg.activation_checkpoint.mode] if AUTO_AC in keep else list(AC_MODES)
    out = {}
    for pp, dp, tp in fits:
        split = list(p.layers_per_stage) if "layers_per_stage" in keep else None
        shards = [p.dp_shard] if "dp_shard" in keep else [
            d for d in shard_degrees(cut, pp, dp, tp) if _shard_groups_fit(cfg, world, pp, dp, tp, d)]
        best, refused = None, None
        for shard in shards:  # in the planner's order: none first, so equals keep the plainest
            for ac in modes:
                plan = evaluate(cut, model, cfg.data.seq_len, cfg.global_batch, pp, dp, tp, rows, p.pp_transport,
                                split, shard, ac, bf16=cfg.training.dtype != "float32", dp_transport=p.dp_transport,
                                homogeneous=p.homogeneous_backend, boundary=p.pp_boundary_dtype)
                if plan is None:
                    continue
                if plan.rejected:
                    refused = refused or plan.rejected  # the first: no sharding, no recomputation
                elif best is None or plan.tokens_per_s > best.tokens:
                    best = _Price(plan.tokens_per_s, list(plan.layer_split), shard, ac)
        if best is not None:
            out[(pp, dp, tp)] = best
        elif refused is not None:
            tried = " and ".join(what for what, n in (("FSDP degree", len(shards)),
                                                      ("activation checkpointing mode", len(modes))) if n > 1)
            reasons.append(f"pp={pp} x dp={dp} x tp={tp}: {refused}{f', with every {tried} tried' if tried else ''}")
        else:
            reasons.append(f"pp={pp} x dp={dp} x tp={tp}: the planner cannot lay it out on {p.cluster}")
    return out


def _shard_groups_fit(cfg: TrainConfig, world: World, pp: int, dp: int, tp: int, shard: int) -> bool:
    """The FSDP groups of ``shard`` on the world's ranks stay inside vendor islands (the mesh's own check): the
    planner's node groups are in file order, the world's ranks need not be."""
    from bimetal.parallel.mesh import plan_dp_mesh_groups

    if shard == 1:
        return True
    view = world.view()
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, allow_cross_vendor_dp=cfg.parallel.allow_cross_vendor_dp)
    try:
        plan_dp_mesh_groups(view, plan_layout(view, dims), shard)
    except (LayoutError, UserError):
        return False
    return True


def _picked(cfg: TrainConfig, world: World, keep: frozenset[str], pp: int, dp: int, tp: int, rows: int,
            split: list[int] | None = None, why: str = "", shard: int | None = None, ac: str | None = None) -> Pick:
    p, gb = cfg.parallel, cfg.global_batch
    if "layers_per_stage" in keep or split is None:
        split = list(p.layers_per_stage) if "layers_per_stage" in keep else []
    if shard is None:
        shard = p.dp_shard if "dp_shard" in keep else 1
    parallel = dataclasses.replace(p, pp=pp, dp=dp, tp=tp, dp_shard=shard, layers_per_stage=split,
                                   microbatches=gb // (dp * rows), layout="fixed")
    data = dataclasses.replace(cfg.data, batch_size=gb // dp, global_batch_size=gb)
    mode = cfg.activation_checkpoint.mode if ac is None else ac
    picked = dataclasses.replace(cfg, parallel=parallel, data=data,
                                 activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode=mode))
    shown = picked.stage_split(_model_args(cfg).n_layers)
    vendors = {v for _, v in world.ranks}
    if not why and pp == 1:
        why = "one vendor: data parallel only" if len(vendors) == 1 else \
            "data parallel across vendors, as parallel.allow_cross_vendor_dp allows"
    elif not why:
        why = "the fewest pipeline stages whose stages are each one vendor"
    if keep:
        why += f", keeping {', '.join(_dotted(k) for k in sorted(keep))} as written"
    line = (f"bimetal train: parallel.layout='auto' on {world.describe()}: pp={pp} x dp={dp} x tp={tp}"
            f"{f' x dp_shard={parallel.dp_shard}' if parallel.dp_shard > 1 else ''}"
            f"{f', activation checkpointing {mode}' if mode != 'none' else ''}, layers per stage {shown}, "
            f"{parallel.microbatches} microbatch(es) of {rows} rows per replica, global batch {gb} kept ({why})")
    return Pick(picked, line)


def _kept_value(cfg: TrainConfig, key: str) -> Any:
    section, _, name = _dotted(key).partition(".")
    return getattr(getattr(cfg, section), name)


def _dotted(key: str) -> str:
    """A kept key as the user writes it (``AUTO_KEEPS`` are ``parallel``'s)."""
    return key if "." in key else f"parallel.{key}"


def agree_layout(cfg: TrainConfig, keep: frozenset[str], view: ClusterView, store: Any, rank: int,
                 timeout: timedelta) -> Pick:
    """This rank's pick for the ranks' exchanged ``view``, checked against rank 0's (published as JSON over the
    store); rank 0 logs the line. Ranks that disagree (another bimetal) stop, naming both picks."""
    from bimetal.topology import store_exchange

    pick = pick_layout(cfg, World.from_view(view), keep)
    mine = pick.keys()
    if rank == 0:
        store_exchange.publish(store, PICK_KEY, 0, mine)
        print(pick.line, flush=True)
    theirs: dict[str, Any] = store_exchange.gather(store, PICK_KEY, [0], timeout)[0]
    if theirs != json.loads(json.dumps(mine)):
        raise UserError(f"rank {rank} picked the layout {mine} for parallel.layout='auto' but rank 0 picked "
                        f"{theirs}; start every rank with the same bimetal and config.")
    return pick
