"""Sharded training state in checkpoints: every shard owner writes its own shard, nothing is pickled over the wire.

Under FSDP2 the model and optimizer state of a stage are DTensors sharded on dim 0 over the stage's shard
group. DCP's collective save would plan them across ranks by exchanging pickled objects, which no bimetal
network path does (see ``checkpoint``). Instead each rank of the first replica group (``replicate_rank`` 0)
saves the *local* shards of its DTensors as plain tensors into its own part, ``stage<S>-shard<I>/``, with
``no_dist=True``, exactly as an unsharded stage is saved; the other replicas hold equal shards. What each
part holds is recorded as JSON in the rank's ``extra`` (shard dimension, shard count, and per tensor its
offset, rows and global rows), so the parts can be reassembled by concatenation without running torch's
sharding code. A load on the same layout reads the rank's own part into the local shards in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard


def part_name(stage: int, shard_rank: int | None) -> str:
    """The folder of this rank's part of a checkpoint: ``stage0`` unsharded, ``stage0-shard1`` sharded."""
    return f"stage{stage}" if shard_rank is None else f"stage{stage}-shard{shard_rank}"


def _offset(t: DTensor) -> tuple[int, int, int]:
    """(offset, rows, global rows) of this rank's dim-0 shard of ``t``."""
    placements = [p for p in t.placements if isinstance(p, Shard)]
    if len(placements) != 1 or placements[0].dim != 0:
        raise RuntimeError(f"a sharded state tensor has placements {t.placements}; expected one Shard(0)")
    mesh_dim = list(t.placements).index(placements[0])
    n, k = t.shape[0], t.device_mesh.size(mesh_dim)
    chunk = -(-n // k)  # torch.chunk, as FSDP2 shards
    start = min(t.device_mesh.get_local_rank(mesh_dim) * chunk, n)
    return start, t.to_local().shape[0], n


def to_local(state: Any, layout: dict[str, list[int]], path: str = "") -> Any:
    """``state`` with every DTensor replaced by its local shard (same storage); fills ``layout``."""
    if isinstance(state, dict):
        return {k: to_local(v, layout, f"{path}.{k}" if path else str(k)) for k, v in state.items()}
    if isinstance(state, list):
        return [to_local(v, layout, f"{path}.{i}") for i, v in enumerate(state)]
    if isinstance(state, DTensor):
        layout[path] = list(_offset(state))
        return state.to_local()
    return state


def merge_loaded(sharded: Any, loaded: Any) -> Any:
    """After a load into ``to_local(sharded)`` (shards filled in place): DTensors from ``sharded``, the
    rest (optimizer hyper-parameters, step counters) from ``loaded``."""
    if isinstance(sharded, dict):
        return {k: merge_loaded(v, loaded[k]) for k, v in sharded.items()}
    if isinstance(sharded, list):
        return [merge_loaded(v, w) for v, w in zip(sharded, loaded)]
    return sharded if isinstance(sharded, DTensor) else loaded


def assemble(parts: list[dict[str, torch.Tensor]], layouts: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Whole tensors from the flat ``{path: tensor}`` of every part of one stage, in shard order."""
    out: dict[str, torch.Tensor] = {}
    for key in parts[0]:
        if key not in layouts[0]:
            out[key] = parts[0][key]
            continue
        pieces = sorted(((lay[key][0], part[key]) for part, lay in zip(parts, layouts)), key=lambda x: x[0])
        whole = torch.cat([p for _, p in pieces])
        if whole.shape[0] != layouts[0][key][2]:
            raise RuntimeError(f"shards of {key} hold {whole.shape[0]} rows, expected {layouts[0][key][2]}")
        out[key] = whole
    return out
