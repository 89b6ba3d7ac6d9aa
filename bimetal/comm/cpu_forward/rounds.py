"""Staged collectives: a collective on device tensors (or forced-staged CPU tensors) run in rounds through the
pinned pool, two rounds in flight.

A collective is described per element range [a, b) of its unit (the per-rank length): ``load`` are the device
slices copied to the host before the round (packed one after another into the slab's first region),
``store`` those copied back after it (from the second region, or from the first when ``same``), and
``post(A, B)`` posts the Gloo operation on the host regions, given as lists of per-slice views. Each round
takes one slab (``staging.plan_rounds`` sizes it so); the device-to-host copies of round i+1 are made while
round i is on the wire, and the host-to-device copies of round i while round i+1 is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from bimetal.comm.cpu_forward.staging import PinnedPool, after, aligned, copy_to_device, copy_to_host, plan_rounds
from bimetal.comm.cpu_forward.work import Deadline

Slices = Callable[[int, int], list[torch.Tensor]]
"""(a, b) -> the device slices of a round: each one tensor's part of [a, b), b - a elements or fewer (a part of
an uneven all-to-all may end before b, or hold nothing in that round)."""
Post = Callable[[list[torch.Tensor], list[torch.Tensor], int], list[Any]]
"""(load regions, store regions, round index) -> the Gloo works of the round."""


@dataclass
class Staged:
    """One staged collective over a unit of ``unit`` elements of ``dtype``."""

    unit: int
    dtype: torch.dtype
    load: Slices
    store: Slices
    post: Post
    load_pieces: int
    store_pieces: int
    same: bool = False
    """The Gloo op works in place: the stored slices come from the loaded region."""

    def pieces(self) -> int:
        return max(self.load_pieces, self.store_pieces) if self.same else self.load_pieces + self.store_pieces


@dataclass
class _Round:
    slab: torch.Tensor
    store: list[torch.Tensor]
    hosts: list[torch.Tensor]
    works: list[Any]


def _regions(slab: torch.Tensor, dtype: torch.dtype, loads: list[int], stores: list[int], same: bool
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Host regions of a round: one per loaded slice (``loads``: their lengths), packed one after another from
    the slab's first byte, and one per stored slice after the next aligned byte (the same regions when
    ``same``). Equal lengths give the rank-major layout of the round's part of the unit."""
    esize = torch.empty((), dtype=dtype).element_size()
    raw = slab.view(torch.uint8)

    def packed(lengths: list[int], start: int) -> list[torch.Tensor]:
        out, at = [], start
        for n in lengths:
            out.append(raw[at:at + n * esize].view(dtype))
            at += n * esize
        return out

    if same:
        a = packed(loads if len(loads) >= len(stores) else stores, 0)
        return a, a
    return packed(loads, 0), packed(stores, aligned(sum(loads) * esize))


def run(op: Staged, pool: PinnedPool, streams: tuple[object, object], ready: object | None, d: Deadline,
        timeout: timedelta, keep: list[tuple[object, torch.Tensor]] | None = None) -> int:
    """Run ``op`` in rounds; returns the bytes staged (copied either way). The last rounds' host-to-device
    copies are waited for and their slabs given back, or, with ``keep``, left enqueued and appended to it as
    (event, slab): the op's caller may go on in stream order first, ``staging.settle`` returns them after."""
    d2h, h2d = streams
    after(d2h, ready)
    after(h2d, ready)  # the outputs may still be read by the producer's stream
    esize = torch.empty((), dtype=op.dtype).element_size()
    ranges = plan_rounds(op.unit, op.pieces(), esize, pool.slab_bytes)
    on_wire: deque[_Round] = deque()
    copying: deque[tuple[object, torch.Tensor]] = deque()  # host -> device copies still running, their slab
    staged = 0

    def finish_copy() -> torch.Tensor:
        event, slab = copying.popleft()
        event.synchronize()  # type: ignore[attr-defined]
        return slab

    def land() -> None:  # the oldest round's wire is done: its outputs go to the device
        nonlocal staged
        r = on_wire.popleft()
        for w in r.works:
            d.wait(w)
        event: object | None = None
        for dst, src in zip(r.store, r.hosts):
            if dst.numel():
                event = copy_to_device(src, dst, h2d)
                staged += dst.numel() * esize
        if event is None:
            pool.give(r.slab)
        else:
            copying.append((event, r.slab))

    def slab() -> torch.Tensor:
        while True:  # never wait for a slab while holding one that frees by itself
            got = pool.try_take(torch.uint8, pool.slab_bytes)
            if got is not None:
                return got
            if copying:
                return finish_copy()
            if on_wire:
                land()
                continue
            return pool.take(torch.uint8, pool.slab_bytes, timeout)

    for i, (a, b) in enumerate(ranges):
        s = slab()
        loads, stores = op.load(a, b), op.store(a, b)
        ra, rb = _regions(s, op.dtype, [t.numel() for t in loads], [t.numel() for t in stores], op.same)
        events = []
        for src, dst in zip(loads, ra):
            events.append(copy_to_host(src, dst, d2h))
            staged += src.numel() * esize
        for e in events:
            e.synchronize()  # type: ignore[attr-defined]
        works = op.post(ra, rb, i)
        on_wire.append(_Round(s, stores, rb[:len(stores)], works))
        if len(on_wire) > 1:
            land()
    while on_wire:
        land()
    if keep is not None:
        pool.returning(len(copying))
        keep.extend(copying)
        copying.clear()
    while copying:
        pool.give(finish_copy())
    return staged

