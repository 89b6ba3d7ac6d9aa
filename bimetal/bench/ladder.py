"""``bimetal bench ladder``: what each of bimetal's choices buys, measured on a 2-node lab.

The debug model trains for a fixed number of steps on two emulated nodes (2 ranks each, 2 NICs per node,
links slow enough that pipeline traffic is the bottleneck), pp=2 across the nodes, dp=2 inside each.
Tokens/s of each step is reported as a ratio to (a):

    (a) homogeneous baseline: both nodes "nvidia", every group on the native back-end, which (like NCCL)
        takes the NIC of its GPU: local rank i's traffic on NIC i;
    (b) nvidia + amd, all groups on Gloo, over NIC 0;
    (c) differentiated back-ends: cross-vendor pipeline on cpu-forward, dp native, all over NIC 0;
    (d) (c) with one NIC per rank (local rank i's pipeline traffic on NIC i);
    (e) device-direct pipeline (Mooncake over TCP), one NIC per rank.

Runs are interleaved (a b c d e, a b c d e, ...) so drift and noise from other load show as spread.
Writes ``ladder.json`` and ``ladder.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.lab.cgroup import RANK_ENV
from bimetal.lab.cluster import LabCluster
from bimetal.lab.spec import parse_spec
from bimetal.outputs import check_folder, scratch_run_folder

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: vendors of the two nodes, trainer overrides, and rank environment."""

    key: str
    label: str
    vendors: tuple[str, str]
    overrides: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


RUNGS = (
    Rung("a", "homogeneous, native", ("nvidia", "nvidia"), ()),
    Rung("b", "all Gloo, 1 NIC", ("nvidia", "amd"), ("--parallel.pp_transport=gloo", "--parallel.dp_transport=gloo")),
    Rung("c", "cpu-forward pp, 1 NIC", ("nvidia", "amd"), ("--parallel.pp_transport=cpu-forward",),
         {"BIMETAL_CF_IFACES": "eth0", "BIMETAL_CF_STRIPES": "1"}),
    Rung("d", "cpu-forward pp, NIC per rank", ("nvidia", "amd"), ("--parallel.pp_transport=cpu-forward",),
         {"BIMETAL_CF_STRIPES": "1"}),
    Rung("e", "device-direct pp, NIC per rank", ("nvidia", "amd"), ("--parallel.pp_transport=device-direct",),
         {RANK_ENV: json.dumps({"BIMETAL_DD_HOST": "{nic_addr}"}), "BIMETAL_DD_FALLBACK": "error"}),
)


def run_rung(rung: Rung, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    spec = parse_spec({"lab": {"name": f"ladder{rung.key}", "nics": 2, "rate_mbit": args.rate_mbit,
                               "latency_ms": args.latency_ms},
                       "node": [{"name": "n0", "vendor": rung.vendors[0], "ranks": 2},
                                {"name": "n1", "vendor": rung.vendors[1], "ranks": 2}]}, source="<ladder>")
    scratch_run_folder(run_dir)
    argv = ["-m", "bimetal.train", "--config", args.config, f"--training.steps={args.steps}",
            f"--metrics.run_dir={run_dir}", "--checkpoint.every=0", f"--metrics.log_every={args.steps}",
            "--parallel.pp=2", "--parallel.dp=2", *rung.overrides]
    t0 = time.monotonic()
    with LabCluster(spec) as lab:
        results = lab.run(argv, timeout=args.run_timeout, capture=True, extra_env=rung.env)
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    if any(r.returncode for r in results) or not summary_path.exists():
        tail = "\n".join(f"--- node {r.node} (exit {r.returncode}) ---\n{r.output[-2500:]}" for r in results)
        return {"ok": False, "wall_s": wall, "error": tail}
    summary = json.loads(summary_path.read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # The first steps pay for connection set-up and allocator warm-up: report the median of the rest.
    rates = [s["tokens_per_s"] for s in steps if s.get("step", 0) > args.warmup and s.get("tokens_per_s")]
    return {"ok": True, "wall_s": wall, "tokens_per_s": statistics.median(rates) if rates else None,
            "pp_transport": summary.get("pp_transport"), "xvendor_bytes": summary.get("xvendor_bytes"),
            "xvendor_comm_s": summary.get("xvendor_comm_s"), "loss_end": summary.get("loss_end")}


def report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = [r["tokens_per_s"] for r in runs if r["rung"] == "a" and r.get("tokens_per_s")]
    base_med = statistics.median(base) if base else None
    table: dict[str, Any] = {}
    for rung in RUNGS:
        vals = [r["tokens_per_s"] for r in runs if r["rung"] == rung.key and r.get("tokens_per_s")]
        ratios = [v / base_med for v in vals] if base_med else []
        table[rung.key] = {
            "label": rung.label, "runs": len([r for r in runs if r["rung"] == rung.key]), "ok": len(vals),
            "tokens_per_s_median": statistics.median(vals) if vals else None,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "pp_transport": sorted({str(r.get("pp_transport")) for r in runs if r["rung"] == rung.key and r["ok"]}),
        }
    return table


def plot(table: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, row in table.items() if row["ratio_median"] is not None]
    med = [table[k]["ratio_median"] for k in keys]
    err = [[m - table[k]["ratio_min"] for k, m in zip(keys, med)],
           [table[k]["ratio_max"] - m for k, m in zip(keys, med)]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([f"({k}) {table[k]['label']}" for k in keys], med, yerr=err, capsize=4, color="#4a7ab0")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("tokens/s vs (a)")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="bimetal bench ladder", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.toml", help="trainer config (pp/dp are forced to 2/2)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of tokens/s (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each rung, interleaved (default 2)")
    # 10 Mbit/s makes the pipeline's boundary traffic the bottleneck of the debug model on a 2-core machine
    # (at 40 the CPU already shares the limit, and the rungs' spreads overlap)
    p.add_argument("--rate-mbit", type=float, default=10, help="line rate of every NIC (default 10 Mbit/s)")
    p.add_argument("--latency-ms", type=float, default=0, help="one-way added latency of every NIC (default 0)")
    p.add_argument("--rungs", default="abcde", help="which rungs to run (default abcde)")
    p.add_argument("--run-timeout", type=float, default=180, help="seconds before one run is killed")
    p.add_argument("--out", default="runs/ladder", help="directory for ladder.json, ladder.png, run dirs")
    args = p.parse_args(argv)
    if not Path(args.config).exists():
        raise UserError(f"trainer config {args.config} does not exist; pass --config configs/demo.toml")
    if args.steps <= args.warmup:
        raise UserError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    check_folder("--out", args.out)
    rungs = [r for r in RUNGS if r.key in args.rungs]
    if "a" not in args.rungs:
        raise UserError("the ladder needs rung 'a' (the baseline every ratio divides by); keep it in --rungs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for rep in range(args.repeats):
        for rung in rungs:
            res = run_rung(rung, args, out / f"{rung.key}-{rep}")
            res.update({"rung": rung.key, "repeat": rep})
            runs.append(res)
            shown = f"{res['tokens_per_s']:.0f} tokens/s" if res.get("tokens_per_s") else "FAILED"
            print(f"[{time.monotonic() - t_start:5.0f} s] ({rung.key}) {rung.label:<32} rep {rep}: {shown} "
                  f"(pp over {res.get('pp_transport')}, {res['wall_s']:.0f} s)", flush=True)
            if not res["ok"]:
                _log.error("%s", res["error"][-1500:])
    table = report(runs)
    link = f"{args.rate_mbit:g} Mbit/s" + (f", {args.latency_ms:g} ms" if args.latency_ms else "")
    title = (f"debug LLaMA-3, pp=2 x dp=2 on 2 lab nodes, 2 NICs x {link}, "
             f"{args.steps} steps, {args.repeats} repeats")
    print(title)
    print(f"{'rung':<36} {'tokens/s':>9} {'ratio':>6} {'min':>6} {'max':>6} {'ok':>5}  pp transport")
    for key, row in table.items():
        if row["runs"] == 0:
            continue
        fmt = (lambda v: f"{v:6.2f}" if v is not None else "     -")  # noqa: E731
        tps = f"{row['tokens_per_s_median']:9.0f}" if row["tokens_per_s_median"] else "        -"
        print(f"({key}) {row['label']:<32} {tps} {fmt(row['ratio_median'])} {fmt(row['ratio_min'])} "
              f"{fmt(row['ratio_max'])} {row['ok']:>2}/{row['runs']}  {','.join(row['pp_transport'])}")
    (out / "ladder.json").write_text(json.dumps({"title": title, "args": vars(args), "table": table,
                                                  "runs": [{k: v for k, v in r.items() if k != "error"} | (
                                                      {"error_tail": r["error"][-800:]} if "error" in r else {})
                                                      for r in runs],
                                                  "wall_s": time.monotonic() - t_start}, indent=1))
    plot(table, out / "ladder.png", title)
    print(f"wrote {out / 'ladder.json'} and {out / 'ladder.png'} ({time.monotonic() - t_start:.0f} s)")
    return 0 if all(r["ok"] for r in runs) else 1
