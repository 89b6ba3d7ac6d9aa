"""Rank program: stripe failover of cpu-forward point-to-point on loopback (2 ranks, 2 stripes on ``lo``).

``python cf_failover_rank.py OUT_DIR`` runs three scenarios, each on a fresh group; rank 1 sends to rank 0:

* ``recv_stall``: rank 0's stripe 1 stalls mid-transfer (``inject_fault(g, "stall")``: nothing posted or completed
  on it any more), checksums on; then a second transfer on the surviving stripe;
* ``send_stall``: the same with the sender's stripe 0;
* ``both_ways``: both ranks send to each other at once (as 1F1B does) while rank 0's stripe 1 stalls;
* ``all_stall``: both of rank 0's stripes stall: the receive must fail with the op timeout's error.

Each rank writes ``OUT_DIR/rank<r>.json``: per scenario, whether the data matched, the errors, the elapsed
seconds and the degraded-stripe warnings it printed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the transports)
from bimetal.comm.cpu_forward import CpuForwardOptions
from bimetal.comm.cpu_forward.faults import inject_fault

NUMEL = 4 << 20  # 16 MiB of float32: 64 chunks of 256 KiB, 32 per stripe


def payload(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def group(desc: str, timeout_s: float) -> dist.ProcessGroup:
    return dist.new_group(backend="bimetal_cpu_forward", group_desc=desc, timeout=timedelta(seconds=timeout_s),
                          pg_options=CpuForwardOptions(stripes=2, interfaces=["lo", "lo"], chunk_bytes=1 << 18,
                                                       stall_timeout_s=1.0))


def transfer(g: dist.ProcessGroup, rank: int, seed: int) -> dict[str, object]:
    start = time.monotonic()
    try:
        if rank == 1:
            dist.send(payload(seed), 0, group=g)
            ok = True
        else:
            got = torch.empty(NUMEL)
            dist.recv(got, 1, group=g)
            ok = torch.equal(got, payload(seed))
        return {"ok": ok, "error": None, "elapsed": time.monotonic() - start}
    except Exception as exc:
        return {"ok": False, "error": str(exc), "type": type(exc).__name__, "elapsed": time.monotonic() - start}


def both_ways(g: dist.ProcessGroup, rank: int, seed: int) -> dict[str, object]:
    start = time.monotonic()
    try:
        got = torch.empty(NUMEL)
        works = [dist.isend(payload(seed + rank), 1 - rank, group=g), dist.irecv(got, 1 - rank, group=g)]
        for w in works:
            w.wait()
        ok = torch.equal(got, payload(seed + 1 - rank))
        return {"ok": ok, "error": None, "elapsed": time.monotonic() - start}
    except Exception as exc:
        return {"ok": False, "error": str(exc), "type": type(exc).__name__, "elapsed": time.monotonic() - start}


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict[str, object] = {}
    for name, stalling_rank, stripes in (("recv_stall", 0, [1]), ("send_stall", 1, [0]), ("both_ways", 0, [1]),
                                         ("all_stall", 0, [0, 1])):
        g = group(f"pp.{name}", 4.0 if name == "all_stall" else 60.0)  # all stalled: the test waits it out
        pg: Any = g  # the bimetal object itself (extended API)
        pg.state.checksum = name == "recv_stall"
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == stalling_rank:
                for s in stripes:
                    inject_fault(pg, "stall", stripe=s, after=6)
            run = both_ways if name == "both_ways" else transfer
            first = run(g, rank, seed=1)
            second = run(g, rank, seed=3) if name != "all_stall" else None
        degraded = [str(w.message) for w in caught if "degraded" in str(w.message)]
        results[name] = {"first": first, "second": second, "warnings": degraded, "dead": sorted(pg.state.links.dead)}
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)  # the all_stall groups are broken on purpose; skip their teardown


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
