"""Rank program: the operation table (``op_table_rank.py``) on cpu-forward with staging forced.

Usage (under ``bimetal launch``, with ``BIMETAL_CF_FORCE_STAGING=1``): ``python staged_table_rank.py OUT_DIR``.
Runs every row on cpu-forward with one and two stripes, as ``op_table_rank`` does, but the groups stage their
CPU tensors through the pinned pool in rounds (the path device tensors take; ``staging.HostCopyDouble``
stands in for the copy engine). Two more rows per transport: an uneven all-to-all needing more than the pool's
byte bound (it runs in rounds; bit-identical to Gloo, the pool never above its bound), and a check that
staging really happened.
Not collected by pytest; ``test_staging.py`` drives it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_table_rank as table  # noqa: E402

from bimetal.comm.cpu_forward import CpuForwardOptions  # noqa: E402


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.new_group(backend="gloo")
    results: list[dict] = []
    for k in (1, 2):
        name = f"cpu-forward/k{k}"
        opts = CpuForwardOptions(stripes=k, interfaces=["lo"] * k, chunk_bytes=4096)
        g = dist.new_group(backend="bimetal_cpu_forward", group_desc=table.DESCS[name], pg_options=opts)
        table.run_table(name, g, table.EVERY_KIND, ref, rank, world, results)
        pg: Any = g  # the group object is the bimetal process group
        results.append(uneven_beyond_the_bound(name, g, pg, ref, rank, world))
        stats = pg.comm_stats()
        ok = pg.state.stage_all and stats["bytes_staged"] > 0
        results.append({"transport": name, "case": "staging.forced", "ok": bool(ok), "seconds": 0.0,
                        "detail": "" if ok else f"stage_all={pg.state.stage_all}, {stats}"})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def uneven_beyond_the_bound(name: str, g: dist.ProcessGroup, pg: Any, ref: dist.ProcessGroup, rank: int,
                            world: int) -> dict:
    """An uneven all-to-all (rows of a 2-D float32 tensor) whose longest part alone is twice the pool's bound."""
    long = 2 * pg.state.pool.max_bytes // (4 * 5)  # rows of 5 float32
    rows = [[(long if (src + dst) % 2 else 7 * (dst + 1)) for dst in range(world)] for src in range(world)]
    split_in, split_out = rows[rank], [rows[p][rank] for p in range(world)]
    x = table.data((sum(split_in), 5), torch.float32, 1000 + rank)
    a, b = torch.empty(sum(split_out), 5), torch.empty(sum(split_out), 5)
    dist.all_to_all_single(a, x, split_out, split_in, group=g)
    dist.all_to_all_single(b, x, split_out, split_in, group=ref)
    detail = table.same(a, b, True)
    if not detail and not 0 < pg.state.pool.held_bytes <= pg.state.pool.max_bytes:
        detail = f"pool holds {pg.state.pool.held_bytes} bytes, bound {pg.state.pool.max_bytes}"
    return {"transport": name, "case": "staging.uneven_all_to_all_beyond_the_pool_bound", "ok": not detail,
            "seconds": 0.0, "detail": detail}


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
