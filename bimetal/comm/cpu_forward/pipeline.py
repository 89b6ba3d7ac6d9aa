"""Point-to-point of one stripe on staged tensors (device tensors, or CPU ones with staging forced): the chunks
go through the pinned pool, the device-to-host copies of later chunks running while earlier ones are on the
wire (send), each arrival copied to the device while later chunks still arrive (receive). A transfer never
waits for the pool while it holds buffers that free by themselves, so a send and a receive in flight at once
cannot starve each other. ``pg`` is the ``CpuForwardProcessGroup``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.cpu_forward.work import Deadline
from bimetal.comm.staging import after, copy_to_device, copy_to_host


def send_staged(pg: Any, tensor: torch.Tensor, dst: int, tag: int, first: int, d: Deadline,
                 ready: object | None = None) -> None:
    flat = tensor.detach().reshape(-1)
    d2h, _ = pg.streams.pair(tensor.device)
    after(d2h, ready)
    plan = pg.plan(flat.numel(), flat.element_size(), first)
    size, depth = pg.pool_numel(flat), pg.depth()
    copies: deque[tuple[int, int, int, torch.Tensor, object]] = deque()  # D2H queued, not yet sent
    inflight: deque[tuple[dist.Work, torch.Tensor]] = deque()  # posted to Gloo
    nxt = 0

    def queue_copy(buf: torch.Tensor) -> None:
        nonlocal nxt
        a, b, s = plan[nxt]
        copies.append((a, b, s, buf, copy_to_host(flat[a:b], buf[:b - a], d2h)))
        nxt += 1

    while nxt < len(plan) and len(copies) < depth:  # the GPU copies ahead while the network sends
        got = pg.pool.try_take(flat.dtype, size)
        if got is None and copies:  # the pool is busy (other transfers): go on with what we hold
            break
        queue_copy(got if got is not None else pg.pool.take(flat.dtype, size, pg.timeout))
    while copies:
        a, b, s, buf, event = copies.popleft()
        event.synchronize()  # type: ignore[attr-defined]
        inflight.append((pg.stripes[s].send([buf[:b - a]], dst, tag), buf))
        if nxt < len(plan):  # keep `depth` chunks on the wire; else reuse the oldest sent buffer
            got = pg.pool.try_take(flat.dtype, size) if len(inflight) < depth else None
            if got is None:  # never wait for the pool while holding buffers that free by themselves
                w, got = inflight.popleft()
                d.wait(w)
            queue_copy(got)
    while inflight:
        w, buf = inflight.popleft()
        d.wait(w)
        pg.pool.give(buf)
    nbytes = flat.numel() * flat.element_size()
    pg.counters.add(bytes_sent=nbytes, bytes_staged=nbytes)

def recv_staged(pg: Any, tensor: torch.Tensor, src: int, tag: int, first: int, d: Deadline,
                 ready: object | None = None) -> None:
    out = tensor.detach().view(-1) if tensor.is_contiguous() else torch.empty_like(tensor).view(-1)
    _, h2d = pg.streams.pair(tensor.device)
    after(h2d, ready)
    plan = pg.plan(out.numel(), out.element_size(), first)
    size = pg.pool_numel(out)
    depth = pg.depth()
    posted: deque[tuple[int, int, dist.Work, torch.Tensor]] = deque()
    copying: deque[tuple[object, torch.Tensor]] = deque()
    nxt = 0
    while nxt < len(plan) or posted:
        while nxt < len(plan) and len(posted) < depth:  # keep several chunks arriving
            a, b, s = plan[nxt]
            got = pg.pool.try_take(out.dtype, size)
            if got is None and copying:  # reuse our oldest buffer rather than wait for the pool
                event, got = copying.popleft()
                event.synchronize()  # type: ignore[attr-defined]
            elif got is None and posted:  # the pool is busy: go on with what we hold
                break
            buf = got if got is not None else pg.pool.take(out.dtype, size, pg.timeout)
            posted.append((a, b, pg.stripes[s].recv([buf[:b - a]], src, tag), buf))
            nxt += 1
        a, b, w, buf = posted.popleft()
        d.wait(w)
        copying.append((copy_to_device(buf[:b - a], out[a:b], h2d), buf))
        while len(copying) > depth:
            event, old = copying.popleft()
            event.synchronize()  # type: ignore[attr-defined]
            pg.pool.give(old)
    for event, buf in copying:
        event.synchronize()  # type: ignore[attr-defined]
        pg.pool.give(buf)
    if not tensor.is_contiguous():
        tensor.detach().copy_(out.view(tensor.shape))
    nbytes = out.numel() * out.element_size()
    pg.counters.add(bytes_received=nbytes, bytes_staged=nbytes)
