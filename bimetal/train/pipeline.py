"""Pipeline parallelism: which layers a stage holds and how a step runs (1F1B or GPipe).

Built on ``torch.distributed.pipelining`` with the pp group passed explicitly, so the same code runs over
Gloo, ``bimetal_cpu_forward`` and ``bimetal_device_direct``. The loss lives on the last stage; after the
schedule it is broadcast over the pp group so every rank reports the same number. The collectives and the
byte/time counters are in ``pp_comms``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from bimetal.errors import UserError
from bimetal.train.pp_comms import MeteredStage, TPBoundary, broadcast_from_last
from bimetal.train.tp import shard_stage_shape

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_layer_ids(split: list[int], stage: int) -> list[int]:
    """Global layer indices held by ``stage`` for a split like ``[3, 1]`` (stage 1 -> ``[3]``)."""
    start = sum(split[:stage])
    return list(range(start, start + split[stage]))


def stage_of_param(name: str, split: list[int]) -> int:
    """The stage that holds the whole-model parameter ``name`` (``layers.3.attention.wq.weight`` -> 1)."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s in range(len(split)) if layer in stage_layer_ids(split, s))
    return len(split) - 1  # final norm and output projection


class StageModule(nn.Module):
    """What the schedule runs for one stage: the stage's model under autocast, float32 at the boundary.

    Activations cross stages in float32 whatever the compute dtype, so the tensors the schedule allocates
    for receives have one fixed dtype and the residual stream is not rounded at a stage boundary.
    """

    def __init__(self, inner: nn.Module, autocast_dtype: torch.dtype | None, device_type: str) -> None:
        super().__init__()
        self.inner = inner
        self.autocast_dtype, self.device_type = autocast_dtype, device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self.inner(x)
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            out = self.inner(x)
        return out.float()


def _tp_share(example: torch.Tensor, tp: int) -> torch.Tensor:
    """One tp rank's share of a boundary activation example (hidden dim split by ``tp``)."""
    return torch.zeros(shard_stage_shape(tuple(example.shape), tp), dtype=example.dtype, device=example.device)


class PipelineRunner:
    """One stage of a pipeline and its schedule; ``step`` runs forward+backward of all microbatches.

    With ``tp_mesh`` (tensor parallelism inside the stage) the activations that cross stages are this tp
    rank's ``1/tp`` share (``TPBoundary``); the examples passed in are the full shapes.
    """

    def __init__(self, module: nn.Module, stage: int, num_stages: int, group: dist.ProcessGroup | None,
                 microbatches: int, schedule: str, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, input_example: torch.Tensor, output_example: torch.Tensor,
                 autocast_dtype: torch.dtype | None = None, tp_mesh: DeviceMesh | None = None) -> None:
        if schedule not in SCHEDULES:
            raise UserError(f"parallel.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}.")
        self.stage, self.num_stages, self.group = stage, num_stages, group
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        tp = tp_mesh.size() if tp_mesh is not None else 1
        if tp > 1:
            input_example = input_example if self.is_first else _tp_share(input_example, tp)
            output_example = output_example if self.is_last else _tp_share(output_example, tp)
        # Explicit microbatch shapes: the schedule's own shape inference ships pickled objects between ranks.
        # The examples' requires_grad tells the stage which activations carry gradients back.
        if not self.is_first and input_example.is_floating_point():
            input_example = input_example.detach().requires_grad_(True)
        if output_example.is_floating_point():
            output_example = output_example.detach().requires_grad_(True)
        # A StageModule is taken as it is: under FSDP it is the root FSDP module the schedule must see.
        self.module: nn.Module = (module if isinstance(module, StageModule)
                                  else StageModule(module, autocast_dtype, device.type))
        if tp > 1 and tp_mesh is not None:
            self.module = TPBoundary(self.module, tp_mesh, not self.is_first, not self.is_last)
        self.pipe_stage = MeteredStage(self.module, stage, num_stages, device, input_args=(input_example,),
                                       output_args=(output_example,), group=group)
        # Each microbatch's loss is divided by the microbatch count before its backward, as the single-process
        # loop does, instead of the schedule dividing every gradient after the step (scale_grads): that would
        # also divide the gradients earlier accumulation steps left in .grad.
        self.microbatches, self._loss_fn = microbatches, loss_fn
        self.schedule = SCHEDULES[schedule](self.pipe_stage, n_microbatches=microbatches, loss_fn=self._scaled_loss,
                                            scale_grads=False)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target) / self.microbatches

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """Run the schedule; returns the mean microbatch loss (a 0-d float tensor) on every stage."""
        losses: list[torch.Tensor] = []
        kwargs: dict = {}
        if self.is_last:
            kwargs = {"target": targets, "losses": losses}
        if self.is_first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        device = self.pipe_stage.device
        loss = (torch.stack([x.detach().float() for x in losses]).sum() if self.is_last
                else torch.zeros((), device=device))
        return broadcast_from_last(loss, self.group, self.num_stages)
