"""torchtitan's own ``Trainer``, started on bimetal's world and mesh back-ends.

Public extension points only, apart from ``_torch_hooks``:

* ``BimetalTrainer`` overrides ``Trainer.init_distributed`` (a method torchtitan keeps overridable): bimetal
  creates the world group on a back-end that can span vendors before torchtitan would create one with
  NCCL/RCCL, learns every rank's vendor over the store, and returns a ``BimetalParallelDims``;
* ``BimetalParallelDims`` subclasses torchtitan's ``ParallelDims``: ``build_mesh`` runs torchtitan's own
  mesh construction while ``_torch_hooks.mesh_backends`` gives each dimension its back-end, then rank 0
  prints the group table. The mesh is built eagerly, so a refused dimension stops the job before the model.

* ``BimetalTrainer.pp_forward_backward_step`` hands every pipeline rank the loss of the last stage (a sum over
  the pp group of the last stage's loss and zeros, so the value is unchanged bit for bit) on steps that log:
  each rank's step line shows the loss, not torchtitan's ``-1`` placeholder of the stages before the last (and
  torchtitan's advice to add the last stage's rank to ``LOG_RANK`` is dropped: it no longer applies);
* ``BimetalTrainer.train_step`` notes each completed step for bimetal's launcher (a crashed rank is named with its
  last step) and runs bimetal's fault injection (``bimetal.faults``; nothing unless its variable is set).

After training, ``report`` writes ``<dump_folder>/bimetal/rank<r>.json``: the per-step losses this rank logged
(on every rank: a stage before the last logs the last stage's), whether it holds the last stage, and every mesh
dimension's back-end, ranks and (for bimetal transports) byte counters; a per-hop pp group lists each of this
rank's pairs (``hops``) and its collectives group.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from bimetal import faults, transports
from bimetal.comm.registry import register_backends
from bimetal.integrations.common import world_backend
from bimetal.integrations.torchtitan import cpu_support
from bimetal.integrations.torchtitan._torch_hooks import mesh_backends
from bimetal.integrations.torchtitan.mesh import MeshBackends
from bimetal.parallel.context import _init_world
from bimetal.plan.titan_split import part_ranks
from bimetal.supervisor import report_step
from bimetal.topology.exchange import exchange_topology
from bimetal.topology.local_device import bind_rank_device
from bimetal.topology.vendor import detect_vendor, is_simulated


@dataclass
class BimetalOptions:
    """What ``bimetal titan`` adds to a torchtitan job."""

    pp_transport: str = transports.DEFAULT
    """Transport of cross-vendor pp groups: ``cpu-forward`` or ``device-direct``."""
    all_gloo: bool = False
    """Reference run: every group on plain Gloo, no vendor rules (simulation only)."""
    cpu: bool = False
    """CPU stand-ins are installed (``cpu_support``): FSDP then reduces with SUM (no PREMUL_SUM in Gloo)."""


class BimetalParallelDims(ParallelDims):
    """torchtitan's ``ParallelDims`` whose mesh dimensions get bimetal's per-dimension back-ends."""

    backends: MeshBackends

    def build_mesh(self) -> Any:
        with mesh_backends(self.backends):
            mesh = super().build_mesh()
        if dist.get_rank() == 0:
            print("bimetal groups (torchtitan mesh):\n" + self.backends.table(), flush=True)
        return mesh


class BimetalTrainer(Trainer):
    """torchtitan's trainer on a bimetal world; everything else is torchtitan's."""

    def __init__(self, config: Any, options: BimetalOptions | None = None) -> None:
        self.bimetal = options or BimetalOptions()
        self.losses: list[dict[str, float]] = []
        logging.getLogger().addFilter(_drop_loss_rank_advice)  # torchtitan's logger is the root logger
        super().__init__(config)
        if self.bimetal.cpu:
            cpu_support.sum_reduction_for_fsdp(self.model_parts)
        log = self.metrics_processor.log

        def log_and_keep(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
            self.losses.append({"step": step, "loss": float(global_avg_loss)})
            return log(step, global_avg_loss, *args, **kwargs)

        self.metrics_processor.log = log_and_keep  # type: ignore[method-assign]

    def init_distributed(self) -> ParallelDims:
        timeout = timedelta(seconds=self.config.comm.init_timeout_seconds)
        # before the world exists: the rank's GPU as bimetal's rules choose it (``run_rank`` bound it already,
        # before torchtitan's own choice, which follows the same rules; a difference would be a bug)
        device = bind_rank_device()
        if device.type != "cpu" and self.device != device:
            raise RuntimeError(f"torchtitan chose {self.device} but bimetal {device} for this rank")
        register_backends()
        torch.autograd.set_multithreading_enabled(False)  # as torchtitan's own init_distributed does
        vendor = detect_vendor(int(os.environ.get("RANK", "0")))
        if not dist.is_initialized():
            _init_world("gloo" if self.bimetal.all_gloo else world_backend(vendor), timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        view = exchange_topology(dist.distributed_c10d._get_default_store(), rank, world, timeout)
        if rank == 0:
            print("bimetal cluster view:\n" + view.format_table(), flush=True)
        dims = BimetalParallelDims.from_config(self.config.parallelism, world)
        assert isinstance(dims, BimetalParallelDims)
        dims.backends = MeshBackends([view.vendor_of(r) for r in range(world)], self.bimetal.pp_transport,
                                     simulated=is_simulated(), all_gloo=self.bimetal.all_gloo,
                                     stage_owners=stage_owners(self.config.parallelism),
                                     timeout_s=timeout.total_seconds())
        dims.build_mesh()
        return dims

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        report_step(self.step)  # for the launcher's sentence if this rank dies; no-op outside bimetal's launcher
        faults.after_step(dist.get_rank(), self.step)

    def pp_forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        loss = super().pp_forward_backward_step(**kwargs)
        if not self.metrics_processor.should_log(self.step):
            return loss
        # Every rank of the pipeline calls this at the same steps. The last stage's loss plus zeros is that loss
        # exactly (NaN and inf included), on every stage.
        if self.pp_has_last_stage:
            mine = logged_value(loss.detach(), self.parallel_dims.dp_cp_enabled).reshape(1).float().clone()
        else:
            mine = torch.zeros(1, device=self.device)
        dist.all_reduce(mine, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss if self.pp_has_last_stage else mine.reshape(())

    def report(self) -> Path:
        """Write this rank's losses and mesh groups (back-end, ranks, byte counters) as JSON; returns the path."""
        groups: dict[str, Any] = {}
        for name, mesh in self.parallel_dims.get_all_one_dimensional_meshes().items():
            pg = mesh.get_group()
            counters = getattr(pg, "counters", None)
            groups[name] = {
                "backend": str(dist.get_backend(pg)),
                "ranks": dist.get_process_group_ranks(pg),
                "counters": counters.snapshot() if counters is not None else None,
            }
            if hasattr(pg, "routes"):  # a per-hop pipeline group: its pairs and its collectives group
                groups[name]["hops"] = {r.name: _group_record(r.send, r.backend) for r in pg.routes.values()}
                groups[name]["collectives"] = _group_record(pg.collectives, str(dist.get_backend(pg.collectives)))
        rank = dist.get_rank()
        last = self.pp_has_last_stage if self.parallel_dims.pp_enabled else True
        out = Path(self.config.dump_folder) / "bimetal" / f"rank{rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rank": rank, "vendor": detect_vendor(rank), "last_stage": bool(last),
                                   "losses": self.losses, "groups": groups}, indent=1))
        return out


def logged_value(loss: torch.Tensor, dp_cp_enabled: bool) -> torch.Tensor:
    """The plain tensor whose value torchtitan's ``train_step`` logs for a last stage's ``loss``.

    Under tensor parallelism the loss is a DTensor on the tp mesh. With data or context parallelism torchtitan
    reduces its ``to_local()`` over the loss mesh (``dist_utils._dist_reduce_tensor``), and a stage before the last
    reduces the value handed to it over its own loss mesh of the same size, so the local value is what it needs;
    without them torchtitan logs ``loss.item()``, the DTensor's full value (the local one when replicated).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(loss, DTensor):
        return loss
    return loss.to_local() if dp_cp_enabled else loss.full_tensor()


def _drop_loss_rank_advice(record: logging.LogRecord) -> bool:
    """False for torchtitan's "Pipeline Parallel loss is not visible ... add rank N to LOG_RANK": every rank shows
    the loss under bimetal (``pp_forward_backward_step``)."""
    return "loss is not visible" not in str(record.msg)


def _group_record(pg: Any, backend: str) -> dict[str, Any]:
    counters = getattr(pg, "counters", None)
    return {"backend": backend, "ranks": dist.get_process_group_ranks(pg),
            "counters": counters.snapshot() if counters is not None else None}


def stage_owners(par: Any) -> list[int] | None:
    """The pp rank of each (virtual) stage torchtitan builds for ``parallelism``; None without a pipeline.

    A single-stage schedule (1F1B, GPipe) puts one stage on each rank; a multi-stage one two or more, in torchtitan's
    loop or V style (``plan.titan_split.part_ranks``): which ranks exchange activations depends only on the style.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    pp = par.pipeline_parallel_degree
    if pp <= 1:
        return None
    single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
    return part_ranks(pp, 1 if single else 2, par.pipeline_parallel_schedule)
