"""Rank program: a peer that dies or stalls mid-transfer on cpu-forward.

``python cf_fault_rank.py OUT_DIR MODE[,MODE...]`` with 2 ranks per MODE: ranks 2p and 2p+1 make a pair with a
cpu-forward group of their own (described ``pp.dp0``; in it they are ranks 0 and 1) and run the p-th MODE, all
pairs at once (rank 0 hosts the world's store: it ends last): ``die`` (rank 1 exits abruptly after sending half of
a chunked message), ``stall`` (rank 1 stops answering) ``corrupt`` (checksums on, rank 1 flips a byte of its
message after computing the checksum) or ``desync`` (rank 1 calls all_gather where rank 0 calls all_reduce: both
time out and rank 0's error, a timeout or the connection rank 1's timeout closed, says what rank 1 was doing). The
pair's rank 0 records what its receive raised and how long it took in ``OUT_DIR/<MODE>.json``. The ranks need no
launcher (``forked_ranks.py`` starts them with none watching, so a rank that dies on purpose stops no other pair).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import bimetal  # noqa: F401
from bimetal.comm.cpu_forward import CpuForwardOptions
from bimetal.comm.cpu_forward.faults import inject_fault

TIMEOUT_S = 6.0


def main() -> None:
    out_dir, modes = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pair, rank = divmod(dist.get_rank(), 2)
    mode = modes[pair]
    groups = [dist.new_group([2 * p, 2 * p + 1], backend="bimetal_cpu_forward", group_desc="pp.dp0",
                             timeout=timedelta(seconds=TIMEOUT_S),
                             pg_options=CpuForwardOptions(stripes=2, interfaces=["lo", "lo"], chunk_bytes=1 << 16))
              for p in range(len(modes))]  # every rank takes part in making every group
    g = groups[pair]
    done = os.path.join(out_dir, f"{mode}.json")
    if mode == "corrupt":
        g.state.checksum = True  # what BIMETAL_CF_CHECKSUM=1 sets at creation
    dist.barrier(group=g)
    n = 1 << 20  # 4 MiB of float32: 64 chunks
    if rank == 1:
        if mode == "die":
            half = torch.ones(n // 2)
            # a different (smaller) message: rank 0 receives half of what it waits for
            dist.send(half, group=g, group_dst=0)
            os._exit(1)
        if mode == "corrupt":
            dist.send(torch.ones(n), group=g, group_dst=0)  # clean: its checksum must pass
            inject_fault(g, "corrupt")
            dist.send(torch.ones(n), group=g, group_dst=0)
            os._exit(0)
        if mode == "desync":
            with contextlib.suppress(Exception):  # it times out too; rank 0's error is the one checked
                dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4), group=g)
            os._exit(0)
        # stall: alive and silent until rank 0's receive has timed out and said so (bounded, should it never)
        deadline = time.monotonic() + TIMEOUT_S + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)
    if mode == "corrupt":
        clean = torch.empty(n)
        dist.recv(clean, group=g, group_src=1)
        assert torch.equal(clean, torch.ones(n))
    start = time.monotonic()
    try:
        if mode == "desync":
            dist.all_reduce(torch.ones(n), group=g)
        else:
            dist.recv(torch.empty(n), group=g, group_src=1)
        result = {"error": None}
    except Exception as exc:
        result = {"error": str(exc), "type": type(exc).__name__}
    result["elapsed"] = time.monotonic() - start
    with open(done + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(done + ".tmp", done)
    if pair == 0:  # the world's store lives in this process, and the other pairs' ranks still use it (a desync note)
        deadline = time.monotonic() + TIMEOUT_S + 60
        while not all(os.path.exists(os.path.join(out_dir, f"{m}.json")) for m in modes) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    os._exit(0)


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
