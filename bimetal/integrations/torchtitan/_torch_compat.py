"""Adapters for the two torch APIs torchtitan 0.3.0 calls that torch 2.13 does not have.

Installed by every ``bimetal titan`` rank (GPU or CPU), each only when torch lacks the API, so a newer torch
runs unchanged:

* ``torch.distributed.set_timeout(timeout, group)`` (torchtitan shortens timeouts after step 1): 2.13 has
  ``ProcessGroup.set_timeout``; a bimetal transport (a Python ProcessGroup) keeps its own timeout.
* ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (microbatches already split): 2.13's
  ``step`` takes a whole batch; the adapter runs its per-step set-up and hands the microbatches to
  ``_step_microbatches`` (private; checked against torch 2.13.0), as newer torch does.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def install() -> None:
    """Install whichever adapters this torch needs (idempotent)."""
    _set_timeout()
    _pipeline_step()


def _set_timeout() -> None:
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: Any = None) -> None:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if isinstance(pg, dist.ProcessGroup) and type(pg) is dist.ProcessGroup:
            pg.set_timeout(timeout)  # 2.13 has the method on the group, not the module function
        # a bimetal transport (a Python ProcessGroup) keeps the timeout it was created with

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def _pipeline_step() -> None:
    from torch.distributed.pipelining import schedules

    if "arg_mbs" in inspect.signature(schedules._PipelineSchedule.step).parameters:
        return
    if getattr(schedules.PipelineScheduleSingle.step, "_bimetal_adapted", False):
        return
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = _wrap_step(cls.step)  # type: ignore[method-assign]


def _wrap_step(step: Any) -> Any:
    def adapted(self: Any, *args: Any, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
                losses: Any = None, return_outputs: bool = True, loss_kwargs: Any = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                        **kwargs)
        # torch 2.13's step() splits a whole batch; the microbatches are already split, so run its
        # per-step set-up and hand them to _step_microbatches, as newer torch does.
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        return None

    adapted._bimetal_adapted = True  # type: ignore[attr-defined]
    return adapted
