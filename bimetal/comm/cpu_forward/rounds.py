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

from bimetal.comm.cpu_forward.work import Deadline
from bimetal.comm.staging import PinnedPool, after, aligned, copy_to_device, copy_to_host, plan_rounds

Slices = Callable[[int, int], list[torch.Tensor]]
"""(a, b) -> the device slices of a round (each b - a elements, or empty)."""
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


def _regions(slab: torch.Tensor, dtype: torch.dtype, n: int, load: int, store: int, same: bool
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    esize = torch.empty((), dtype=dtype).element_size()
    bytes_a = aligned(max(load, store if same else 0) * n * esize)
    raw = slab.view(torch.uint8)
    a = [raw[i * n * esize:(i + 1) * n * esize].view(dtype) for i in range(max(load, store) if same else load)]
    if same:
        return a, a
    b = [raw[bytes_a + i * n * esize:bytes_a + (i + 1) * n * esize].view(dtype) for i in range(store)]
    return a, b


def run(op: Staged, pool: PinnedPool, streams: tuple[object, object], ready: object | None, d: Deadline,
        timeout: timedelta) -> int:
    """Run ``op`` in rounds; returns the bytes staged (copied either way)."""
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
        ra, rb = _regions(s, op.dtype, b - a, len(loads), len(stores), op.same)
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
    while copying:
        pool.give(finish_copy())
    return staged
