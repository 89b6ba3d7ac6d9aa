"""Rank program: hierarchical all-reduce over a dp group spanning 2 vendor islands equals a flat one.

``python hier_rank.py OUT_DIR`` with 4 ranks (nvidia:2,amd:2), pp=1 x dp=4, cross-vendor dp allowed.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from launcher import rank_exit

from bimetal.parallel import ParallelDims, init_parallel
from bimetal.parallel.hierarchical import all_reduce_gradients, hierarchical_all_reduce

torch.set_num_threads(1)
ctx = init_parallel(ParallelDims(pp=1, dp=4, allow_cross_vendor_dp=True), {"dp": "cpu-forward"},
                    timedelta(seconds=60), print_table=False)
h = ctx.hierarchical
result: dict[str, object] = {"has_groups": h is not None}
if h is not None:
    result["island_backend"] = str(dist.get_backend(h.island)) if h.island is not None else None
    result["cross_backend"] = str(dist.get_backend(h.cross))
    errors = []
    for n, dtype in ((1, torch.float32), (1001, torch.float32), (4096, torch.float64), (7, torch.bfloat16)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float32).to(dtype)
        expect = x.clone()
        dist.all_reduce(expect)  # flat, over the world (Gloo)
        got = hierarchical_all_reduce(x.clone(), h.island, h.cross, "sum")
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # summation order differs from the flat ring
        if not torch.allclose(got.double(), expect.double(), rtol=tol, atol=tol):
            errors.append(f"n={n} {dtype}: max diff {(got.double() - expect.double()).abs().max().item()}")
    grads = [torch.full((3, 5), float(ctx.rank)), torch.full((2,), 2.0 * ctx.rank)]
    all_reduce_gradients(grads, h.island, h.cross, "avg")
    if not (torch.allclose(grads[0], torch.full((3, 5), 1.5)) and torch.allclose(grads[1], torch.full((2,), 3.0))):
        errors.append(f"avg wrong: {grads[0][0, 0].item()} {grads[1][0].item()}")
    result["errors"] = errors
with open(os.path.join(sys.argv[1], f"rank{ctx.rank}.json"), "w") as f:
    json.dump(result, f)
ctx.destroy()
rank_exit()
