"""What the trainer applies to a stage from outside the model: activation checkpointing, then FSDP2.

Order as in torchtitan (tensor parallel first when it exists, then activation checkpointing, then FSDP), so
each transformer block is one checkpointed unit and one FSDP parameter group:

* **activation checkpointing**: ``full`` wraps every block of the stage with torch's checkpoint wrapper
  (non-reentrant: the block's activations are dropped after the forward and recomputed in the backward),
  ``selective`` wraps every ``every``-th block of the stage (the 1st, 2nd ... ``every``-th counted from 1);
* **FSDP2**: ``fully_shard`` on every block, then on the stage module as the root (embedding, final norm and
  output projection), over the stage-local mesh (``bimetal.parallel.mesh``). Parameters, gradients and
  AdamW state are then DTensors sharded on dim 0; a 2-D mesh makes it HSDP (reduce-scatter over the shard
  dimension, all-reduce of the shard over the replicate dimension).

When gradients are reduced: gradient sync is on for the last microbatch only, and each block
reduce-scatters from its own post-backward hook, so that traffic overlaps the backward of the blocks before
it. Without a pipeline ``set_gradient_sync`` does that; with one, the schedule's stage does
(``pp_comms.MeteredStage``: torch's stage, as torchtitan uses it, would keep sync off for every microbatch and
reduce-scatter all blocks after the last backward, in ``perform_reduce_grad``). ``reshard_after_forward`` is
off with a pipeline (torchtitan's default for pp): every microbatch would otherwise all-gather each block
twice more.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from bimetal.config import ActivationCheckpointConfig


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointConfig, stage: int = 0) -> list[str]:
    """Wrap the stage's blocks (``model.layers``) as ``cfg`` says for ``stage``; returns the global indices
    wrapped."""
    mode = cfg.stage_mode(stage)
    if mode == "none":
        return []
    wrapped = []
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for i, key in enumerate(list(layers.keys())):
        if mode == "full" or (i + 1) % cfg.every == 0:
            layers[key] = checkpoint_wrapper(layers[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped.append(key)
    return wrapped


def apply_fsdp(stage_module: nn.Module, model: nn.Module, mesh: Any, pipelined: bool,
               param_dtype: torch.dtype | None) -> None:
    """Shard ``model``'s blocks and then ``stage_module`` (which holds ``model``) over ``mesh``, in place.

    ``param_dtype`` (bf16 under autocast on GPUs) is the dtype blocks compute in and all-gather in;
    gradients are reduced in float32 either way.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = not pipelined
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for block in layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(stage_module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)


def materialize(model: Any, device: torch.device, seed: int) -> None:
    """Allocate a meta-device stage's own parts on ``device`` and give them their initial values, in place.

    Called once tensor parallelism, activation checkpointing and FSDP have been applied to the stage on the
    meta device, so a rank only ever allocates what it keeps (its tp slices, its FSDP shards) and never the
    unsharded stage. Values are those of a plain build (``Transformer.initial_value``: the whole tensor from
    a generator seeded by the parameter's name, on the CPU, one parameter at a time); a ``DTensor`` takes the
    piece its placements give this rank, cut locally (``src_data_rank=None``: no communication), so every
    split of the model (pp, tp, FSDP) starts from the same weights as one process.
    """
    model.to_empty(device=device)
    model.reset_buffers()  # RoPE frequencies, and the tie of output and embedding if to_empty undid it
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = model.initial_value(param_name(name), tuple(p.shape), seed)
            if isinstance(p, DTensor):
                piece = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(piece)
            else:
                p.copy_(full)


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Without a pipeline: reduce-scatter only in the last microbatch's backward (the others accumulate)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)


def param_name(name: str) -> str:
    """A parameter's name in the model as built: without the checkpoint wrapper's inserted prefix."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, else ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors: Any) -> int:
    """Bytes this rank holds for ``tensors``, read from the (local) tensors themselves."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank (shards only, under FSDP)."""
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optim": tensor_bytes(state)}
