"""Striping benchmark on the lab: cpu-forward point-to-point over 1, 2 and 4 emulated NICs of equal rate.

Two single-rank nodes with K NICs each (``configs/lab/rails4.toml``); for every stripe count the sender
(node 0) sends a 64 MiB float32 tensor to node 1 over a ``bimetal_cpu_forward`` group whose stripes are
bound to eth0..eth{K-1}. Counts run interleaved and repeated; the report gives the median bandwidth and
``ratio = bw(K) / (K x bw(1))`` (the issue asks >= 0.9)::

    python -m bimetal.lab.stripes --spec configs/lab/rails4.toml --out stripes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
from bimetal.lab.cluster import LabCluster
from bimetal.lab.spec import load_spec


def _rank_main(counts: list[int], nbytes: int, repeats: int) -> None:
    """Runs in each rank (torchrun env): rank 0 sends, rank 1 receives and prints the timings as JSON."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    import bimetal  # noqa: F401  (registers the transports)
    from bimetal.comm.registry import CPU_FORWARD
    from bimetal.comm.striping import CpuForwardOptions

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    groups = {k: dist.new_group([0, 1], backend=CPU_FORWARD, timeout=timeout,
                                pg_options=CpuForwardOptions(stripes=k, interfaces=[f"eth{i}" for i in range(k)]))
              for k in counts}
    t = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    rows: list[dict[str, Any]] = []
    for rep in range(repeats + 1):  # repeat 0 warms each group's connections up and is not reported
        for k in counts:
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1, group=groups[k])
            else:
                dist.recv(t, 0, group=groups[k])
            seconds = time.perf_counter() - t0
            if rank == 1 and rep > 0:
                rows.append({"stripes": k, "repeat": rep, "seconds": seconds,
                             "mbit_s": nbytes * 8 / seconds / 1e6, "ok": bool(t[-1].item() == 1.0)})
    if rank == 1:
        print("STRIPES " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def summarise(rows: list[dict[str, Any]], rate_mbit: float) -> dict[str, Any]:
    by_k: dict[int, list[float]] = {}
    for r in rows:
        by_k.setdefault(int(r["stripes"]), []).append(float(r["mbit_s"]))
    one = statistics.median(by_k[min(by_k)]) if 1 in by_k else None
    table = {}
    for k, vals in sorted(by_k.items()):
        med = statistics.median(vals)
        table[k] = {"median_mbit_s": med, "min": min(vals), "max": max(vals), "n": len(vals),
                    "ratio_vs_k_x_one_link": med / (k * one) if one else None,
                    "ratio_vs_k_x_line_rate": med / (k * rate_mbit)}
    return {"rate_mbit_per_nic": rate_mbit, "per_stripes": table}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bimetal.lab.stripes", description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="configs/lab/rails4.toml")
    p.add_argument("--counts", default="1,2,4", help="stripe counts (default 1,2,4)")
    p.add_argument("--mib", type=int, default=64, help="message size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if args.rank:
        _rank_main(counts, args.mib << 20, args.repeats)
        return 0
    spec = load_spec(args.spec)
    if len(spec.nodes) != 2 or any(n.ranks != 1 for n in spec.nodes) or max(counts) > min(n.nics for n in spec.nodes):
        raise UserError(f"{spec.source}: the striping bench needs 2 single-rank nodes with >= {max(counts)} NICs each")
    with LabCluster(spec) as lab:
        results = lab.run(["-m", "bimetal.lab.stripes", "--rank", "--counts", args.counts, "--mib", str(args.mib),
                           "--repeats", str(args.repeats)], timeout=300, capture=True)
    text = "".join(r.output for r in results)
    lines = [ln for ln in text.splitlines() if ln.startswith("STRIPES ")]
    if any(r.returncode for r in results) or not lines:
        print(text[-4000:], file=sys.stderr)
        raise UserError(f"the striping job failed (exit codes {[r.returncode for r in results]}); output above")
    rows = json.loads(lines[-1][len("STRIPES "):])
    report = summarise(rows, spec.nodes[0].rate_mbit)
    report.update({"message_mib": args.mib, "rows": rows, "spec": spec.source})
    print(f"cpu-forward p2p, {args.mib} MiB, NICs of {spec.nodes[0].rate_mbit:g} Mbit/s, {args.repeats} repeats")
    print(f"{'stripes':>7} {'median Mbit/s':>14} {'min':>8} {'max':>8} {'vs K x 1-link':>14} {'vs K x rate':>12}")
    for k, row in report["per_stripes"].items():
        print(f"{k:>7} {row['median_mbit_s']:>14.1f} {row['min']:>8.1f} {row['max']:>8.1f} "
              f"{row['ratio_vs_k_x_one_link']:>14.3f} {row['ratio_vs_k_x_line_rate']:>12.3f}")
    if not all(r["ok"] for r in rows):
        raise UserError("received data did not match what was sent")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
