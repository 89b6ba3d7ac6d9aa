"""Each collective of cpu-forward as staged rounds (``rounds.Staged``): which slices of the (flat, contiguous)
tensors a round of element range [a, b) loads and stores, and the Gloo op it posts on the host regions.

The unit is the per-rank length n; rank-major layouts (all-gather's output, reduce-scatter's input, all-to-all
with equal splits) contribute one slice per rank, [r*n + a, r*n + b). Every rank cuts the same unit into the
same rounds, so the Gloo ops match. Rounds of element-wise ops rotate over the stripes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from bimetal.comm.cpu_forward.rounds import Staged

Stripe = Callable[[int], Any]
"""round index -> the Gloo group that carries it."""


def _none(a: int, b: int) -> list[torch.Tensor]:
    return []


def _one(t: torch.Tensor) -> Callable[[int, int], list[torch.Tensor]]:
    return lambda a, b: [t[a:b]]


def _ranked(t: torch.Tensor, n: int, world: int) -> Callable[[int, int], list[torch.Tensor]]:
    return lambda a, b: [t[r * n + a:r * n + b] for r in range(world)]


def _each(ts: list[torch.Tensor]) -> Callable[[int, int], list[torch.Tensor]]:
    return lambda a, b: [t[a:b] for t in ts]


def allreduce(t: torch.Tensor, stripe: Stripe, reduce_op: Any) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = AllreduceOptions()
        o.reduceOp = reduce_op
        return [stripe(i).allreduce([A[0]], o)]
    return Staged(t.numel(), t.dtype, _one(t), _one(t), post, 1, 1, same=True)


def broadcast(t: torch.Tensor, stripe: Stripe, root: int, rank: int) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = BroadcastOptions()
        o.rootRank = root
        return [stripe(i).broadcast([A[0]], o)]
    mine = rank == root
    return Staged(t.numel(), t.dtype, _one(t) if mine else _none, _none if mine else _one(t), post,
                  int(mine), int(not mine), same=True)


def reduce(t: torch.Tensor, stripe: Stripe, reduce_op: Any, root: int) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = ReduceOptions()
        o.reduceOp, o.rootRank, o.rootTensor = reduce_op, root, 0
        return [stripe(0).reduce([A[0]], o)]
    return Staged(t.numel(), t.dtype, _one(t), _one(t), post, 1, 1, same=True)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, stripe: Stripe, world: int) -> Staged:
    n = inp.numel()

    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        whole = _joined(B)
        return [stripe(0)._allgather_base(whole, A[0], AllgatherOptions())]
    return Staged(n, inp.dtype, _one(inp), _ranked(out, n, world), post, 1, world)


def all_gather(outs: list[torch.Tensor], inp: torch.Tensor, stripe: Stripe) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        return [stripe(0).allgather([B], [A[0]], AllgatherOptions())]
    return Staged(inp.numel(), inp.dtype, _one(inp), _each(outs), post, 1, len(outs))


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, stripe: Stripe, world: int, reduce_op: Any) -> Staged:
    n = out.numel()

    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = ReduceScatterOptions()
        o.reduceOp = reduce_op
        return [stripe(0)._reduce_scatter_base(B[0], _joined(A), o)]
    return Staged(n, out.dtype, _ranked(inp, n, world), _one(out), post, world, 1)


def reduce_scatter(out: torch.Tensor, ins: list[torch.Tensor], stripe: Stripe, reduce_op: Any) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = ReduceScatterOptions()
        o.reduceOp = reduce_op
        return [stripe(0).reduce_scatter([B[0]], [A], o)]
    return Staged(out.numel(), out.dtype, _each(ins), _one(out), post, len(ins), 1)


def all_to_all_equal(out: torch.Tensor, inp: torch.Tensor, stripe: Stripe, world: int) -> Staged:
    """All-to-all with equal splits (a rank-major layout on both sides)."""
    n = inp.numel() // world

    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        return [stripe(0).alltoall_base(_joined(B), _joined(A), [], [], AllToAllOptions())]
    return Staged(n, inp.dtype, _ranked(inp, n, world), _ranked(out, n, world), post, world, world)


def all_to_all(outs: list[torch.Tensor], ins: list[torch.Tensor], stripe: Stripe) -> Staged:
    """All-to-all of lists whose tensors all have one length."""
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        # the regions are packed back to back: one alltoall_base (Gloo's list all-to-all is not in every torch)
        return [stripe(0).alltoall_base(_joined(B), _joined(A), [], [], AllToAllOptions())]
    return Staged(ins[0].numel(), ins[0].dtype, _each(ins), _each(outs), post, len(ins), len(outs))


def all_to_all_uneven(outs: list[torch.Tensor], ins: list[torch.Tensor], stripe: Stripe, unit: int) -> Staged:
    """All-to-all of per-peer parts of any lengths (flat; ``ins[p]`` goes to peer p, ``outs[p]`` comes from it).

    ``unit`` is the longest part of any rank (agreed on beforehand): every rank cuts it into the same rounds,
    and round [a, b) moves each part's elements [a, min(b, len)) in one Gloo all-to-all with those splits, so a
    part that has ended sends and receives nothing and the byte bound holds whatever the splits."""
    def cut(ts: list[torch.Tensor]) -> Callable[[int, int], list[torch.Tensor]]:
        return lambda a, b: [t[min(a, t.numel()):min(b, t.numel())] for t in ts]

    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        return [stripe(0).alltoall_base(_packed(B), _packed(A), [t.numel() for t in B], [t.numel() for t in A],
                                        AllToAllOptions())]
    return Staged(unit, ins[0].dtype, cut(ins), cut(outs), post, len(ins), len(outs))


def scatter(out: torch.Tensor, ins: list[torch.Tensor], stripe: Stripe, root: int, world: int) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = ScatterOptions()
        o.rootRank = root
        return [stripe(0).scatter([B[0]], [A] if A else [], o)]
    return Staged(out.numel(), out.dtype, _each(ins), _one(out), post, world, 1)  # world on every rank: same rounds


def gather(outs: list[torch.Tensor], inp: torch.Tensor, stripe: Stripe, root: int, world: int) -> Staged:
    def post(A: list[torch.Tensor], B: list[torch.Tensor], i: int) -> list[Any]:
        o = GatherOptions()
        o.rootRank = root
        return [stripe(0).gather([B] if B else [], [A[0]], o)]
    return Staged(inp.numel(), inp.dtype, _one(inp), _each(outs), post, 1, world)


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Regions packed one after another (of any lengths, ``rounds._regions``) as one flat tensor."""
    first = parts[0]
    return first.as_strided((sum(p.numel() for p in parts),), (1,), first.storage_offset())


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Adjacent equal-length regions of one slab as one flat tensor (they were packed one after another)."""
    first = parts[0]
    return first.as_strided((first.numel() * len(parts),), (1,), first.storage_offset())
