"""Which GPU this rank drives: the one place bimetal decides it, before any process group exists.

The launcher says it: torchrun sets ``LOCAL_RANK``; ``srun`` without torchrun sets ``SLURM_LOCALID``; the
vendors' visibility variables (``CUDA_VISIBLE_DEVICES``; on ROCm ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` too) decide which GPUs the runtime shows, and torch counts only those. So:

* one visible GPU: that GPU (index 0), whatever the local rank: a scheduler that binds one GPU per task
  (Slurm ``--gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``) renumbers it to 0 in every task;
* several: GPU ``local rank`` of them; a local rank with no GPU of its own is one sentence (a launcher
  that starts more ranks per node than there are GPUs would otherwise share GPU 0, or fail in NCCL);
* no GPU (a CPU build) and simulation: the CPU; ``BIMETAL_SIMULATE_DEVICE=cuda`` puts every simulated rank on
  GPU 0 of the one machine (the GPU check shares it).

``bind_rank_device`` makes the choice current (``torch.cuda.set_device``) and is called first thing by the
trainer, ``bimetal topo`` and ``bimetal titan``, so NCCL/RCCL and every buffer made later land on the rank's
own GPU; the transports ask ``rank_device`` for their group's device rather than reading "the current device"
(a per-thread setting another library may have changed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from bimetal import env
from bimetal.errors import UserError
from bimetal.topology.vendor import is_simulated

VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
"""The vendors' variables that decide which GPUs a process sees (torch's device count honours them)."""


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID`` (srun), else 0."""
    environ = os.environ if environ is None else environ
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        raw = environ.get(name, "").strip()
        if raw:
            if not raw.isdigit():
                raise UserError(f"{name}={raw!r} is not a local rank; the launcher must set it to 0, 1, 2, ...")
            return int(raw)
    return 0


def _launcher_variable(environ: Mapping[str, str]) -> str:
    return "LOCAL_RANK" if environ.get("LOCAL_RANK", "").strip() else (
        "SLURM_LOCALID" if environ.get("SLURM_LOCALID", "").strip() else "LOCAL_RANK")


def visibility(environ: Mapping[str, str] | None = None) -> str:
    """The visibility variables that are set, as ``NAME=value`` (for messages); ``no visibility variable set``."""
    environ = os.environ if environ is None else environ
    shown = [f"{name}={environ[name]}" for name in VISIBILITY if name in environ]
    return ", ".join(shown) or "no visibility variable set"


def rank_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """This rank's device by the rules of the module docstring; ``UserError`` when its local rank has no GPU."""
    environ = os.environ if environ is None else environ
    simulated = is_simulated(dict(environ))
    if simulated:
        wants_gpu = env.read("BIMETAL_SIMULATE_DEVICE", environ) == "cuda"
        return torch.device("cuda", 0) if wants_gpu and torch.cuda.is_available() else torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    mine = local_rank(environ)
    if count == 1:
        return torch.device("cuda", 0)
    if mine < count:
        return torch.device("cuda", mine)
    name = _launcher_variable(environ)
    raise UserError(f"{name}={mine} has no GPU of its own: this process sees {count} GPUs ({visibility(environ)}); "
                    f"start at most {count} ranks on this node, or give each rank one GPU with a per-rank "
                    "CUDA_VISIBLE_DEVICES (ROCm: ROCR_VISIBLE_DEVICES) or Slurm's --gpus-per-task=1.")


def bind_rank_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """``rank_device()``, made this process's current device (call it before any process group exists)."""
    device = rank_device(environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def describe(device: torch.device) -> str:
    """``cuda:3`` or ``cpu``: how the cluster view shows a rank's device."""
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
