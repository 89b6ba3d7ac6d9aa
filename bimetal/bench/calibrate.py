"""`bimetal plan calibrate`: the lab as a planner cluster, predicted step times against measured ones.

The lab's ranks are the pipeline stages (dp = 1, stage j on global rank j, nodes in spec order). Each
stage's cost comes only from measured inputs: the local CPU's per-part profile (``bimetal profile``:
block, embedding, head with its loss, AdamW update; forward and backward apart), divided by the rank's
CPU share; boundary transfers are cpu-forward (staging memcpy at the profiled bandwidth on both sides,
the lab link rate and latency between nodes, loopback inside a node); the 1F1B replay
(``bimetal.plan.schedule``) gives the pipeline time, and the slowest stage's optimizer update follows
(every rank waits for it at the next step's first exchange). Nothing is fitted to lab measurements.

The planner's split is the contiguous split with the least predicted step time. Both it and the even
split are then trained on the lab, interleaved and repeated; the table compares medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
from bimetal.lab.spec import LabSpec, load_spec
from bimetal.plan import cost
from bimetal.plan.schedule import StageTimes, one_f_one_b
from bimetal.plan.spec import ClusterSpec, NodeGroup

CHUNK_BYTES = 4 * 2**20
"""cpu-forward's default chunk: a message smaller than one chunk rides one NIC whatever the stripe count."""


@dataclass(frozen=True)
class Rank:
    """One lab rank as a pipeline stage: where it sits and how fast its CPU share lets it run."""

    node: str
    vendor: str
    share: float
    nics: int
    rate_mbit: float
    latency_ms: float


@dataclass
class Prediction:
    """Predicted step of one layer split, with the terms it is made of."""

    split: list[int]
    step_s: float
    pipeline_s: float
    optim_s: float
    stage_fwd_s: list[float] = field(default_factory=list)
    stage_bwd_s: list[float] = field(default_factory=list)
    boundary_s: list[float] = field(default_factory=list)
    """One transfer (activation or its gradient) across boundary j -> j+1."""


def lab_ranks(lab: LabSpec) -> list[Rank]:
    """Every rank of the lab in global-rank order (an unset CPU share is a whole core)."""
    return [Rank(n.name, n.vendor, s if s is not None else 1.0, n.nics, n.rate_mbit, n.latency_ms)
            for n in lab.nodes for s in (n.cpu_share or (None,) * n.ranks)]


def lab_cluster(lab: LabSpec, profile: dict[str, Any], host_memory_gb: float = 16.0) -> ClusterSpec:
    """The lab as a planner cluster spec: one group per node, the CPU profile as device, share as efficiency."""
    groups = []
    for n in lab.nodes:
        shares = {s if s is not None else 1.0 for s in n.cpu_share}
        if len(shares) > 1:
            raise UserError(f"{lab.source}: node {n.name!r} has different cpu_share per rank; the planner's node "
                            "groups are identical ranks, so give the node one cpu_share.")
        groups.append(NodeGroup(
            name=n.name, count=1, vendor=n.vendor, gpu="cpu", gpus_per_node=n.ranks,
            peak_flops=float(profile["achieved_flops"]), memory_bytes=int(host_memory_gb * 1e9),
            efficiency=shares.pop(), nics_per_node=n.nics, nic_gbps=n.rate_mbit / 1000,
            h2d_gbps=float(profile["copy_gbps"]), intra_gbps=float(profile["copy_gbps"]), gpudirect=False))
    return ClusterSpec(lab.source, tuple(groups))


def transfer_s(profile: dict[str, Any], a: Rank, b: Rank, nbytes: float) -> float:
    """One cpu-forward message a -> b: staging copy on each side (at its CPU share) plus the link."""
    copy = nbytes / (float(profile["copy_gbps"]) * 1e9)
    stage = copy / a.share + copy / b.share
    if a.node == b.node:  # loopback inside a node namespace: only the copies
        return stage
    nics = max(1, min(a.nics, b.nics, math.ceil(nbytes / CHUNK_BYTES)))
    rate = min(a.rate_mbit, b.rate_mbit) * 1e6 / 8 * nics
    return stage + nbytes / rate + max(a.latency_ms, b.latency_ms) / 1e3


def predict(profile: dict[str, Any], ranks: list[Rank], split: list[int], microbatches: int) -> Prediction:
    """Step time of ``split`` (layers per stage) on ``ranks`` at the profile's microbatch shape."""
    if len(split) != len(ranks):
        raise UserError(f"split {split} has {len(split)} stages but the lab has {len(ranks)} ranks (dp = 1).")
    parts = profile["parts"]
    last = len(split) - 1

    def total(j: int, key: str) -> float:
        t = split[j] * parts["layer"][key] + (parts["embed"][key] if j == 0 else 0.0)
        return (t + (parts["head"][key] if j == last else 0.0)) / ranks[j].share

    nbytes = float(profile["boundary_bytes"])
    stages = [StageTimes(total(j, "fwd_s"), total(j, "bwd_s"),
                         transfer_s(profile, ranks[j], ranks[j + 1], nbytes) if j < last else 0.0)
              for j in range(len(split))]
    pipeline, _ = one_f_one_b(stages, microbatches)
    optim = max(total(j, "optim_s") for j in range(len(split)))
    return Prediction(list(split), pipeline + optim, pipeline, optim, [s.fwd for s in stages],
                      [s.bwd for s in stages], [s.send_next for s in stages[:-1]])


def splits(layers: int, stages: int) -> list[list[int]]:
    """Every contiguous split of ``layers`` into ``stages`` parts of at least one layer."""
    return [[b - a for a, b in zip((0, *cuts), (*cuts, layers))]
            for cuts in itertools.combinations(range(1, layers), stages - 1)]


def even_split(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if j < layers % stages else 0) for j in range(stages)]


def best_split(profile: dict[str, Any], ranks: list[Rank], layers: int, microbatches: int) -> Prediction:
    """The planner's split: least predicted step time over all contiguous splits."""
    return min((predict(profile, ranks, s, microbatches) for s in splits(layers, len(ranks))),
               key=lambda p: p.step_s)


def measure(lab_path: str, lab_id: str, config: str, overrides: list[str], split: list[int], steps: int,
            warmup: int, run_dir: Path, timeout: float) -> dict[str, Any]:
    """Train ``split`` on a fresh lab; the median step time of the steps after ``warmup``."""
    from bimetal.lab.cluster import LabCluster

    lab = load_spec(lab_path, lab_id)
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
    ap = argparse.ArgumentParser(prog="bimetal plan calibrate", description=__doc__.splitlines()[0])
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

    from bimetal.cli import main as cli_main
    sys.exit(cli_main(["plan", "calibrate", *sys.argv[1:]]))
