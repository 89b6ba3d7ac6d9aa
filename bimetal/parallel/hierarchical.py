"""Hierarchical all-reduce for a data-parallel group that spans vendor islands.

Three steps, so that the slow cross-vendor link carries each byte once and every rank of an island
drives its own share (all NICs of the island work in parallel):
1. native reduce-scatter inside each island: rank j of the island holds the island's sum of shard j;
2. cross-island all-reduce of shard j among the ranks holding shard j, one per island (cpu-forward or
   device-direct);
3. native all-gather inside each island.
Islands must have equal sizes (the layout refuses others: ``bimetal.parallel.groups``). The result
equals a flat all-reduce up to floating-point summation order. ``all_reduce_gradients`` is the trainer's
gradient averaging over dp (``bimetal.train.optim``), hierarchical or flat.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bimetal.errors import UserError


def hierarchical_all_reduce(tensor: torch.Tensor, island: dist.ProcessGroup | None,
                            cross: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over island x cross (``island`` None: over ``cross`` alone; ``cross`` None:
    the default group); ``op`` is ``"sum"`` or ``"avg"``."""
    if op not in ("sum", "avg"):
        raise UserError(f"hierarchical all-reduce supports op 'sum' or 'avg', not {op!r}")
    island_size = dist.get_world_size(island) if island is not None else 1
    total = island_size * dist.get_world_size(cross)
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
    if island is None:
        dist.all_reduce(flat, group=cross)
    else:
        shard_len = -(-flat.numel() // island_size)  # pad so every island rank gets an equal shard
        padded = torch.zeros(shard_len * island_size, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        shard = torch.empty(shard_len, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(shard, padded, group=island)
        dist.all_reduce(shard, group=cross)
        dist.all_gather_into_tensor(padded, shard, group=island)
        flat.copy_(padded[:flat.numel()])
    if op == "avg":
        flat.div_(total)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(flat.view(tensor.shape))
    return tensor


def all_reduce_gradients(grads: list[torch.Tensor], island: dist.ProcessGroup | None,
                         cross: dist.ProcessGroup | None, op: str = "avg") -> int:
    """All-reduce a list of gradients in place, bucketed into one flat buffer per dtype: hierarchically over
    island x cross, or (``island`` None) one all-reduce over ``cross``. Returns the bytes this rank handed to the
    ``cross`` all-reduce (with an island, its shard of each bucket)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    island_size = dist.get_world_size(island) if island is not None else 1
    handed = 0
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        hierarchical_all_reduce(flat, island, cross, op)
        handed += -(-flat.numel() // island_size) * flat.element_size()
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return handed
