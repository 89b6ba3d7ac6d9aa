"""Rank program: torch's parallel machinery on cpu-forward gives the same numbers as on plain Gloo.

``python cf_parallel_rank.py OUT_DIR`` under ``bimetal launch`` with 2 ranks. Cases: DeviceMesh with
``backend_override`` + DTensor redistribute, a DDP step, an FSDP2 step, a 1F1B pipeline step. Each rank
writes ``OUT_DIR/rank<r>.json`` with ``{case: detail}`` ("" when equal).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import bimetal  # noqa: F401  (registers the back-ends)

torch.set_num_threads(1)
CF = "bimetal_cpu_forward"


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def grads(m: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in m.parameters():
        g = p.grad
        out.append((g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone())
    return out


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.allclose(x, y, rtol=1e-6, atol=1e-7):
            return f"tensor {i} differs by {(x - y).abs().max().item():.3g}"
    return ""


def case_dtensor(rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",), backend_override={"x": CF})
    pg = mesh.get_group("x")
    if type(pg).__name__ != "CpuForwardProcessGroup":
        return f"mesh group is {type(pg).__name__}"
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    back = dt.redistribute(mesh, [Replicate()]).to_local()
    resharded = dt.redistribute(mesh, [Shard(1)]).to_local()
    partial_sum = (dt * 2).sum()  # a reduction through the mesh group
    err = "" if torch.equal(back, full) else "Shard(0) -> Replicate lost data"
    err = err or ("" if torch.equal(resharded, full[:, rank * 3:(rank + 1) * 3]) else "Shard(0) -> Shard(1) wrong")
    return err or ("" if partial_sum.full_tensor().item() == 2 * full.sum().item() else "sum wrong")


def case_ddp(rank: int, groups: dict[str, dist.ProcessGroup]) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, pg in groups.items():
        m = DDP(model(), process_group=pg, bucket_cap_mb=0.001)  # several buckets
        x, y = batch(rank)
        nn.functional.mse_loss(m(x), y).backward()
        out[name] = grads(m)
    return diff(out["cf"], out["gloo"])


def case_fsdp2(rank: int, groups: dict[str, dist.ProcessGroup]) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, pg in groups.items():
        mesh = DeviceMesh.from_group(pg, "cpu")
        m = model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        x, y = batch(rank)
        nn.functional.mse_loss(m(x), y).backward()
        out[name] = grads(m)
    return diff(out["cf"], out["gloo"])


def case_pipeline(rank: int, groups: dict[str, dist.ProcessGroup]) -> str:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    full = model()
    out = {}
    for name, pg in groups.items():
        stage_mod = copy.deepcopy(full[:2] if rank == 0 else full[2:])
        stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"), group=pg,
                              # requires_grad on the examples: which activations carry gradients back
                              input_args=(torch.empty(2, 16),) if rank == 0 else (torch.empty(2, 32,
                                                                                             requires_grad=True),),
                              output_args=(torch.empty(2, 32, requires_grad=True),) if rank == 0
                              else (torch.empty(2, 4, requires_grad=True),))
        sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
        x, y = batch(0)
        if rank == 0:
            sched.step(x)
        else:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
        out[name] = grads(stage_mod)
    return diff(out["cf"], out["gloo"])


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    groups = {"cf": dist.new_group(backend=CF, group_desc="cf"), "gloo": dist.new_group(backend="gloo")}
    results = {}
    cases = (("dtensor", lambda: case_dtensor(rank)), ("ddp", lambda: case_ddp(rank, groups)),
             ("fsdp2", lambda: case_fsdp2(rank, groups)), ("pipeline_1f1b", lambda: case_pipeline(rank, groups)))
    for name, fn in cases:
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
