"""Rank program for the lab failover test: node a sends to node b over a cpu-forward group striped on eth0+eth1.

``python cf_failover_lab_rank.py OUT_DIR MIB``: three transfers, each checked bit for bit against the tensor
built from the same seed: (0) ``MIB`` MiB with both NICs up; (1) the same size again, with ``OUT_DIR/go``
written just before it so that the test driver can cut eth1 while it runs; (2) a quarter of the size on
what is left. Barriers run on the default Gloo group (eth0, which stays up). Each rank prints
``RESULT<rank> {json}`` with the time, the match and the degraded-stripe warnings of every transfer.

``python cf_failover_lab_rank.py OUT_DIR MIB alldown``: one transfer over a group striped on eth1+eth2 (6 s
timeout) while the driver cuts both; each rank prints the error it got and when.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the transports)
from bimetal.comm.cpu_forward import CpuForwardOptions


def payload(seed: int, numel: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed))


def all_down(out_dir: Path, mib: int, rank: int) -> None:
    g = dist.new_group([0, 1], backend="bimetal_cpu_forward", group_desc="pp.a-b", timeout=timedelta(seconds=6),
                       pg_options=CpuForwardOptions(stripes=2, interfaces=["eth1", "eth2"], stall_timeout_s=2.0))
    data = payload(0, (mib << 20) // 4) if rank == 0 else torch.empty((mib << 20) // 4, dtype=torch.int32)
    dist.barrier()
    if rank == 0:
        (out_dir / "go").write_text("go")
    start = time.monotonic()
    try:
        (dist.send if rank == 0 else dist.recv)(data, 1 - rank, group=g)
        res: dict[str, Any] = {"error": None}
    except Exception as exc:
        res = {"error": str(exc), "type": type(exc).__name__}
    res["elapsed"] = time.monotonic() - start
    print(f"RESULT{rank} " + json.dumps(res), flush=True)
    os._exit(0)


def main() -> None:
    out_dir, mib = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    if sys.argv[3:] == ["alldown"]:
        all_down(out_dir, mib, rank)
    g: Any = dist.new_group([0, 1], backend="bimetal_cpu_forward", group_desc="pp.a-b",
                            timeout=timedelta(seconds=60),
                            pg_options=CpuForwardOptions(stripes=2, interfaces=["eth0", "eth1"], stall_timeout_s=2.0))
    rows = []
    for i, nbytes in enumerate((mib << 20, mib << 20, mib << 18)):
        numel = nbytes // 4
        data = payload(i, numel) if rank == 0 else torch.empty(numel, dtype=torch.int32)
        dist.barrier()
        if rank == 0 and i == 1:
            (out_dir / "go").write_text("go")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            if rank == 0:
                dist.send(data, 1, group=g)
            else:
                dist.recv(data, 0, group=g)
            seconds = time.monotonic() - start
        ok = True if rank == 0 else torch.equal(data, payload(i, numel))
        rows.append({"mib": nbytes / 2**20, "seconds": seconds, "ok": ok,
                     "warnings": [str(w.message) for w in caught if "degraded" in str(w.message)]})
        del data
    print(f"RESULT{rank} " + json.dumps({"rows": rows, "dead": sorted(g.state.links.dead)}), flush=True)
    dist.barrier()
    os._exit(0)  # the group's dead stripe is closed already; skip the slow Gloo teardown


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
