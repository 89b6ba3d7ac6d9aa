"""Pipeline parallelism: which layers a stage holds and how a step runs (1F1B or GPipe).

Built on ``torch.distributed.pipelining`` with the pp group passed explicitly, so the same code runs over
Gloo, ``bimetal_cpu_forward`` and ``bimetal_device_direct``. The loss lives on the last stage; after the
schedule it is broadcast over the pp group so every rank reports the same number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from bimetal.errors import UserError

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_layer_ids(split: list[int], stage: int) -> list[int]:
    """Global layer indices held by ``stage`` for a split like ``[3, 1]`` (stage 1 -> ``[3]``)."""
    start = sum(split[:stage])
    return list(range(start, start + split[stage]))


class PipelineRunner:
    """One stage of a pipeline and its schedule; ``step`` runs forward+backward of all microbatches."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int, group: dist.ProcessGroup | None,
                 microbatches: int, schedule: str, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, input_example: torch.Tensor, output_example: torch.Tensor) -> None:
        if schedule not in SCHEDULES:
            raise UserError(f"parallel.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}.")
        self.stage, self.num_stages, self.group = stage, num_stages, group
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        # Explicit microbatch shapes: the schedule's own shape inference ships pickled objects between ranks.
        # The examples' requires_grad tells the stage which activations carry gradients back.
        if not self.is_first and input_example.is_floating_point():
            input_example = input_example.detach().requires_grad_(True)
        if output_example.is_floating_point():
            output_example = output_example.detach().requires_grad_(True)
        self.pipe_stage = PipelineStage(module, stage, num_stages, device, input_args=(input_example,),
                                        output_args=(output_example,), group=group)
        self.schedule = SCHEDULES[schedule](self.pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)

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
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.is_last else torch.zeros(())
        if self.num_stages > 1:
            last = self.num_stages - 1
            src = dist.get_global_rank(self.group, last) if self.group is not None else last
            dist.broadcast(loss, src=src, group=self.group)
        return loss
