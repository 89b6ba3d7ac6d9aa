"""Chunk I/O of cpu-forward point-to-point (``ChunkIO``): where each chunk's bytes come from or go. A host tensor
is sent from or received into in place (with its CRC as one more chunk); a device tensor is staged chunk by
chunk through pooled pinned buffers: the device-to-host copies of later chunks queued ahead while earlier ones
are on the wire (send), each arrival copied to the device while later chunks still arrive (receive).

The staged classes are the one staging pipeline of point-to-point: one stripe drives them in order
(``pipeline.pump``), K stripes through failover (``failover.Transfer``). Neither side ever waits for the pool
while it holds buffers that free by themselves (``try_buffer``), so a send and a receive in flight at once
cannot starve each other.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Protocol

import torch

from bimetal.comm.cpu_forward.staging import PinnedPool, copy_to_device, copy_to_host


class ChunkIO(Protocol):
    """Where chunk j's bytes come from (send) or go (receive); ``release`` after its op completed or was lost."""

    def buffer(self, j: int) -> torch.Tensor: ...

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None: ...


class HostChunks:
    """Chunks of a host tensor, sent from or received into in place; chunk ``len(ranges)`` is the CRC."""

    def __init__(self, data: torch.Tensor, ranges: list[tuple[int, int]], crc: torch.Tensor | None):
        self.data, self.ranges, self.crc = data, ranges, crc

    def __len__(self) -> int:
        return len(self.ranges) + (self.crc is not None)

    def buffer(self, j: int) -> torch.Tensor:
        if j == len(self.ranges):
            assert self.crc is not None
            return self.crc
        a, b = self.ranges[j]
        return self.data[a:b]

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None:
        pass


class StagedSend:
    """Chunks of a device tensor copied to pooled pinned buffers ahead of their posting (up to ``ahead`` chunks, in
    ``order``, the expected posting order); a chunk asked for out of order is copied when asked. Each buffer is
    freed when its chunk's op completed or was lost; ``close`` frees copies never asked for."""

    def __init__(self, flat: torch.Tensor, ranges: list[tuple[int, int]], pool: PinnedPool, stream: object,
                 timeout: timedelta, size: int, order: list[int] | None = None, ahead: int = 0):
        self.flat, self.ranges, self.pool, self.stream, self.timeout = flat, ranges, pool, stream, timeout
        self.size, self.depth = size, ahead
        self.order = deque(order or [])
        self.held: dict[int, torch.Tensor] = {}
        self.ahead: dict[int, tuple[torch.Tensor, object]] = {}  # chunk -> (buffer, its copy's event), queued

    def _queue(self, j: int, buf: torch.Tensor) -> None:
        a, b = self.ranges[j]
        self.ahead[j] = (buf, copy_to_host(self.flat[a:b], buf[:b - a], self.stream))

    def _prefetch(self) -> None:
        while self.order and len(self.ahead) < self.depth:
            j = self.order[0]
            if j in self.ahead or j in self.held:
                self.order.popleft()
                continue
            got = self.pool.try_take(self.flat.dtype, self.size)
            if got is None:  # the pool is busy: go on with what we hold
                return
            self.order.popleft()
            self._queue(j, got)

    def try_buffer(self, j: int) -> torch.Tensor | None:
        """Chunk j's host copy, or None when it needs a buffer and the pool has none free."""
        if j not in self.ahead:
            got = self.pool.try_take(self.flat.dtype, self.size)
            if got is None:
                return None
            self._queue(j, got)
        return self._ready(j)

    def buffer(self, j: int) -> torch.Tensor:
        if j not in self.ahead:
            got = self.pool.try_take(self.flat.dtype, self.size)
            if got is None and self.ahead:  # take back a later chunk's copy rather than wait for the pool
                later = next(reversed(self.ahead))
                got, event = self.ahead.pop(later)
                event.synchronize()  # type: ignore[attr-defined]
                self.order.appendleft(later)
            self._queue(j, got if got is not None else self.pool.take(self.flat.dtype, self.size, self.timeout))
        return self._ready(j)

    def _ready(self, j: int) -> torch.Tensor:
        buf, event = self.ahead.pop(j)
        self.held[j] = buf
        self._prefetch()  # later chunks copy while this one waits for its copy, then for the wire
        event.synchronize()  # type: ignore[attr-defined]
        a, b = self.ranges[j]
        return buf[:b - a]

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None:
        self.pool.give(self.held.pop(j))

    def close(self) -> None:
        for buf, event in self.ahead.values():
            event.synchronize()  # type: ignore[attr-defined]
            self.pool.give(buf)
        self.ahead.clear()


class StagedRecv:
    """Chunks of a device tensor received into pooled pinned buffers; each arrival is copied to the device."""

    def __init__(self, out: torch.Tensor, ranges: list[tuple[int, int]], pool: PinnedPool, stream: object,
                 timeout: timedelta, depth: int, size: int):
        self.out, self.ranges, self.pool, self.stream, self.timeout = out, ranges, pool, stream, timeout
        self.size, self.depth = size, depth
        self.held: dict[int, torch.Tensor] = {}
        self.copying: deque[tuple[object, torch.Tensor]] = deque()

    def try_buffer(self, j: int) -> torch.Tensor | None:
        """A buffer for chunk j: a free one, else our oldest one once its copy to the device is done; None when
        the pool has none free and nothing of ours is copying."""
        a, b = self.ranges[j]
        got = self.pool.try_take(self.out.dtype, self.size)
        if got is None and self.copying:  # reuse our oldest buffer rather than wait for the pool
            event, got = self.copying.popleft()
            event.synchronize()  # type: ignore[attr-defined]
        if got is None:
            return None
        self.held[j] = got
        return got[:b - a]

    def buffer(self, j: int) -> torch.Tensor:
        got = self.try_buffer(j)
        if got is not None:
            return got
        a, b = self.ranges[j]
        self.held[j] = self.pool.take(self.out.dtype, self.size, self.timeout)
        return self.held[j][:b - a]

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None:
        full = self.held.pop(j)
        if not ok:  # lost with its stripe: Gloo closed that context, nothing writes into it any more
            self.pool.give(full)
            return
        a, b = self.ranges[j]
        self.copying.append((copy_to_device(buf, self.out[a:b], self.stream), full))
        while len(self.copying) > self.depth:
            self._retire()

    def _retire(self) -> None:
        event, buf = self.copying.popleft()
        event.synchronize()  # type: ignore[attr-defined]
        self.pool.give(buf)

    def enqueued(self) -> list[tuple[object, torch.Tensor]]:
        """The copies still running and their buffers, handed over (``staging.settle`` gives them back once the
        op completed for its caller in stream order)."""
        out = list(self.copying)
        self.copying.clear()
        self.pool.returning(len(out))
        return out
