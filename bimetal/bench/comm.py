"""``bimetal bench comm``: bandwidth and latency against message size for raw Gloo, cpu-forward with 1..K
stripes and (with ``--transports``) device-direct, the bare device-direct engine (``dd-engine``) and the fastest
a process group written in Python (``py-ceiling``) can be, measured side by side in one run.

Two ranks: rank 0 sends, rank 1 receives and answers with a 1-element acknowledgement, so a delivery is
complete when it returns; a sample is the mean of about 4 MiB's worth of deliveries (1 to 32). Variants are
interleaved inside every iteration, in an order that rotates (noise hits all of them alike), the median is
reported, and the ratios the performance targets name are printed, each as the median of the per-iteration
(paired) ratios with their interquartile range: cpu-forward on one stripe against raw Gloo on the same link
(bandwidth from 64 KiB up, latency below), K stripes against K times one, and device-direct against
cpu-forward on one stripe (bandwidth at 64 MiB, latency at 4 KiB; device-direct listens on the first
``--ifaces`` link too, so all variants share one link), and ``py-ceiling`` against Gloo and against cpu-forward
(see ``PythonCeiling``). Sizes take K/M/G suffixes everywhere (``--sizes 4K,1M``, ``--chunk-bytes 1M``).
Outside a launched job it starts two simulated ranks on this machine; under torchrun (the lab, real nodes) it
uses the job's ranks.
Writes ``bench_comm.json`` and ``bench_comm.png`` (matplotlib, if installed) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.outputs import check_folder
from bimetal.sizes import parse_size

DEFAULT_SIZES = "4K,64K,1M,4M,16M,64M,256M"


def build_parser(prog: str = "bimetal bench comm") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=5,
                   help="samples per size and variant (at least 200 up to 64 KiB); a sample times 1-32 deliveries")
    p.add_argument("--stripes", default="1,2", help="cpu-forward stripe counts to compare, e.g. 1,2,4")
    p.add_argument("--ifaces", default="lo", help="interfaces, one per stripe, reused round robin (default lo)")
    p.add_argument("--transports", default="gloo,cpu-forward",
                   help="gloo, cpu-forward, device-direct, dd-engine (the engine alone: the ceiling of device-direct), "
                        "py-ceiling (a Python group returning Gloo's own work: the ceiling of cpu-forward x1)")
    p.add_argument("--chunk-bytes", default="", help="cpu-forward chunk size, e.g. 1M (default 4M)")
    p.add_argument("--out", default="runs/bench_comm", help="folder for bench_comm.json / .png")
    p.add_argument("--simulate", default="nvidia:1,amd:1", help="ranks started here when not under torchrun")
    return p


def engine_main(argv: list[str]) -> int:
    """``bimetal bench engine``: ``bench comm`` with the device-direct rows: gloo, cpu-forward x1, device-direct and
    the engine alone (``bimetal.bench.engine``), at 4 KiB and 64 MiB, unless the options say otherwise."""
    args = list(argv)
    if not any(a.startswith("--transports") for a in args):
        args += ["--transports", "gloo,cpu-forward,device-direct,dd-engine", "--stripes", "1"]
    if not any(a.startswith("--sizes") for a in args):
        args += ["--sizes", "4K,64M"]
    return main(args, prog="bimetal bench engine")


def main(argv: list[str], prog: str = "bimetal bench comm") -> int:
    args = build_parser(prog).parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.chunk_bytes = parse_size(args.chunk_bytes) if args.chunk_bytes.strip() else 0
    try:
        stripes = [int(s) for s in args.stripes.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--stripes {args.stripes!r}: write stripe counts like 1,2,4") from None
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(transports) - {"gloo", "cpu-forward", "device-direct", "dd-engine", "py-ceiling"}
    if unknown or not sizes or not stripes or min(stripes) < 1 or args.iters < 1:
        raise UserError(f"bad benchmark arguments (transports {sorted(unknown) or transports}, stripes {stripes}, "
                        f"iters {args.iters}); see bimetal bench comm --help")
    if "RANK" not in os.environ:
        check_folder("--out", args.out)  # rank 0 writes it after every measurement
        from bimetal.launch import launch
        from bimetal.simulate import strip_simulate

        return launch(["-m", "bimetal.bench.comm", *strip_simulate(argv)], simulate=args.simulate)
    return _run(args, sizes, stripes, transports)


def _iface_address(name: str) -> str:
    """The IPv4 address of interface ``name`` (device-direct listens on an address, Gloo binds an interface)."""
    import psutil

    for addr in psutil.net_if_addrs().get(name, []):
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise UserError(f"interface {name!r} has no IPv4 address; pass --ifaces with an interface of this host")


def _groups(args: argparse.Namespace, stripes: list[int], transports: list[str],
            sizes: list[int]) -> dict[str, object]:
    import torch.distributed as dist

    from bimetal.comm.cpu_forward import CpuForwardOptions

    ifaces = [s for s in args.ifaces.split(",") if s.strip()]
    groups: dict[str, object] = {}
    if "gloo" in transports:
        if ifaces:  # raw Gloo on the same (first) link as cpu-forward's first stripe
            from bimetal.comm.striping import build_stripes

            store = dist.PrefixStore("bench-raw", dist.distributed_c10d._get_default_store())
            groups["gloo"] = build_stripes(store, dist.get_rank(), 2, timedelta(seconds=300), [ifaces[0]])[0]
        else:
            groups["gloo"] = dist.new_group([0, 1], backend="gloo")
    if "cpu-forward" in transports:
        for k in stripes:
            names = [ifaces[i % len(ifaces)] for i in range(k)] if ifaces else []
            opts = CpuForwardOptions(stripes=k, interfaces=names, chunk_bytes=args.chunk_bytes)
            groups[f"cpu-forward x{k}"] = dist.new_group([0, 1], backend="bimetal_cpu_forward", pg_options=opts,
                                                         group_desc=f"bench.cf{k}")
    if "py-ceiling" in transports:
        opts = CpuForwardOptions(stripes=1, interfaces=ifaces[:1], chunk_bytes=args.chunk_bytes)
        groups["py-ceiling"] = PythonCeiling(dist.new_group([0, 1], backend="bimetal_cpu_forward", pg_options=opts,
                                                            group_desc="bench.py-ceiling"))
    dd_host = {"host": _iface_address(ifaces[0])} if ifaces else {}
    if "device-direct" in transports:
        groups["device-direct"] = dist.new_group([0, 1], backend="bimetal_device_direct", group_desc="bench.dd",
                                                 pg_options=dd_host or None)
    if "dd-engine" in transports:
        from bimetal.bench.engine import EngineOnly
        from bimetal.comm.device_direct import default_host, options_from

        dd = options_from(dd_host or None)
        store = dist.PrefixStore("bench-dd-engine", dist.distributed_c10d._get_default_store())
        groups["dd-engine"] = EngineOnly(store, dist.get_rank(), dd_host.get("host") or default_host(), max(sizes),
                                         dd.chunk_bytes, dd.window)
    return groups


class PythonCeiling:
    """``py-ceiling``: a cpu-forward group on one stripe whose ``send``/``recv`` hand back Gloo's own work for what
    the group's one-message fast path takes (``p2p.Lean``), after the same checks and nothing else: no op number,
    no byte counts, no ``Work`` of ours and so no words on a failure. It is the least a process group written in
    Python adds to Gloo (a Python call and the checks), so ``cpu-forward x1 / py-ceiling`` is what the fast path's
    bookkeeping costs and ``py-ceiling / gloo`` what only leaving Python would win. A benchmark variant, not a
    transport: a failure in it comes out in Gloo's words."""

    def __init__(self, pg: Any):
        self.pg, self.lean = pg, pg.lean

    def _takes(self, t: Any, key: tuple[str, int]) -> bool:
        from bimetal.comm.cpu_forward.p2p import LEAN_DTYPES

        lean = self.lean
        return (lean is not None and t.is_cpu and t.dtype in LEAN_DTYPES and t.is_contiguous()
                and t.nbytes <= lean.limit and lean.workers.direct(key))

    def send(self, tensors: list[Any], dst: int, tag: int = 0) -> Any:
        if len(tensors) == 1 and self._takes(tensors[0], ("send", dst)):
            return self.lean.stripe.send(tensors, dst, tag)
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors: list[Any], src: int, tag: int = 0) -> Any:
        if len(tensors) == 1 and self._takes(tensors[0], ("recv", src)):
            return self.lean.stripe.recv(tensors, src, tag)
        return self.pg.recv(tensors, src, tag)


_SMALL, _SMALL_ITERS = 64 << 10, 200
_BATCH_BYTES, _MAX_BATCH = 4 << 20, 32


def batch(size: int) -> int:
    """Deliveries timed together as one sample: about 4 MiB's worth, 1 to 32 (a 64 KiB delivery takes ~0.1 ms,
    near the scheduler's noise; a sample of 32 of them is not). The sample is their mean."""
    return max(1, min(_MAX_BATCH, _BATCH_BYTES // max(1, size)))


def _deliver(group: object, buf: object, ack: object, rank: int, times: int = 1) -> float:
    """Seconds per delivery, the mean of ``times`` back to back (each waits for its acknowledgement)."""
    start = time.perf_counter()
    for _ in range(times):
        if rank == 0:
            group.send([buf], 1, 0).wait()  # type: ignore[attr-defined]
            group.recv([ack], 1, 1).wait()  # type: ignore[attr-defined]
        else:
            group.recv([buf], 0, 0).wait()  # type: ignore[attr-defined]
            group.send([ack], 0, 1).wait()  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / times


def _run(args: argparse.Namespace, sizes: list[int], stripes: list[int], transports: list[str]) -> int:
    import torch
    import torch.distributed as dist

    import bimetal  # noqa: F401  (registers the back-ends)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise UserError(f"bimetal bench comm needs exactly 2 ranks, the job has {dist.get_world_size()}")
    groups = _groups(args, stripes, transports, sizes)
    samples: dict[str, dict[int, list[float]]] = {name: {s: [] for s in sizes} for name in groups}
    ack = torch.zeros(1)
    if rank == 0 and args.iters < _SMALL_ITERS and any(s <= _SMALL for s in sizes):  # said: the user wrote --iters
        print(f"bench comm: {_SMALL_ITERS} samples (not --iters {args.iters}) for sizes up to 64 KiB: their medians "
              "are noisy with fewer", flush=True)
    for size in sizes:
        buf = torch.ones(size // 4)
        for g in groups.values():  # warm-up: connections, pools
            _deliver(g, buf, ack, rank)
        # small messages are cheap and their medians (latency) are noisy: at least _SMALL_ITERS samples each
        names = list(groups)
        for i in range(args.iters if size > _SMALL else max(args.iters, _SMALL_ITERS)):
            for j in range(len(names)):  # the order rotates: no variant always follows the same one
                name = names[(i + j) % len(names)]
                samples[name][size].append(_deliver(groups[name], buf, ack, rank, batch(size)))
    dist.barrier()
    for g in groups.values():
        if hasattr(g, "close"):  # the bare engine; process groups go with destroy_process_group
            g.close()
    if rank == 0:
        report = _report(samples, sizes)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_comm.json").write_text(json.dumps(report, indent=2))
        _plot(report, out / "bench_comm.png")
        print(f"wrote {out / 'bench_comm.json'}", flush=True)
    dist.destroy_process_group()
    return 0


def paired(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range of the per-iteration ratios num[i] / den[i] (samples taken side by side)."""
    ratios = sorted(n / d for n, d in zip(num, den) if d > 0)
    if len(ratios) < 2:
        return (ratios[0], ratios[0], ratios[0]) if ratios else (float("nan"),) * 3
    q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return med, q1, q3


def _report(samples: dict[str, dict[int, list[float]]], sizes: list[int]) -> dict:
    rows: list[dict[str, Any]] = []
    for name, by_size in samples.items():
        for size in sizes:
            t = statistics.median(by_size[size])
            rows.append({"variant": name, "bytes": size, "median_s": t, "samples_s": by_size[size],
                         "gbit_per_s": size * 8 / t / 1e9})
    table = {(r["variant"], r["bytes"]): r for r in rows}
    ratios: dict[str, tuple[float, float, float]] = {}
    ref = 64 * 2**20 if 64 * 2**20 in sizes else max(sizes)
    small = 4 << 10 if 4 << 10 in sizes else min(sizes)
    one = "cpu-forward x1"
    # bandwidth ratio = the reference's time / the variant's, per iteration (the ceiling: see PythonCeiling)
    for num, den in ((one, "gloo"), ("py-ceiling", "gloo"), (one, "py-ceiling")):
        if num in samples and den in samples:
            for size in sizes:
                if size < 64 << 10:
                    ratios[f"{num} / {den} latency @ {_fmt(size)}"] = paired(samples[num][size], samples[den][size])
                else:
                    ratios[f"{num} / {den} bandwidth @ {_fmt(size)}"] = paired(samples[den][size], samples[num][size])
    for name in samples:
        if name.startswith("cpu-forward x") and name != one and one in samples:
            k = int(name.rsplit("x", 1)[1])
            for size in sizes:
                if size >= 16 * 2**20 or size == ref:
                    ratios[f"{name} / ({k} * x1) bandwidth @ {_fmt(size)}"] = paired(
                        [t / k for t in samples[one][size]], samples[name][size])
    ratios.update(_device_direct_ratios(samples, sizes, ref, small))
    header = f"{'size':>8}  " + "  ".join(f"{n:>18}" for n in samples)
    lines = [header, "-" * len(header)]
    for size in sizes:
        cells = [f"{table[(n, size)]['gbit_per_s']:8.3f} Gb/s {table[(n, size)]['median_s'] * 1e3:6.2f}ms"
                 for n in samples]
        lines.append(f"{_fmt(size):>8}  " + "  ".join(f"{c:>18}" for c in cells))
    print("\n".join(lines), flush=True)
    for label, (med, q1, q3) in ratios.items():
        print(f"ratio {label}: {med:.3f} (paired, interquartile {q1:.3f}-{q3:.3f})", flush=True)
    return {"rows": rows, "ratios": {k: {"median": m, "q1": a, "q3": b} for k, (m, a, b) in ratios.items()}}


def _device_direct_ratios(samples: dict[str, dict[int, list[float]]], sizes: list[int], ref: int, small: int
                          ) -> dict[str, tuple[float, float, float]]:
    """The issue-4 targets: device-direct over cpu-forward x1 in bandwidth at 64 MiB (>= 1 wanted) and in 4 KiB
    latency (< 1 wanted), and the same for the bare engine, which tells our control plane from the engine."""
    ratios = {}
    for name in ("device-direct", "dd-engine"):
        for base in ("cpu-forward x1", "gloo"):
            if name in samples and base in samples:
                ratios[f"{name} / {base} bandwidth @ {_fmt(ref)}"] = paired(samples[base][ref], samples[name][ref])
                ratios[f"{name} / {base} latency @ {_fmt(small)}"] = paired(samples[name][small], samples[base][small])
    if "device-direct" in samples and "dd-engine" in samples:
        ratios[f"device-direct / dd-engine bandwidth @ {_fmt(ref)}"] = paired(samples["dd-engine"][ref],
                                                                              samples["device-direct"][ref])
    return ratios


def _fmt(size: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}iB"
    return f"{size}B"


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib: bimetal's [plot] extra)", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["variant"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["variant"] == name]
        ax.plot([r["bytes"] for r in rows], [r["gbit_per_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("Gbit/s (median delivery)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    from bimetal.entry import run_command

    sys.exit(run_command("bench", main, sys.argv[1:]))
