"""Optimizer glue: AdamW, warm-up + cosine schedule, dp gradient averaging, global-norm clipping.

The clip norm is one scalar over every stage and replica: each rank sums the squares of its own gradients
(its stage's parameters), the sum is all-reduced over the pp group (stages hold disjoint parameters), and
replicas hold equal averaged gradients after the dp all-reduce, so no dp reduction is needed for the norm.
Tensor-parallel parameters (``DTensor``s) are reduced on their local slices: every tp rank of a replica holds
its own slice of each split gradient, and the squares of split gradients are summed over their mesh.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from bimetal.config import OptimConfig
from bimetal.parallel.hierarchical import all_reduce_gradients


def adamw_implementation(device_type: str) -> dict[str, bool]:
    """How AdamW runs its update on ``device_type``: fused on GPUs, foreach (multi-tensor) elsewhere.

    fused is one kernel per parameter group on CUDA and ROCm (DTensor parameters of FSDP2 and tp included);
    on the CPU, where bimetal only simulates, foreach. Both are deterministic: the update of one element does
    not depend on which other tensors share the call, so a stage updates its parameters exactly as the
    whole model in one process does, and a resumed run repeats an uninterrupted one bit for bit.
    """
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed).

    ``device_type`` picks the implementation (default: that of the parameters' device); tests pass ``cuda`` on
    the CPU to run the fused kernel, whose CPU build takes DTensor parameters the same way as the GPU one.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    impl = adamw_implementation(device_type or (params[0].device.type if params else "cpu"))
    groups: list[dict[str, Any]] = []
    for members, decay in (([p for p in params if p.dim() >= 2], cfg.weight_decay),
                           ([p for p in params if p.dim() < 2], 0.0)):
        group: dict[str, Any] = {"params": members, "weight_decay": decay}
        if len({isinstance(p, DTensor) for p in members}) > 1:
            # tp without FSDP leaves norm weights plain tensors beside split (DTensor) qkv biases: the
            # multi-tensor and fused kernels refuse a list that mixes the two, so this group updates one tensor
            # at a time (the same arithmetic, only slower; it holds vectors, a small share of the update).
            group |= {"foreach": False, "fused": False}
        groups.append(group)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warm-up, then cosine down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step LambdaLR applying ``lr_factor``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, cfg.warmup_steps, cfg.min_lr_ratio))


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None, size: int, hierarchical: Any = None) -> int:
    """Average gradients over the dp group of ``size`` ranks: one flat buffer per dtype rather than one op per
    tensor (``bimetal.parallel.hierarchical.all_reduce_gradients``).

    ``hierarchical`` (``ParallelContext.hierarchical``, set when the dp group spans vendors) switches to the
    two-level reduction: reduce-scatter inside this rank's vendor island on the native back-end, all-reduce
    of the shard across islands on the bimetal transport, all-gather inside the island. Only ``1/island``
    of the gradient bytes then cross vendors, and the native library does the rest.
    Returns the bytes this rank handed to the cross-island all-reduce (0 without ``hierarchical``).
    """
    if size <= 1:
        return 0
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0
    if hierarchical is None:
        all_reduce_gradients(grads, None, group)
        return 0
    island = hierarchical.island if hierarchical.island_size > 1 else None
    return all_reduce_gradients(grads, island, hierarchical.cross)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a ``DTensor`` (a view of its storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _split(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor (FSDP over TP gives ``_StridedShard``, not a ``Shard``)."""
    return isinstance(placement, (Shard, _StridedShard))


def _squares(grads: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Sum of squares of every gradient, each counted once however it is split over tp meshes."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    split: dict[tuple[Any, tuple[int, ...]], torch.Tensor] = {}
    for g in grads:
        part = _local(g).detach().float().pow(2).sum()
        if isinstance(g, DTensor) and any(_split(pl) for pl in g.placements):
            # Summed over the mesh dims it is split along (replicated dims hold copies: counted once).
            key = (g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if _split(pl)))
            split[key] = split.get(key, torch.zeros_like(sq)) + part
        else:
            sq += part
    for (mesh, dims), part in split.items():
        for i in dims:
            dist.all_reduce(part, group=mesh.get_group(i))
        sq += part
    return sq


def clip_global_norm(model: nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None, pp_size: int,
                     counted: bool = True) -> float:
    """Clip to ``max_norm`` by the norm over all stages; returns the norm before clipping. ``counted=False``: this
    rank's stage is counted by another rank (per-stage shapes sum over the world, ``pp_group`` None: one rank per
    stage adds its stage's squares)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = _squares(grads, grads[0].device if grads else "cpu")
    if not counted:
        sq = torch.zeros_like(sq)
    if pp_size > 1 and pp_group is None:  # the world: Gloo on CPU tensors, whatever the device
        host = sq.cpu()
        dist.all_reduce(host)
        sq = host.to(sq.device)
    elif pp_size > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
