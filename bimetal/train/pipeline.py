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
from torch.distributed.fsdp import FSDPModule
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
    """What the schedule runs for one stage: the stage's model under autocast, its output in the boundary dtype.

    ``boundary_dtype`` is what crosses a pipeline boundary, activations forward and their gradients back (the
    gradient of a tensor has its dtype), and what the last stage's logits are held in until their backward:
    bf16 under bf16 autocast by default (``parallel.pp_boundary_dtype = "compute"``: half the bytes of float32
    on the cross-vendor link, as Megatron and torchtitan send), float32 on request. A received bf16 activation
    is widened to float32 on entry, so the residual stream inside a stage stays float32 as in a one-process run
    under autocast: a boundary adds one bf16 rounding of the activation and one of its gradient, nothing more.
    Under FSDP the root casts the input to its ``param_dtype`` itself (every block computes in it), so no
    widening is done there.
    """

    def __init__(self, inner: nn.Module, autocast_dtype: torch.dtype | None, device_type: str,
                 boundary_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inner = inner
        self.autocast_dtype, self.device_type, self.boundary_dtype = autocast_dtype, device_type, boundary_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self.inner(x)
        if x.is_floating_point() and x.dtype != torch.float32 and not isinstance(self, FSDPModule):
            x = x.float()
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            out = self.inner(x)
        return out.to(self.boundary_dtype)


def boundary_dtype(setting: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype at a stage boundary for ``parallel.pp_boundary_dtype``: the compute dtype, or float32."""
    return autocast_dtype if setting == "compute" and autocast_dtype is not None else torch.float32


def _on_meta(example: torch.Tensor) -> torch.Tensor:
    """Shape, dtype and requires_grad of ``example`` with no storage: the stage keeps only its metadata."""
    return torch.empty(example.shape, dtype=example.dtype, device="meta").requires_grad_(example.requires_grad)


def _tp_share(example: torch.Tensor, tp: int) -> torch.Tensor:
    """One tp rank's share of a boundary activation example (hidden dim split by ``tp``)."""
    return torch.empty(shard_stage_shape(tuple(example.shape), tp), dtype=example.dtype, device="meta")


class PipelineRunner:
    """One stage of a pipeline and its schedule; ``step`` runs forward+backward of all microbatches.

    With ``tp_mesh`` (tensor parallelism inside the stage) the activations that cross stages are this tp
    rank's ``1/tp`` share (``TPBoundary``); the examples passed in are the full shapes. Only the examples'
    shape, dtype and requires_grad are read (their dtype is the boundary's: the schedule allocates its receive
    buffers from them); they are best made on the meta device, and only meta copies are kept here.
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
        input_example, output_example = _on_meta(input_example), _on_meta(output_example)
        if not self.is_first and input_example.is_floating_point():
            input_example.requires_grad_(True)
        if output_example.is_floating_point():
            output_example.requires_grad_(True)
        # A StageModule is taken as it is: under FSDP it is the root FSDP module the schedule must see.
        self.module: nn.Module = (module if isinstance(module, StageModule)
                                  else StageModule(module, autocast_dtype, device.type, output_example.dtype))
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
        # return_outputs=False: otherwise the last stage keeps every microbatch's logits (output_chunks) until the
        # next step and concatenates them into one more copy, [batch, seq, vocab], that nothing here reads.
        kwargs: dict = {"return_outputs": False}
        if self.is_last:
            kwargs |= {"target": targets, "losses": losses}
        if self.is_first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        device = self.pipe_stage.device
        loss = (torch.stack([x.detach().float() for x in losses]).sum() if self.is_last
                else torch.zeros((), device=device))
        return broadcast_from_last(loss, self.group, self.num_stages)
