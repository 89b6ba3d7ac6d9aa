"""Tensor parallelism inside one vendor island: which weights are split, and how (Megatron layout).

Applied from outside to a single-device stage (``bimetal.models`` knows nothing of it) with torch's
``parallelize_module`` on a 1-D ``DeviceMesh`` built from the context's tp group (native back-end: NCCL/RCCL,
or the simulated native Gloo). Per block: ``wq``/``wk``/``wv`` and ``w1``/``w3`` column-parallel (each rank
holds ``n_heads/tp`` query heads, ``n_kv_heads/tp`` key/value heads and ``ffn_dim/tp`` hidden units),
``wo`` and ``w2`` row-parallel (their partial sums are all-reduced, so a block's output is replicated).
The attention derives its local head count from the tensor shape, which is why the model needs no tp
argument. Norm weights stay whole, replicated on every tp rank (their gradients are equal on every rank).

Embedding and output head are split along the vocabulary too (row-parallel embedding: out-of-shard ids
masked, partial rows all-reduced; column-parallel output projection whose logits are all-gathered): the
two vocabulary matrices are the largest of an 8B model (2 x 0.5 G parameters for LLaMA-3) and this keeps
their weights, gradients and AdamW state at ``1/tp`` per rank. The logits are gathered rather than kept
vocab-sharded with loss parallel because the pipeline schedule calls the loss on plain tensors, and a
single-stage run uses the same loss function; gathered logits cost ``b*s*V`` activation memory per
microbatch, as at tp=1. Sequence parallel is not applied (the model computes RoPE tables from its input
length, which a sequence shard would shorten).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from bimetal.errors import UserError
from bimetal.models.args import check_tp as check_tp  # the model-shape check, for the callers of this module
from bimetal.models.transformer import Transformer

# Per transformer block: module path -> how its weight is split.
_BLOCK_PLAN = {
    "attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
    "feed_forward.w1": "col", "feed_forward.w3": "col", "feed_forward.w2": "row",
}


def _replicated_input(n_args: int) -> PrepareModuleInput:
    """Mark a sub-module's first input replicated once, so the input gradients of all its column-parallel
    projections add up as partial sums and are all-reduced once (not once per projection)."""
    rest = (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=(Replicate(), *rest), desired_input_layouts=(Replicate(), *rest),
                              use_local_output=False)


def tp_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A 1-D mesh over this rank's existing tp group (no new communicator is created)."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))


def apply_tp(stage: Transformer, mesh: DeviceMesh) -> Transformer:
    """Split ``stage`` (a ``Transformer`` or a pipeline stage of one) over ``mesh`` in place; returns it.

    Parameters become ``DTensor``s sharded on the mesh; every rank must hold the same full weights before
    the call (the per-name deterministic init guarantees it), since each keeps its own slice.
    """
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in stage.layers.values():
        plan: dict[str, Any] = {path: styles[kind]() for path, kind in _BLOCK_PLAN.items()}
        plan.update({"attention": _replicated_input(3), "feed_forward": _replicated_input(1)})  # (x, cos, sin); (x,)
        parallelize_module(block, mesh, plan)
    tied = bool(stage.args.tie_embeddings) and stage.tok_embeddings is not None and stage.output is not None
    if stage.tok_embeddings is not None:
        # Token ids are replicated on every tp rank; the embedding rows are split by vocabulary.
        parallelize_module(stage.tok_embeddings, mesh, RowwiseParallel(input_layouts=Replicate()))
    if stage.output is not None:
        parallelize_module(stage.output, mesh, ColwiseParallel(output_layouts=Replicate()))
    if tied and stage.output is not None and stage.tok_embeddings is not None:
        # Both splits are rows of one [vocab, dim] matrix, so one sharded parameter serves both again.
        stage.output.weight = stage.tok_embeddings.weight
    return stage


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``: gathers a ``DTensor`` over its mesh (collective), else ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_stage_shape(shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of one tp rank's share of a boundary activation ``[mb, seq, dim]``: the hidden dim split by tp."""
    *lead, dim = shape
    if dim % tp:
        raise UserError(f"parallel.tp={tp} does not divide the model dimension {dim}; choose a tp that divides it.")
    return (*lead, dim // tp)
