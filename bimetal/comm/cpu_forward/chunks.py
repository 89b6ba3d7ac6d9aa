"""The chunk sources and sinks of a failover transfer (``failover.ChunkIO``): a host tensor sent from or received
into in place (with its CRC as one more chunk), and a device tensor staged chunk by chunk through pooled
pinned buffers (device -> host before a chunk is posted, host -> device as each one arrives).
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Protocol

import torch

from bimetal.comm.staging import PinnedPool, copy_to_device, copy_to_host


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
    """Chunks of a device tensor: copied to a pooled pinned buffer when posted, the buffer freed when done."""

    def __init__(self, flat: torch.Tensor, ranges: list[tuple[int, int]], pool: PinnedPool, stream: object,
                 timeout: timedelta, size: int):
        self.flat, self.ranges, self.pool, self.stream, self.timeout = flat, ranges, pool, stream, timeout
        self.size = size
        self.held: dict[int, torch.Tensor] = {}

    def buffer(self, j: int) -> torch.Tensor:
        a, b = self.ranges[j]
        buf = self.held[j] = self.pool.take(self.flat.dtype, self.size, self.timeout)
        copy_to_host(self.flat[a:b], buf[:b - a], self.stream).synchronize()  # type: ignore[attr-defined]
        return buf[:b - a]

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None:
        self.pool.give(self.held.pop(j))


class StagedRecv:
    """Chunks of a device tensor received into pooled pinned buffers; each arrival is copied to the device."""

    def __init__(self, out: torch.Tensor, ranges: list[tuple[int, int]], pool: PinnedPool, stream: object,
                 timeout: timedelta, depth: int, size: int):
        self.out, self.ranges, self.pool, self.stream, self.timeout = out, ranges, pool, stream, timeout
        self.size, self.depth = size, depth
        self.held: dict[int, torch.Tensor] = {}
        self.copying: deque[tuple[object, torch.Tensor]] = deque()

    def buffer(self, j: int) -> torch.Tensor:
        a, b = self.ranges[j]
        got = self.pool.try_take(self.out.dtype, self.size)
        if got is None and self.copying:  # reuse our oldest buffer rather than wait for the pool
            event, got = self.copying.popleft()
            event.synchronize()  # type: ignore[attr-defined]
        self.held[j] = got if got is not None else self.pool.take(self.out.dtype, self.size, self.timeout)
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

    def finish(self) -> None:
        while self.copying:
            self._retire()
