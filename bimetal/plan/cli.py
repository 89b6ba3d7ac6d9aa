"""`bimetal plan`: rank layouts for a cluster spec, evaluate one layout (``--pp ...`` or ``--config``), or
price the compatibility ladder (``--ladder``)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

import tomli_w

from bimetal import transports
from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.outputs import check_file, write_text
from bimetal.plan import cost
from bimetal.plan.explain import breakdown, explain
from bimetal.plan.search import Plan, homogeneous, search
from bimetal.plan.shapes import ShapedPlan
from bimetal.plan.spec import ClusterSpec, load_spec


def plan_to_train_config(p: Plan, spec: ClusterSpec | None = None) -> dict[str, object]:
    """The `bimetal train` config (bimetal.config keys) for a plan; ``spec`` becomes parallel.cluster.

    A pp = 1 plan on a cluster of several vendors has data-parallel groups that span vendors, so the
    config allows them (the hierarchical all-reduce); the FSDP shards stay inside an island.
    """
    m = cost.model_dims(p.model)
    parallel: dict[str, object] = {
        "pp": p.pp, "dp": p.dp, "tp": p.tp, "dp_shard": p.dp_shard, "layers_per_stage": p.layer_split,
        "schedule": "1f1b", "microbatches": p.microbatches, "pp_transport": p.transport,
        "dp_transport": p.dp_transport or p.transport, "homogeneous_backend": p.homogeneous}
    if spec is not None:
        parallel["cluster"] = spec.path
        if spans_vendors(p, spec):
            parallel["allow_cross_vendor_dp"] = True
    return {"model": {"family": m.family, "flavour": m.flavour}, "parallel": parallel,
            "data": {"seq_len": p.seq, "batch_size": p.micro_batch * p.microbatches},
            "activation_checkpoint": {"mode": p.ac, "every": p.ac_every},
            "training": {"dtype": "bfloat16"}}  # what the planner sized the plan for


def spans_vendors(p: Plan, spec: ClusterSpec) -> bool:
    """Whether the plan's data-parallel groups cross vendors (pp = 1 on a cluster of several vendors)."""
    return p.pp == 1 and len({g.vendor for g in spec.groups}) > 1


def _best_tps(vendor: str, model: str, seq: int, gb: int, spec: ClusterSpec) -> float:
    h = homogeneous(spec, vendor)
    if h is None:
        return 0.0
    ok, _ = search(h, model, seq, gb)
    return ok[0].tokens_per_s if ok else 0.0


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="bimetal plan", description=__doc__,
                                 epilog="`bimetal plan calibrate --lab LAB` compares predictions with the lab; "
                                        "`bimetal plan fit SPEC --bench-comm JSON --out NEW` sets a spec's host-path "
                                        "constants from measurements.")
    ap.add_argument("spec", help="cluster spec TOML (see configs/clusters/)")
    ap.add_argument("--model", default="llama3-8b", help=f"model flavour: {', '.join(cost.MODELS)}")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 8192)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 256)")
    ap.add_argument("--top", type=int, default=None, help="plans listed (default 10)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--write", metavar="PATH", help="write the best plan as a `bimetal train` config TOML")
    ap.add_argument("--write-titan", metavar="PATH",
                    help="write the best plan torchtitan runs as `bimetal titan --plan` overrides")
    ap.add_argument("--explain", action="store_true",
                    help="step-time breakdown of the best plan, and why each island got its shape in the best "
                         "per-stage plan against the best uniform one")
    ap.add_argument("--per-stage", action="store_true",
                    help="also search per-stage shapes (each vendor island its own tp, dp, dp_shard and activation "
                         "checkpointing); --write then writes the best per-stage plan")
    ap.add_argument("--allow-cross-vendor-dp", action="store_true",
                    help="--write may choose a plan whose data-parallel groups span vendors (pp=1 on a mixed "
                         "cluster; FSDP shards stay inside each island, replicas cross vendors); the config then "
                         "sets parallel.allow_cross_vendor_dp")
    _layout_args(ap)
    a = ap.parse_args(argv)
    _check_options(a)
    for flag, value in (("--seq", a.seq), ("--global-batch", a.global_batch), ("--top", a.top), ("--pp", a.pp),
                        ("--dp", a.dp), ("--tp", a.tp), ("--dp-shard", a.dp_shard), ("--micro-batch", a.micro_batch)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be a positive integer.")
    written = [f"--{k.replace('_', '-')}" for k, default in _LAYOUT_DEFAULTS.items() if getattr(a, k) != default]
    if a.config or a.ladder:
        rung_keys = [w for w in written if w not in ("--pp", "--dp", "--tp")] if a.ladder else written
        if rung_keys:
            raise UserError(f"{rung_keys[0]} has no effect with --{'ladder' if a.ladder else 'config'}; drop it.")
    if a.config or a.pp or a.ladder:
        return _views(a)
    if written:
        raise UserError(f"{written[0]} describes one layout; add --pp (and --dp/--tp) to evaluate it, or drop it.")
    a.seq, a.global_batch, a.top = a.seq or 8192, a.global_batch or 256, a.top or 10
    if a.model not in cost.MODELS:
        raise UserError(f"unknown model flavour {a.model!r}; pass --model one of {', '.join(cost.MODELS)}.")
    spec = load_spec(a.spec)
    if a.profile:
        from bimetal.plan.views import with_profiles
        spec = with_profiles(spec, a.profile)
    ok, rejected = search(spec, a.model, a.seq, a.global_batch)
    if not ok:
        reasons = "; ".join(sorted({r.rejected for r in rejected})[:3]) or "no layout tiles the cluster"
        raise UserError(f"no feasible plan for {a.model} on {a.spec}: {reasons}; use more GPUs or a shorter --seq.")
    homog = {v: _best_tps(v, a.model, a.seq, a.global_batch, spec) for v in ("nvidia", "amd")}
    shaped, shaped_text, shaped_json = _per_stage(spec, a, ok[0]) if (a.per_stage or a.explain) else (None, "", {})
    if a.json:
        out: dict[str, object] = {
            "plans": [asdict(p) | {"ratio_nvidia": p.tokens_per_s / homog["nvidia"] if homog["nvidia"] else None,
                                      "ratio_amd": p.tokens_per_s / homog["amd"] if homog["amd"] else None}
                         for p in ok[:a.top]],
               "rejected": [{"pp": p.pp, "dp": p.dp, "tp": p.tp, "dp_shard": p.dp_shard, "ac": p.ac,
                             "micro_batch": p.micro_batch, "reason": p.rejected}
                            for p in rejected],
               "homogeneous_tokens_per_s": homog, "best_breakdown": breakdown(ok[0])}
        if a.per_stage:
            out["per_stage"] = shaped_json or None
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.model} seq={a.seq} global_batch={a.global_batch} on {a.spec} ({spec.total_gpus} GPUs)")
        print(f"{'#':>2} {'pp':>2} {'dp':>2} {'sh':>2} {'tp':>2} {'ac':<4} {'mb':>2} {'m':>4} {'transport':<13} "
              f"{'split':<24} "
              f"{'tok/s':>9} {'TF/GPU':>6} {'xNV':>5} {'xAMD':>5} {'mem GB/stage':<20} bottleneck")
        for i, p in enumerate(ok[:a.top]):
            rn = f"{p.tokens_per_s / homog['nvidia']:.2f}" if homog["nvidia"] else "-"
            ra = f"{p.tokens_per_s / homog['amd']:.2f}" if homog["amd"] else "-"
            mem = ",".join(f"{x / 1e9:.0f}" for x in p.memory)
            split = ",".join(map(str, p.layer_split))
            print(f"{i + 1:>2} {p.pp:>2} {p.dp:>2} {p.dp_shard:>2} {p.tp:>2} {p.ac[:4]:<4} {p.micro_batch:>2} "
                  f"{p.microbatches:>4} "
                  f"{p.transport:<13} {split[:24]:<24} {p.tokens_per_s:>9,.0f} {p.tflops_per_gpu:>6.0f} "
                  f"{rn:>5} {ra:>5} {mem[:20]:<20} {p.bottleneck}")
        print(f"{len(rejected)} plans rejected for memory, e.g.: {rejected[0].rejected}" if rejected else "")
        if a.explain:
            print(explain(ok[0], homog))
        if shaped_text:
            print(shaped_text)
    if a.write and a.per_stage:
        if shaped is None:
            raise UserError(f"no per-stage plan for {a.model} on {a.spec}: it needs two or more node groups (one "
                            "stage each) and a shape per island that fits; drop --per-stage to write a uniform plan.")
        from bimetal.plan.shapes import plan_to_config

        write_text(a.write, tomli_w.dumps(plan_to_config(shaped, spec)))
        if not a.json:
            print(f"best per-stage plan written to {a.write}; `bimetal train --config {a.write} --dry-run` checks "
                  "its memory")
    elif a.write:
        # The trainer runs every plan the search makes; a vendor-spanning dp group only when the user allows it.
        runnable = [p for p in ok if a.allow_cross_vendor_dp or not spans_vendors(p, spec)]
        if not runnable:
            raise UserError(f"every plan for {a.model} on {a.spec} has data-parallel groups across vendors; "
                            "pass --allow-cross-vendor-dp to write one.")
        write_text(a.write, tomli_w.dumps(plan_to_train_config(runnable[0], spec)))
        if not a.json:
            print(f"best plan the trainer runs (#{ok.index(runnable[0]) + 1}) written to {a.write}; "
                  f"`bimetal train --config {a.write} --dry-run` checks its memory")
    if a.write_titan:
        _write_titan(a.write_titan, ok, spec, a.spec, quiet=a.json)
    return 0


def _per_stage(spec: ClusterSpec, a: argparse.Namespace, uniform: Plan) -> tuple[ShapedPlan | None, str, dict]:
    """The per-stage search (``bimetal.plan.shapes``): its best plan, the text saying why each island got its
    shape against the best uniform plan, and the same as JSON."""
    from bimetal.plan.shapes import explain_shapes, search_shapes

    searched = search_shapes(spec, a.model, a.seq, a.global_batch)
    if not searched:
        return None, "per-stage shapes: none (the cluster is one node group, or an island has no shape that fits)", {}
    best = searched[0]
    equal = next(iter(search_shapes(spec, a.model, a.seq, a.global_batch, equal=True)), None)
    desc = f"pp={uniform.pp} dp={uniform.dp} dp_shard={uniform.dp_shard} tp={uniform.tp} ac={uniform.ac}"
    summary = {"step_seconds": best.step_seconds, "tokens_per_s": best.tokens_per_s, "rows": best.rows,
               "microbatches": best.microbatches, "transport": best.transport, "layer_split": best.layer_split,
               "stages": [{"group": s.group, "tp": s.tp, "dp": s.dp, "dp_shard": s.dp_shard, "ac": s.ac,
                           "micro_batch": s.micro_batch, "memory": s.memory} for s in best.stages],
               "equal_shapes_step_seconds": equal.step_seconds if equal else None,
               "uniform_step_seconds": uniform.step_seconds}
    return best, explain_shapes(best, equal, uniform.step_seconds, desc, searched), summary


def _check_options(a: argparse.Namespace) -> None:
    """Options that need another, and the files it will write, before any work (nothing is written on a refusal)."""
    if a.allow_cross_vendor_dp and not a.write:
        raise UserError("--allow-cross-vendor-dp lets --write choose a plan whose data-parallel groups span vendors; "
                        "add --write PATH or drop it.")
    if a.explain and a.json:
        raise UserError("--explain prints a table beside the text report; with --json the breakdown is its "
                        "'best_breakdown' field: drop one of them.")
    if (a.per_stage or a.explain) and (a.config or a.pp or a.ladder):  # options of the search, not of one layout
        which = "--config" if a.config else "--ladder" if a.ladder else f"--pp {a.pp}"
        flag, what = ("--per-stage", "searches each island's own shape") if a.per_stage else \
            ("--explain", "compares the search's best plans")
        raise UserError(f"{flag} {what}, but {which} fixes the layout to evaluate; drop {flag}, or drop {which} to "
                        "search.")
    if (a.json or a.top is not None) and (a.config or a.pp or a.ladder):
        which = "--json" if a.json else "--top"
        raise UserError(f"{which} shapes the report of a search; --config/--pp/--ladder print one layout's table, "
                        f"so drop {which} or them.")
    if (a.write or a.write_titan) and (a.config or a.pp or a.ladder):
        which = "--write" if a.write else "--write-titan"
        raise UserError(f"{which} writes the best plan of a search; drop --config/--pp/--ladder, or {which}.")
    if a.write and a.write_titan and os.path.abspath(a.write) == os.path.abspath(a.write_titan):
        raise UserError(f"--write and --write-titan name the same file {a.write!r}; give two paths.")
    if a.write:
        check_file("--write", a.write)
    if a.write_titan:
        check_file("--write-titan", a.write_titan)


def _write_titan(path: str, ok: list[Plan], spec: ClusterSpec, spec_path: str, quiet: bool) -> None:
    from bimetal.plan.titan import runs_on_torchtitan, write_titan

    runnable = [p for p in ok if runs_on_torchtitan(p, len({g.vendor for g in spec.groups}))]
    if not runnable:
        raise UserError(f"no plan for {ok[0].model} on {spec_path} runs on torchtitan (a torchtitan model, pp>1 "
                        "across vendors); plan llama3-8b or use more GPUs.")
    write_titan(path, runnable[0], cost.model_dims(runnable[0].model).layers, spec_path)
    if not quiet:
        print(f"best plan torchtitan can run (#{ok.index(runnable[0]) + 1}) written to {path}")


_LAYOUT_DEFAULTS: dict[str, object] = {
    "pp": None, "dp": None, "tp": 1, "dp_shard": 1, "ac": "none", "micro_batch": 1, "split": None,
    "transport": transports.DEFAULT, "dp_transport": None, "homogeneous": "native", "nics": "per-gpu"}


def _layout_args(ap: argparse.ArgumentParser) -> None:
    from bimetal.plan.hostpath import NIC_MODES
    from bimetal.plan.search import AC_MODES
    from bimetal.transports import DEFAULT, NAMES

    g = ap.add_argument_group("one layout (instead of the search)")
    g.add_argument("--pp", type=int, help="pipeline stages; evaluates this layout and prints the baselines")
    g.add_argument("--dp", type=int, default=None)
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--dp-shard", type=int, default=1)
    g.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing")
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--split", help="layers per stage, e.g. 17,15 (default: the balanced split)")
    g.add_argument("--transport", choices=NAMES, default=DEFAULT, help="cross-vendor pipeline groups")
    g.add_argument("--dp-transport", choices=NAMES, default=None,
                   help="cross-vendor parts of data-parallel groups (default: --transport)")
    g.add_argument("--homogeneous", choices=("native", "gloo"), default="native",
                   help="back-end of one-vendor groups (gloo: every group on Gloo)")
    g.add_argument("--nics", choices=NIC_MODES, default="per-gpu", help="NICs a boundary pair uses")
    g.add_argument("--config", metavar="TRAIN.toml", help="evaluate the layout of a `bimetal train` config")
    g.add_argument("--ladder", action="store_true",
                   help="price all-Gloo / Gloo pp on 1 NIC / Gloo pp NIC per GPU / cpu-forward / device-direct")
    g.add_argument("--profile", action="append", default=[], metavar="VENDOR=FILE",
                   help="per-vendor compute rate from a `bimetal profile` file (repeatable)")


def _views(a: argparse.Namespace) -> int:
    from bimetal.plan.search import evaluate
    from bimetal.plan.views import ladder, layout_from_config, show_plan, with_profiles

    spec = load_spec(a.spec)
    if a.profile:
        spec = with_profiles(spec, a.profile)
    if a.config and (a.pp or a.ladder or a.seq or a.global_batch):
        raise UserError("--config gives the layout, sequence length and batch; "
                        "drop --pp/--ladder/--seq/--global-batch.")
    if a.config:
        lay = layout_from_config(a.config)
    else:
        if a.model not in cost.MODELS:
            raise UserError(f"unknown model flavour {a.model!r}; pass --model one of {', '.join(cost.MODELS)}.")
        seq, gb = a.seq or 8192, a.global_batch or 256
        if a.ladder:
            layout = (a.pp, a.dp or spec.total_gpus // (a.pp * a.tp), a.tp) if a.pp else None
            print(ladder(spec, a.model, seq, gb, layout))
            return 0
        try:
            split = [int(x) for x in a.split.split(",")] if a.split else None
        except ValueError:
            raise UserError(f"--split {a.split!r} must be comma-separated layer counts, e.g. 17,15.") from None
        if a.dp is None and spec.total_gpus % (a.pp * a.tp):
            raise UserError(f"pp={a.pp} x tp={a.tp} does not divide the {spec.total_gpus} GPUs of {a.spec}; "
                            "pass --dp or other degrees.")
        dp = a.dp or spec.total_gpus // (a.pp * a.tp)
        lay = {"model": a.model, "seq": seq, "pp": a.pp, "dp": dp, "tp": a.tp, "dp_shard": a.dp_shard,
               "split": split, "micro_batch": a.micro_batch, "global_batch": gb, "transport": a.transport,
               "dp_transport": a.dp_transport or a.transport, "homogeneous": a.homogeneous, "ac": a.ac}
    m = cost.model_dims(lay["model"])
    split = lay["split"]
    where = f"{a.config}: " if a.config else ""  # a layout read from a file: the sentence names it
    if split and (len(split) != lay["pp"] or sum(split) != m.layers or min(split) < 1):
        raise UserError(f"{where}split {split} must give each of the {lay['pp']} stages at least one layer, "
                        f"{m.layers} in all for {lay['model']}.")
    if lay["global_batch"] % (lay["dp"] * lay["micro_batch"]):
        raise UserError(f"{where}global batch {lay['global_batch']} is not a multiple of dp x micro-batch "
                        f"({lay['dp']} x {lay['micro_batch']}).")
    if lay["pp"] * lay["dp"] * lay["tp"] == spec.total_gpus:  # the one layout check, as train and slurm run it
        from bimetal.parallel.layout import ParallelDims
        from bimetal.plan.layout_check import check_on_spec

        try:  # the planner prices data parallelism across vendors (pp=1 on a mixed cluster) too
            check_on_spec(ParallelDims(pp=lay["pp"], dp=lay["dp"], tp=lay["tp"], allow_cross_vendor_dp=True), spec)
        except UserError as exc:
            raise UserError(f"{where}{exc}") from None
    p = evaluate(spec, lay["model"], lay["seq"], lay["global_batch"], lay["pp"], lay["dp"], lay["tp"],
                 lay["micro_batch"], lay["transport"], split, lay["dp_shard"], lay["ac"],
                 dp_transport=lay["dp_transport"], homogeneous=lay["homogeneous"], nics=a.nics)
    if p is None:
        raise UserError(f"{where}pp={lay['pp']} x dp={lay['dp']} x tp={lay['tp']} does not tile {a.spec} "
                        f"({spec.total_gpus} GPUs, stages one vendor each, tp inside a node, dp_shard dividing dp).")
    print(show_plan(spec, p, lay["global_batch"]))
    return 0
