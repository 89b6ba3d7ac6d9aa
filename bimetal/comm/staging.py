"""Host staging for device tensors: a reusable pool of pinned buffers and the copy streams.

A device tensor crosses to host memory in fixed-size chunks. Each chunk takes a pinned buffer from the
pool (allocated once, reused; the pool never allocates per call after warm-up), is copied on a side
stream, and an event marks when the chunk is ready, so that the copy of chunk i+1 overlaps the network
transfer of chunk i. CPU tensors never come here. Every ``torch.cuda`` call is behind ``is_device``
checks, so CPU builds never touch it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import timedelta

import torch


def is_device(tensor: torch.Tensor) -> bool:
    """True for tensors that need host staging (CUDA and ROCm tensors both report ``cuda``)."""
    return not tensor.is_cpu


class PoolExhausted(RuntimeError):
    """No staging buffer came free within the timeout."""


class PinnedPool:
    """Pinned host buffers keyed by (dtype, element count), at most ``max_buffers`` bytes-classes each.

    ``take`` blocks (up to ``timeout``) when every buffer of the class is in use: the pool bounds how much
    host memory staging holds, and a slow peer slows the sender instead of growing memory.
    """

    def __init__(self, max_buffers: int = 8, pin: bool | None = None):
        self.max_buffers = max_buffers
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._count: dict[tuple[torch.dtype, int], int] = defaultdict(int)
        self._cond = threading.Condition()
        self.allocations = 0
        """Buffers allocated so far (flat after warm-up: the test of 'no allocation per call')."""

    def take(self, dtype: torch.dtype, numel: int, timeout: timedelta) -> torch.Tensor:
        key = (dtype, numel)
        with self._cond:
            while not self._free[key]:
                if self._count[key] < self.max_buffers:
                    self._count[key] += 1
                    self.allocations += 1
                    return torch.empty(numel, dtype=dtype, pin_memory=self._pin)
                if not self._cond.wait(timeout.total_seconds()):
                    raise PoolExhausted(f"no staging buffer of {numel} x {dtype} came free in {timeout}")
            return self._free[key].pop()

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free[(buf.dtype, buf.numel())].append(buf)
            self._cond.notify_all()


class CopyStreams:
    """Side streams for device <-> host copies of one device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[object, object]] = {}
        self._lock = threading.Lock()

    def pair(self, device: torch.device) -> tuple[object, object]:
        """(device-to-host stream, host-to-device stream) for ``device``."""
        with self._lock:
            if device not in self._streams:
                self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
            return self._streams[device]


def copy_to_host(src: torch.Tensor, dst: torch.Tensor, stream: object) -> object:
    """Enqueue ``dst.copy_(src)`` on ``stream`` after the work already queued on src's current stream.

    Returns the event recorded after the copy; ``event.synchronize()`` means ``dst`` holds the data.
    """
    current = torch.cuda.current_stream(src.device)
    stream.wait_stream(current)  # type: ignore[attr-defined]
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # type: ignore[arg-type]
        event = torch.cuda.Event()
        event.record(stream)  # type: ignore[arg-type]
    return event


def copy_to_device(src: torch.Tensor, dst: torch.Tensor, stream: object) -> object:
    """Enqueue ``dst.copy_(src)`` (host -> device) on ``stream``; returns the event after it."""
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)  # type: ignore[arg-type]
    return event
