"""Striping benchmark on the lab: cpu-forward point-to-point over 1..K emulated NICs.

Two single-rank nodes with K NICs each (``configs/lab/rails4.toml``: 4 NICs of 400 Mbit/s); for every size
and stripe count the sender (node 0) sends a float32 tensor to node 1 over a ``bimetal_cpu_forward`` group
whose stripes are bound to eth0..eth{k-1}. Sizes and counts run interleaved inside every repeat, so load from
elsewhere hits them alike, and the scaling ratio ``bw(k) / (k x bw(1))`` is taken per repeat (paired) and
reported as its median and range (the issue asks >= 0.95 at 64 MiB and >= 0.9 at 16 MiB)::

    python -m bimetal.bench.stripes --spec configs/lab/rails4.toml --sizes 16M,64M --counts 1,2,3,4

``--slow-nic 1:100`` first limits NIC 1 of both nodes to 100 Mbit/s (a degraded or shared link): the ratio
then compares with the sum of the line rates of the NICs used, which is what stripes that share the message
by measured speed approach (equal shares would finish at the slow link's pace). The bytes each stripe carried
(``comm_stats``) are printed per stripe count.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.lab.cluster import LabCluster
from bimetal.lab.spec import load_spec
from bimetal.outputs import check_file, write_text
from bimetal.sizes import parse_size

_log = logging.getLogger(__name__)


def _rank_main(counts: list[int], sizes: list[int], repeats: int) -> None:
    """Runs in each rank (torchrun env): rank 0 sends, rank 1 receives and prints the timings as JSON."""
    import datetime

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
    bufs = {n: (torch.arange(n // 4, dtype=torch.float32) if rank == 0 else torch.empty(n // 4)) for n in sizes}
    rows: list[dict[str, Any]] = []
    for rep in range(repeats + 1):  # repeat 0 warms connections and stripe shares up and is not reported
        for nbytes in sizes:
            for k in counts:
                t = bufs[nbytes]
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1, group=groups[k])
                else:
                    dist.recv(t, 0, group=groups[k])
                seconds = time.perf_counter() - t0
                if rank == 1 and rep > 0:
                    ok = bool(t[-1].item() == t.numel() - 1 and t[t.numel() // 2].item() == t.numel() // 2)
                    rows.append({"bytes": nbytes, "stripes": k, "repeat": rep, "seconds": seconds,
                                 "mbit_s": nbytes * 8 / seconds / 1e6, "ok": ok})
    if rank == 0:  # the sender's counters: bytes each stripe carried
        print("STRIPESTATS " + json.dumps({k: groups[k].comm_stats() for k in counts}), flush=True)  # type: ignore
    else:
        print("STRIPES " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def summarise(rows: list[dict[str, Any]], rates: list[float]) -> dict[str, Any]:
    """Per (size, stripes): median Mbit/s with range, and the paired ratios against one stripe (same size,
    same repeat) and against the summed line rates of the NICs used."""
    out: dict[str, Any] = {}
    for nbytes in sorted({int(r["bytes"]) for r in rows}):
        mine = [r for r in rows if r["bytes"] == nbytes]
        one = {r["repeat"]: r["mbit_s"] for r in mine if r["stripes"] == 1}
        table = {}
        for k in sorted({int(r["stripes"]) for r in mine}):
            vals = [r for r in mine if r["stripes"] == k]
            bw = [r["mbit_s"] for r in vals]
            paired = [r["mbit_s"] / (k * one[r["repeat"]]) for r in vals if r["repeat"] in one]
            table[k] = {"median_mbit_s": statistics.median(bw), "min": min(bw), "max": max(bw), "n": len(bw),
                        "ratio_vs_k_x_one_link": statistics.median(paired) if paired else None,
                        "ratio_min": min(paired) if paired else None, "ratio_max": max(paired) if paired else None,
                        "ratio_vs_line_rates": statistics.median(bw) / sum(rates[:k])}
        out[str(nbytes)] = table
    return out


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} B"


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m bimetal.bench.stripes", description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="configs/lab/rails4.toml")
    p.add_argument("--counts", default="1,2,3,4", help="stripe counts (default 1,2,3,4; 1 is the reference)")
    p.add_argument("--sizes", default="16M,64M", help="message sizes (default 16M,64M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slow-nic", default="", help="NIC:MBIT, e.g. 1:100: that NIC of both nodes at a lower rate")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out:
        check_file("--out", args.out)
    try:
        counts = [int(c) for c in args.counts.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--counts {args.counts!r}: write stripe counts like 1,2,3,4") from None
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not counts or min(counts) < 1 or 1 not in counts or not sizes or args.repeats < 1:
        raise UserError(f"--counts {args.counts!r} must include 1 (the reference), --sizes {args.sizes!r} at least "
                        f"one size, --repeats {args.repeats} at least 1")
    if args.rank:
        _rank_main(counts, sizes, args.repeats)
        return 0
    spec = load_spec(args.spec)
    if len(spec.nodes) != 2 or any(n.ranks != 1 for n in spec.nodes) or max(counts) > min(n.nics for n in spec.nodes):
        raise UserError(f"{spec.source}: the striping bench needs 2 single-rank nodes with >= {max(counts)} NICs each")
    rates = [spec.nodes[0].rate_mbit] * spec.nodes[0].nics
    slow: tuple[int, float] | None = None
    if args.slow_nic:
        try:
            nic, rate = args.slow_nic.split(":")
            slow = (int(nic), float(rate))
        except ValueError:
            raise UserError(f"--slow-nic {args.slow_nic!r}: write NIC:MBIT, e.g. 1:100") from None
        if not 0 <= slow[0] < len(rates) or slow[1] <= 0:
            raise UserError(f"--slow-nic {args.slow_nic!r}: NIC 0..{len(rates) - 1} and a positive rate")
        rates[slow[0]] = slow[1]
    started = time.monotonic()
    with LabCluster(spec) as lab:
        if slow is not None:
            from bimetal.lab.faults import set_link

            for node in spec.nodes:
                set_link(lab, node.name, slow[0], rate_mbit=slow[1])
        results = lab.run(["-m", "bimetal.bench.stripes", "--rank", "--counts", args.counts, "--sizes", args.sizes,
                           "--repeats", str(args.repeats)], timeout=600, capture=True)
    text = "".join(r.output for r in results)
    lines = [ln for ln in text.splitlines() if ln.startswith("STRIPES ")]
    stat_lines = [ln for ln in text.splitlines() if ln.startswith("STRIPESTATS ")]
    if any(r.returncode for r in results) or not lines or not stat_lines:
        _log.error("%s", text[-4000:])
        raise UserError(f"the striping job failed (exit codes {[r.returncode for r in results]}); output above")
    rows = json.loads(lines[-1][len("STRIPES "):])
    stats = json.loads(stat_lines[-1][len("STRIPESTATS "):])
    report = {"per_size": summarise(rows, rates), "rates_mbit": rates, "rows": rows, "comm_stats": stats,
              "spec": spec.source, "repeats": args.repeats, "wall_s": time.monotonic() - started}
    print(f"cpu-forward p2p on {spec.source}: NICs of {', '.join(f'{r:g}' for r in rates[:max(counts)])} Mbit/s, "
          f"{args.repeats} repeats, sizes and stripe counts interleaved; {report['wall_s']:.0f} s")
    print(f"{'size':>7} {'stripes':>7} {'median Mbit/s':>14} {'min':>8} {'max':>8} "
          f"{'xK/(K*x1) median [range]':>26} {'vs line rates':>13}")
    for nbytes, table in report["per_size"].items():
        for k, row in table.items():
            ratio = (f"{row['ratio_vs_k_x_one_link']:.3f} [{row['ratio_min']:.3f}-{row['ratio_max']:.3f}]"
                     if row["ratio_vs_k_x_one_link"] is not None else "-")
            print(f"{_fmt_size(int(nbytes)):>7} {k:>7} {row['median_mbit_s']:>14.1f} {row['min']:>8.1f} "
                  f"{row['max']:>8.1f} {ratio:>26} {row['ratio_vs_line_rates']:>13.3f}")
    for k, st in stats.items():
        per = [st.get(f"bytes_stripe{s}", 0) for s in range(int(k))]
        total = sum(per) or 1
        shares = ", ".join(f"{b / total:.3f}" for b in per)
        print(f"stripes {k}: share of the bytes per stripe (sender, all sizes and repeats) {shares}; "
              f"failovers {st['failovers']}, pool buffers allocated {st['pool_buffers_allocated']}")
    if not all(r["ok"] for r in rows):
        raise UserError("received data did not match what was sent")
    if args.out:
        write_text(args.out, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from bimetal.entry import run_command

    sys.exit(run_command("bench stripes", main, sys.argv[1:]))
