"""Point-to-point of one stripe on staged tensors (device tensors, or CPU ones with staging forced): the chunk I/O
of ``chunks`` (the same staged sources and sinks failover uses with K stripes) driven in order by ``pump``,
``depth`` chunks on the wire, the device-to-host copies of later chunks queued while earlier ones are on the wire
(send), each arrival copied to the device while later chunks still arrive (receive). ``g`` is the
group's state (``state.GroupState``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from bimetal.comm.cpu_forward.chunks import StagedRecv, StagedSend
from bimetal.comm.cpu_forward.staging import OpEnd, after, copy_to_device, on_stream, record_end, settle
from bimetal.comm.cpu_forward.state import GroupState
from bimetal.comm.cpu_forward.work import Deadline


def pump(io: StagedSend | StagedRecv, plan: list[tuple[int, int]], post: Callable[[int, torch.Tensor], Any],
         d: Deadline, depth: int) -> None:
    """Post the chunks of ``plan`` ((chunk, stripe), in order) with ``post(stripe, buffer)``, at most ``depth`` in
    flight, each released to ``io`` once its op completed. Never waits for the pool while holding chunks on
    the wire: it waits for the oldest of them instead."""
    inflight: deque[tuple[Any, int, torch.Tensor]] = deque()

    def retire() -> None:
        work, j, buf = inflight.popleft()
        d.wait(work)
        io.release(j, buf, True)

    for j, s in plan:
        if len(inflight) >= depth:
            retire()
        buf = io.try_buffer(j)
        while buf is None and inflight:
            retire()
            buf = io.try_buffer(j)
        if buf is None:  # nothing of ours on the wire: wait for the pool
            buf = io.buffer(j)
        inflight.append((post(s, buf), j, buf))
    while inflight:
        retire()


def send_staged(g: GroupState, tensor: torch.Tensor, dst: int, tag: int, first: int, d: Deadline,
                ready: object | None = None) -> None:
    flat = tensor.detach().reshape(-1)
    d2h, _ = g.streams.pair(tensor.device)
    after(d2h, ready)
    plan = g.plan(flat.numel(), flat.element_size(), first)
    depth = g.depth()
    io = StagedSend(flat, [(a, b) for a, b, _ in plan], g.pool, d2h, g.timeout, g.pool_numel(flat),
                    list(range(len(plan))), depth)
    try:
        pump(io, [(j, s) for j, (_, _, s) in enumerate(plan)], lambda s, buf: g.stripes[s].send([buf], dst, tag),
             d, depth)
    finally:
        io.close()
    nbytes = flat.numel() * flat.element_size()
    g.counters.add(bytes_sent=nbytes, bytes_staged=nbytes)


def recv_staged(g: GroupState, tensor: torch.Tensor, src: int, tag: int, first: int, d: Deadline,
                end: OpEnd, ready: object | None = None) -> None:
    out = tensor.detach().view(-1) if tensor.is_contiguous() else torch.empty_like(tensor).view(-1)
    _, h2d = g.streams.pair(tensor.device)
    after(h2d, ready)
    plan = g.plan(out.numel(), out.element_size(), first)
    depth = g.depth()
    io = StagedRecv(out, [(a, b) for a, b, _ in plan], g.pool, h2d, g.timeout, depth, g.pool_numel(out))
    pump(io, [(j, s) for j, (_, _, s) in enumerate(plan)], lambda s, buf: g.stripes[s].recv([buf], src, tag),
         d, depth)
    complete_in_stream_order(g, io, tensor, out, h2d, end, d)


def complete_in_stream_order(g: GroupState, io: StagedRecv, tensor: torch.Tensor, out: torch.Tensor,
                             h2d: object, end: OpEnd, d: Deadline) -> None:
    """Every chunk of a staged receive is in and its last copies are enqueued: complete the op for its caller
    (``end``'s event; ``wait()`` orders the caller's stream on it), then wait for the copies, free their slabs."""
    kept = io.enqueued()
    try:
        if not tensor.is_contiguous():  # (device to device, after the chunks' copies on the same stream)
            copy_to_device(out.view(tensor.shape), tensor.detach(), h2d)
        nbytes = out.numel() * out.element_size()
        g.counters.add(bytes_received=nbytes, bytes_staged=nbytes)
        end.event = record_end(h2d)
        with on_stream(h2d):  # a device-aware future records the stream's position here
            d.complete([tensor])
    finally:
        settle(kept, g.pool)
