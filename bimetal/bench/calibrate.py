"""`bimetal plan calibrate`: the lab as a planner cluster, predicted step times against measured ones.

The lab's ranks are the pipeline stages (dp = 1, stage j on global rank j, nodes in spec order); the
prediction is ``bimetal.plan.stagesplit``'s, from the local CPU's profile, each rank's CPU share and the lab
links. Nothing is fitted to lab measurements.

The planner's split is the contiguous split with the least predicted step time. Both it and the even
split are then trained on the lab, interleaved and repeated; the table compares medians.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.lab.spec import LabSpec, load_spec
from bimetal.outputs import check_folder, scratch_run_folder
from bimetal.plan import cost
from bimetal.plan.stagesplit import Rank, best_split, even_split, predict


def lab_ranks(lab: LabSpec) -> list[Rank]:
    """Every rank of the lab in global-rank order (an unset CPU share is a whole core)."""
    return [Rank(n.name, n.vendor, s if s is not None else 1.0, n.nics, n.rate_mbit, n.latency_ms)
            for n in lab.nodes for s in (n.cpu_share or (None,) * n.ranks)]


def measure(lab_path: str, lab_id: str, config: str, overrides: list[str], split: list[int], steps: int,
            warmup: int, run_dir: Path, timeout: float) -> dict[str, Any]:
    """Train ``split`` on a fresh lab; the median step time of the steps after ``warmup``."""
    from bimetal.lab.cluster import LabCluster

    lab = load_spec(lab_path, lab_id)
    scratch_run_folder(run_dir)
    argv = ["-m", "bimetal.train", "--config", config, *overrides, f"--parallel.pp={len(split)}", "--parallel.dp=1",
            f"--parallel.layers_per_stage=[{','.join(map(str, split))}]", f"--training.steps={steps}",
            "--checkpoint.every=0", f"--metrics.run_dir={run_dir}", f"--metrics.log_every={steps}",
            "--parallel.pp_transport=cpu-forward"]
    # Name the NICs: a one-NIC node's default Gloo device would otherwise bind to loopback.
    env = {"BIMETAL_CF_IFACES": ",".join(f"eth{k}" for k in range(lab.max_nics))}
    with LabCluster(lab) as running:
        results = running.run(argv, timeout=timeout, capture=True, extra_env=env)
    metrics = run_dir / "metrics.jsonl"
    if any(r.returncode for r in results) or not metrics.exists():
        tail = "\n".join(f"--- node {r.node} (exit {r.returncode}) ---\n{r.output[-1500:]}" for r in results)
        raise UserError(f"the lab run of split {split} failed; its output ends:\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_s"] for r in rows if r["step"] > warmup]
    return {"split": split, "step_s_median": statistics.median(times), "step_s": times}


def _overrides(seq: int, micro_batch: int, microbatches: int) -> list[str]:
    return [f"--data.seq_len={seq}", f"--data.batch_size={micro_batch * microbatches}",
            f"--parallel.microbatches={microbatches}"]


def calibrate(lab_path: str, profile: dict[str, Any], microbatches: int, steps: int, warmup: int, repeats: int,
              config: str, out: Path, lab_id: str | None = None, timeout: float = 180) -> dict[str, Any]:
    """Predict even and best split, measure both on the lab (interleaved), return the report dict."""
    lab = load_spec(lab_path, lab_id)
    ranks = lab_ranks(lab)
    if len(ranks) < 2:
        raise UserError(f"{lab_path}: the lab has {len(ranks)} rank; calibration needs pp >= 2, so two ranks.")
    m = cost.model_dims(profile["model"])
    even = predict(profile, ranks, even_split(m.layers, len(ranks)), microbatches)
    best = best_split(profile, ranks, m.layers, microbatches)
    rows = {"even": even, "planner": best}
    overrides = _overrides(int(profile["seq"]), int(profile["micro_batch"]), microbatches)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in rows}
    for rep in range(repeats):
        for key, pred in rows.items():
            r = measure(lab_path, lab.lab_id, config, overrides, pred.split, steps, warmup,
                        out / f"{key}-{rep}", timeout)
            runs[key].append(r)
            print(f"  {key:<8} split {pred.split} rep {rep}: {r['step_s_median'] * 1e3:.0f} ms/step", flush=True)
    table = []
    for key, pred in rows.items():
        measured = statistics.median(r["step_s_median"] for r in runs[key])
        table.append({"split_kind": key, "split": pred.split, "predicted_s": pred.step_s, "measured_s": measured,
                      "error_pct": (pred.step_s - measured) / measured * 100,
                      "measured_runs_s": [r["step_s_median"] for r in runs[key]], "prediction": asdict(pred)})
    ratio = table[1]["measured_s"] / table[0]["measured_s"]
    return {"lab": lab_path, "model": profile["model"], "seq": profile["seq"], "micro_batch": profile["micro_batch"],
            "microbatches": microbatches, "steps": steps, "warmup": warmup, "repeats": repeats,
            "ranks": [asdict(r) for r in ranks], "profile": profile, "table": table,
            "measured_ratio_planner_over_even": ratio,
            "predicted_ratio_planner_over_even": table[1]["predicted_s"] / table[0]["predicted_s"]}


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"{rep['model']} pp={len(rep['ranks'])} dp=1 on {rep['lab']}: mb {rep['micro_batch']} x seq {rep['seq']}, "
             f"{rep['microbatches']} microbatches (1F1B), cpu-forward; median of {rep['repeats']} runs x "
             f"{rep['steps'] - rep['warmup']} steps",
             "ranks: " + ", ".join(f"{r['node']}/{r['vendor']} share {r['share']:g}" for r in rep["ranks"]),
             f"{'split':<16} {'layers':<10} {'predicted ms':>12} {'measured ms':>12} {'error':>8}"]
    for row in rep["table"]:
        lines.append(f"{row['split_kind']:<16} {','.join(map(str, row['split'])):<10} "
                     f"{row['predicted_s'] * 1e3:>12.1f} {row['measured_s'] * 1e3:>12.1f} {row['error_pct']:>+7.1f}%")
    lines.append(f"measured planner/even step time: {rep['measured_ratio_planner_over_even']:.3f} "
                 f"(predicted {rep['predicted_ratio_planner_over_even']:.3f}); speed-up "
                 f"{1 / rep['measured_ratio_planner_over_even']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="bimetal plan calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--lab", required=True, help="lab spec TOML (see configs/lab/calib.toml)")
    ap.add_argument("--profile", help="profile JSON from `bimetal profile` (default: profile the local CPU now)")
    ap.add_argument("--model", default="debug", help="model flavour when profiling now")
    ap.add_argument("--seq", type=int, default=512, help="sequence length when profiling now")
    ap.add_argument("--micro-batch", type=int, default=2, help="microbatch size when profiling now")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="training steps per lab run")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    ap.add_argument("--repeats", type=int, default=3, help="runs per split, interleaved")
    ap.add_argument("--config", default="configs/demo.toml", help="trainer config the runs start from")
    ap.add_argument("--id", help="lab id (default: lab.name of the spec)")
    ap.add_argument("--out", help="folder for run dirs and calibrate.json (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    if a.steps <= a.warmup or a.repeats < 1 or a.microbatches < 1:
        raise UserError(f"need --steps > --warmup, --repeats >= 1 and --microbatches >= 1 "
                        f"(got {a.steps}, {a.warmup}, {a.repeats}, {a.microbatches}).")
    if a.out:
        check_folder("--out", a.out)
    if not Path(a.config).is_file():
        raise UserError(f"trainer config {a.config} not found; pass --config configs/demo.toml.")
    load_spec(a.lab, a.id)  # a bad spec fails before the profile runs
    from bimetal.lab.net import require_root
    require_root()
    from bimetal.plan.profile import profile as run_profile
    from bimetal.plan.profile import read_profile
    prof = read_profile(a.profile) if a.profile else run_profile(a.model, a.seq, a.micro_batch, repeats=10)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bimetal-calibrate-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rep = calibrate(a.lab, prof, a.microbatches, a.steps, a.warmup, a.repeats, a.config, out, a.id)
    rep["wall_s"] = time.monotonic() - t0
    (out / "calibrate.json").write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep, indent=1) if a.json else format_report(rep) + f"\nwrote {out / 'calibrate.json'}")
    return 0


if __name__ == "__main__":
    import sys

    from bimetal.entry import run_command

    sys.exit(run_command("plan", main, sys.argv[1:]))
