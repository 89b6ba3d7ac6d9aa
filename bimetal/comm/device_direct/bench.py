"""Point-to-point bandwidth and latency rows for any process group, and a side-by-side two-process run.

``measure_rows(group, label, rank, sizes)`` is what ``bimetal bench comm`` calls for each transport (group
ranks 0 and 1 take part; it works the same for Gloo, cpu-forward and device-direct, so the rows compare).
Latency is half the round trip of a ping-pong; bandwidth is a one-way stream of messages closed by an ack.
``python -m bimetal.comm.device_direct.bench [--sizes 4096,67108864] [--out rows.json]`` runs two local ranks
and prints Gloo, cpu-forward (when built) and device-direct rows from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_SIZES = (4096, 1 << 20, 64 << 20)


def _iters(nbytes: int) -> int:
    return max(4, min(200, (256 << 20) // max(nbytes, 1)))


def measure_rows(group: Any, label: str, rank: int, sizes: tuple[int, ...] = DEFAULT_SIZES) -> list[dict]:
    """One row per size: ``{"transport", "bytes", "latency_us", "gbit_s", "iters"}`` (group ranks 0 and 1)."""
    peer = 1 - rank
    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        n = _iters(nbytes)
        dist.barrier(group=group)
        for _ in range(2):  # warm-up: connections, registrations, caches
            _pingpong(group, rank, peer, buf)
        t0 = time.perf_counter()
        for _ in range(n):
            _pingpong(group, rank, peer, buf)
        latency = (time.perf_counter() - t0) / n / 2
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if rank == 0:
            works = [dist.isend(buf, group_dst=peer, group=group, tag=1) for _ in range(n)]
        else:
            works = [dist.irecv(buf, group_src=peer, group=group, tag=1) for _ in range(n)]
        for w in works:
            if w is not None:
                w.wait()
        if rank == 0:
            dist.recv(ack, group_src=peer, group=group, tag=2)
        else:
            dist.send(ack, group_dst=peer, group=group, tag=2)
        seconds = time.perf_counter() - t0
        rows.append({"transport": label, "bytes": nbytes, "latency_us": round(latency * 1e6, 1),
                     "gbit_s": round(nbytes * n * 8 / seconds / 1e9, 3), "iters": n})
    return rows


def _pingpong(group: Any, rank: int, peer: int, buf: torch.Tensor) -> None:
    if rank == 0:
        dist.send(buf, group_dst=peer, group=group)
        dist.recv(buf, group_src=peer, group=group)
    else:
        dist.recv(buf, group_src=peer, group=group)
        dist.send(buf, group_dst=peer, group=group)


def _rank(rank: int, port: int, sizes: tuple[int, ...], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("BIMETAL_DD_HOST", "127.0.0.1")
    import bimetal  # noqa: F401  (registers the back-ends)

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    groups: list[tuple[str, Any]] = [("gloo", dist.group.WORLD)]
    try:
        groups.append(("cpu-forward", dist.new_group([0, 1], backend="bimetal_cpu_forward")))
    except Exception as exc:  # noqa: BLE001 - a transport not built yet is left out of the table, with why
        print(f"cpu-forward left out: {exc}", file=sys.stderr)
    groups.append(("device-direct", dist.new_group([0, 1], backend="bimetal_device_direct")))
    rows: list[dict] = []
    for label, group in groups:
        rows += measure_rows(group, label, rank, sizes)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(prog="python -m bimetal.comm.device_direct.bench")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes")
    ap.add_argument("--out", default="dd_bench.json")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    mp.start_processes(_rank, args=(store.port, sizes, args.out), nprocs=2, start_method="spawn")
    with open(args.out) as f:
        rows = json.load(f)
    print(f"{'transport':<14}{'bytes':>11}{'latency_us':>12}{'Gbit/s':>9}")
    for r in rows:
        print(f"{r['transport']:<14}{r['bytes']:>11}{r['latency_us']:>12}{r['gbit_s']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
