"""`bimetal plan`: rank layouts for a cluster spec; `bimetal profile` entry point."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import tomli_w

from bimetal.errors import UserError
from bimetal.plan import cost
from bimetal.plan.explain import breakdown, explain
from bimetal.plan.profile import profile_main  # noqa: F401  (bimetal profile entry)
from bimetal.plan.search import Plan, homogeneous, search
from bimetal.plan.spec import ClusterSpec, load_spec


def plan_to_train_config(p: Plan, spec: ClusterSpec | None = None) -> dict[str, object]:
    """The `bimetal train` config (bimetal.train.config keys) for a plan; ``spec`` becomes parallel.cluster.

    A pp = 1 plan on a cluster of several vendors has data-parallel groups that span vendors, so the
    config allows them (the hierarchical all-reduce); the FSDP shards stay inside an island.
    """
    m = cost.model_dims(p.model)
    parallel: dict[str, object] = {
        "pp": p.pp, "dp": p.dp, "tp": p.tp, "dp_shard": p.dp_shard, "layers_per_stage": p.layer_split,
        "schedule": "1f1b", "microbatches": p.microbatches, "pp_transport": p.transport}
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
    if argv[:1] == ["calibrate"]:
        from bimetal.plan.calibrate import main as calibrate_main
        return calibrate_main(argv[1:])
    ap = argparse.ArgumentParser(prog="bimetal plan", description=__doc__,
                                 epilog="`bimetal plan calibrate --lab LAB` compares predictions with the lab.")
    ap.add_argument("spec", help="cluster spec TOML (see configs/clusters/)")
    ap.add_argument("--model", default="llama3-8b", help=f"model flavour: {', '.join(cost.MODELS)}")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--write", metavar="PATH", help="write the best plan as a `bimetal train` config TOML")
    ap.add_argument("--write-titan", metavar="PATH",
                    help="write the best plan torchtitan runs as `bimetal titan --plan` overrides")
    ap.add_argument("--explain", action="store_true", help="step-time breakdown of the best plan")
    ap.add_argument("--allow-cross-vendor-dp", action="store_true",
                    help="--write may choose a plan whose data-parallel groups span vendors (pp=1 on a mixed "
                         "cluster; FSDP shards stay inside each island, replicas cross vendors); the config then "
                         "sets parallel.allow_cross_vendor_dp")
    a = ap.parse_args(argv)
    for flag, value in (("--seq", a.seq), ("--global-batch", a.global_batch), ("--top", a.top)):
        if value < 1:
            raise UserError(f"{flag} {value} must be a positive integer.")
    if a.model not in cost.MODELS:
        raise UserError(f"unknown model flavour {a.model!r}; pass --model one of {', '.join(cost.MODELS)}.")
    spec = load_spec(a.spec)
    ok, rejected = search(spec, a.model, a.seq, a.global_batch)
    if not ok:
        reasons = "; ".join(sorted({r.rejected for r in rejected})[:3]) or "no layout tiles the cluster"
        raise UserError(f"no feasible plan for {a.model} on {a.spec}: {reasons}; use more GPUs or a shorter --seq.")
    homog = {v: _best_tps(v, a.model, a.seq, a.global_batch, spec) for v in ("nvidia", "amd")}
    if a.json:
        out = {"plans": [asdict(p) | {"ratio_nvidia": p.tokens_per_s / homog["nvidia"] if homog["nvidia"] else None,
                                      "ratio_amd": p.tokens_per_s / homog["amd"] if homog["amd"] else None}
                         for p in ok[:a.top]],
               "rejected": [{"pp": p.pp, "dp": p.dp, "tp": p.tp, "dp_shard": p.dp_shard, "ac": p.ac,
                             "micro_batch": p.micro_batch, "reason": p.rejected}
                            for p in rejected],
               "homogeneous_tokens_per_s": homog, "best_breakdown": breakdown(ok[0])}
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
    if a.write:
        # The trainer runs every plan the search makes; a vendor-spanning dp group only when the user allows it.
        runnable = [p for p in ok if a.allow_cross_vendor_dp or not spans_vendors(p, spec)]
        if not runnable:
            raise UserError(f"every plan for {a.model} on {a.spec} has data-parallel groups across vendors; "
                            "pass --allow-cross-vendor-dp to write one.")
        Path(a.write).write_text(tomli_w.dumps(plan_to_train_config(runnable[0], spec)))
        if not a.json:
            print(f"best plan the trainer runs (#{ok.index(runnable[0]) + 1}) written to {a.write}; "
                  f"`bimetal train --config {a.write} --dry-run` checks its memory")
    if a.write_titan:
        _write_titan(a.write_titan, ok, spec, a.spec, quiet=a.json)
    return 0


def _write_titan(path: str, ok: list[Plan], spec: ClusterSpec, spec_path: str, quiet: bool) -> None:
    from bimetal.integrations.torchtitan.plan import runs_on_torchtitan, write_titan

    runnable = [p for p in ok if runs_on_torchtitan(p, len({g.vendor for g in spec.groups}))]
    if not runnable:
        raise UserError(f"no plan for {ok[0].model} on {spec_path} runs on torchtitan (a torchtitan model, pp>1 "
                        "across vendors); plan llama3-8b or use more GPUs.")
    write_titan(path, runnable[0], cost.model_dims(runnable[0].model).layers, spec_path)
    if not quiet:
        print(f"best plan torchtitan can run (#{ok.index(runnable[0]) + 1}) written to {path}")
