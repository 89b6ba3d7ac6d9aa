"""Export of the trained model as a Hugging Face folder: gather every stage's weights, then ``export_hf``.

The gather goes to the rank holding stage 0 of replica 0 over the Gloo world, tensor by tensor (``pp_comms``);
that rank builds the whole model, fills it and writes ``config.json`` + safetensors with the models layer's
``export_hf``. Replicas hold equal weights after the dp average, so replica 0 speaks for each stage; with
tensor parallelism its tp ranks first gather their slices into whole tensors, and tp rank 0 sends them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from bimetal.errors import UserError
from bimetal.train.parallelize import param_name
from bimetal.train.pipeline import stage_of_param
from bimetal.train.pp_comms import gather_full_state
from bimetal.train.tp import full_tensor


def export_model(model: nn.Module, family: str, args: Any, split: list[int], ctx: Any, path: str | Path,
                 max_shard_bytes: int = 0) -> None:
    """Every rank calls this after training; the HF folder appears at ``path`` (written by one rank)."""
    from bimetal import models

    export_hf = getattr(models, "export_hf", None)
    if export_hf is None:
        raise UserError("this build has no bimetal.models.export_hf; leave checkpoint.export_hf empty.")
    rank = ctx.rank if ctx else 0
    dst = ctx.layout.mesh[0][0][0] if ctx else 0
    owners = [ctx.layout.mesh[s][0][0] for s in range(len(split))] if ctx else [0]
    full = models.build_model(family, args) if rank == dst else None
    # Names are those of the whole model; a stage's own parameters carry the same names.
    names = [n for n, _ in (full or models.build_model(family, args, device="meta")).named_parameters()]
    stage_names = [[n for n in names if stage_of_param(n, split) == s] for s in range(len(split))]
    # A tensor-parallel stage gathers each split weight over its tp group first, a sharded (FSDP) one over its
    # shard group (every rank of the mesh takes part); names lose the activation-checkpoint wrapper's prefix.
    own = {param_name(n): full_tensor(p.detach()) for n, p in model.named_parameters()}
    target: dict[str, torch.Tensor] = dict(full.named_parameters()) if full is not None else {}
    with torch.no_grad():
        gather_full_state(own, target, owners, rank, dst, stage_names)
    if rank == dst and full is not None:
        export_hf(full, args, str(path), max_shard_bytes)
        print(f"exported the trained model to {path}", flush=True)
    if ctx is not None:
        torch.distributed.barrier()
