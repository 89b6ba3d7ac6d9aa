"""`bimetal plan` views: one given layout, the one-node homogeneous baselines, and the compatibility ladder.

The baselines are what users compare against: one node of one vendor alone, its best plan, in TFLOP/s per
GPU (the same per-GPU metric as the mixed cluster). The ladder prices, for a two-island cluster, one
layout (by default the best pp = 2 plan: one stage per vendor island, dp inside it) under five choices of
transports and NICs, each against the faster homogeneous node:

1. every group on stock Gloo, all over the node's first NIC (what an unmodified PyTorch job does);
2. native one-vendor groups, Gloo only on the cross-vendor pipeline groups, over one shared NIC;
3. the same with one NIC per GPU;
4. bimetal cpu-forward: chunk-pipelined staging, striped over every NIC;
5. device-direct (RDMA between GPU memories), one NIC per GPU.

Columns: TFLOP/s per GPU, its ratio to the faster one-node baseline, the step, the exposed communication
of the slowest stage per step (boundary transfers and FSDP all-gathers) and the data-parallel reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from bimetal.errors import UserError
from bimetal.plan import cost
from bimetal.plan.explain import breakdown
from bimetal.plan.hops import format_hops
from bimetal.plan.search import AC_MODES, Plan, evaluate, search, shard_degrees
from bimetal.plan.spec import ClusterSpec


@dataclass(frozen=True)
class Rung:
    """One ladder step: the transports and NIC use it prices."""

    label: str
    transport: str
    dp_transport: str
    homogeneous: str
    nics: str


RUNGS = (
    Rung("all groups on Gloo, 1 NIC", "gloo", "gloo", "gloo", "shared"),
    Rung("Gloo cross-vendor pp, 1 shared NIC", "gloo", "gloo", "native", "shared"),
    Rung("Gloo cross-vendor pp, NIC per GPU", "gloo", "gloo", "native", "per-gpu"),
    Rung("bimetal cpu-forward, striped", "cpu-forward", "cpu-forward", "native", "striped"),
    Rung("device-direct, NIC per GPU", "device-direct", "device-direct", "native", "per-gpu"),
)


def with_profiles(spec: ClusterSpec, profiles: list[str]) -> ClusterSpec:
    """Replace the efficiency of each vendor named as ``VENDOR=PROFILE.json`` by the profile's measured rate."""
    from bimetal.plan.profile import load_profile

    by_vendor: dict[str, float] = {}
    for item in profiles:
        vendor, sep, path = item.partition("=")
        if not sep or vendor not in {g.vendor for g in spec.groups}:
            raise UserError(f"--profile {item!r} must be VENDOR=FILE with a vendor of {spec.path} "
                            f"({', '.join(sorted({g.vendor for g in spec.groups}))}).")
        by_vendor[vendor] = load_profile(path, f"--profile {vendor}")
    groups = tuple(replace(g, peak_flops=by_vendor[g.vendor], efficiency=1.0) if g.vendor in by_vendor else g
                   for g in spec.groups)
    return replace(spec, groups=groups)


def baselines(spec: ClusterSpec, model: str, seq: int, global_batch: int) -> dict[str, Plan | None]:
    """Best plan of one node of each group's kind alone (count = 1), keyed by group name."""
    out: dict[str, Plan | None] = {}
    for g in spec.groups:
        ok, _ = search(ClusterSpec(spec.path, (replace(g, count=1),)), model, seq, global_batch)
        out[g.name] = ok[0] if ok else None
    return out


def best_of(spec: ClusterSpec, model: str, seq: int, global_batch: int, pp: int, dp: int, tp: int,
            rung: Rung, micro_batch: int | None = None, dp_shard: int | None = None, ac: str | None = None,
            split: list[int] | None = None) -> Plan | None:
    """The fastest feasible variant (micro-batch, FSDP degree, checkpointing) of one layout under a rung."""
    best = None
    for b in [micro_batch] if micro_batch else [1, 2, 4]:
        for shard in [dp_shard] if dp_shard else shard_degrees(spec, pp, dp, tp):
            for mode in [ac] if ac else AC_MODES:
                p = evaluate(spec, model, seq, global_batch, pp, dp, tp, b, rung.transport, split, shard, mode,
                             dp_transport=rung.dp_transport, homogeneous=rung.homogeneous, nics=rung.nics)
                if p is not None and not p.rejected and (best is None or p.tokens_per_s > best.tokens_per_s):
                    best = p
    return best


def _baseline_lines(base: dict[str, Plan | None]) -> tuple[list[str], float]:
    lines, top = [], 0.0
    for name, p in base.items():
        if p is None:
            lines.append(f"  one {name} node alone: no feasible plan")
            continue
        top = max(top, p.tflops_per_gpu)
        lines.append(f"  one {name} node alone: {p.tflops_per_gpu:6.0f} TFLOP/s per GPU "
                     f"(pp={p.pp} dp={p.dp} dp_shard={p.dp_shard} tp={p.tp} ac={p.ac} mb={p.micro_batch})")
    return lines, top


def ladder(spec: ClusterSpec, model: str, seq: int, global_batch: int, layout: tuple[int, int, int] | None) -> str:
    """The ladder table as text; a cluster that is not two vendor islands is refused."""
    vendors = {g.vendor for g in spec.groups}
    if len(vendors) != 2:
        raise UserError(f"--ladder needs a cluster of two vendor islands; {spec.path} has {len(vendors)} vendor(s).")
    pp, dp, tp = layout or (2, spec.total_gpus // 2, 1)
    lines, top = _baseline_lines(baselines(spec, model, seq, global_batch))
    out = [f"{model} seq={seq} global_batch={global_batch} on {spec.path}: pp={pp} dp={dp} tp={tp}, the best "
           "micro-batch / FSDP / checkpointing variant per rung", "homogeneous baselines:", *lines,
           f"{'rung':<38} {'TFLOP/s/GPU':>11} {'ratio':>6} {'step s':>7} {'exposed s':>9} {'dp s':>7}  variant"]
    for i, r in enumerate(RUNGS):
        p = best_of(spec, model, seq, global_batch, pp, dp, tp, r)
        if p is None:
            out.append(f"{i + 1}. {r.label:<35} no feasible plan")
            continue
        j = max(range(p.pp), key=lambda k: p.stage_compute[k] + p.stage_comm[k])
        ratio = f"{p.tflops_per_gpu / top:6.2f}" if top else "     -"
        out.append(f"{i + 1}. {r.label:<35} {p.tflops_per_gpu:11.0f} {ratio} {p.step_seconds:7.2f} "
                   f"{p.stage_comm[j] * p.microbatches:9.2f} {p.dp_allreduce:7.2f}  "
                   f"dp_shard={p.dp_shard} ac={p.ac} mb={p.micro_batch}")
    return "\n".join(out)


def show_plan(spec: ClusterSpec, p: Plan, global_batch: int) -> str:
    """One evaluated layout: its terms, TFLOP/s per GPU and the ratio to each one-node baseline."""
    lines, top = _baseline_lines(baselines(spec, p.model, p.seq, global_batch))
    out = [f"{p.model} seq={p.seq} on {spec.path}: pp={p.pp} dp={p.dp} dp_shard={p.dp_shard} tp={p.tp} "
           f"ac={p.ac} micro_batch={p.micro_batch} microbatches={p.microbatches} split={p.layer_split}",
           f"  transports: pp {p.transport}, dp {p.dp_transport}, one-vendor groups {p.homogeneous}, NICs {p.nics}"]
    out += [f"  {k:<48} {v * 1e3:10.1f} ms" for k, v in breakdown(p).items()]
    if p.hops:
        out += ["  pipeline hops, each on its own link:", *format_hops(p.hops, p.microbatches)]
    mem = ", ".join(f"{m / 1e9:.0f}" for m in p.memory)
    out.append(f"  memory per GPU by stage: {mem} GB" + (f"  REJECTED: {p.rejected}" if p.rejected else ""))
    ratio = f" ({p.tflops_per_gpu / top:.2f} x the faster one-node baseline)" if top else ""
    out.append(f"  {p.tokens_per_s:,.0f} tokens/s, {p.tflops_per_gpu:.0f} TFLOP/s per GPU{ratio}")
    return "\n".join(out + ["homogeneous baselines:"] + lines)


def layout_from_config(path: str) -> dict[str, Any]:
    """Layout fields of a `bimetal train` config TOML (planner names), for `bimetal plan --config`.

    The file is read and checked as `bimetal train` reads it (an unknown key is refused naming key and file).
    """
    from bimetal.config import load_config

    cfg = load_config(path)
    if cfg.per_stage:
        raise UserError(f"--config {path} has per-stage shapes, which --config does not price; run `bimetal plan "
                        "SPEC --per-stage --explain` for them.")
    m, par, d = cfg.model, cfg.parallel, cfg.data
    name = next((k for k, spec in cost.MODELS.items() if (spec.family, spec.flavour) == (m.family, m.flavour)), None)
    if name is None:
        raise UserError(f"--config {path}: model {m.family}/{m.flavour} has no planner "
                        f"flavour; the planner knows {', '.join(cost.MODELS)}.")
    return {"model": name, "seq": d.seq_len, "pp": par.pp, "dp": par.dp, "tp": par.tp, "dp_shard": par.dp_shard,
            "split": list(par.layers_per_stage) or None, "micro_batch": d.batch_size // par.microbatches,
            "global_batch": d.batch_size * par.dp, "transport": par.pp_transport, "dp_transport": par.dp_transport,
            "homogeneous": par.homogeneous_backend, "ac": cfg.activation_checkpoint.mode}
