"""Host staging for device tensors: a pool of pinned slabs bounded by bytes, the copy streams, and stream order.

A device tensor crosses to host memory in pieces. Each piece (a point-to-point chunk, or one round of a
collective) takes one pinned slab from the pool: slabs all have one size (the largest chunk), whatever the
dtype or shape asked for, and the pool holds at most ``max_bytes`` of them, so its bound is in bytes and a
collective that needs more than the bound (an all-gather over 16 ranks) is cut into rounds that each fit one
slab (``plan_rounds``) instead of waiting for buffers that can never come. After warm-up nothing is allocated.

Copies run on side streams with one event each, so the copy of piece i+1 overlaps the wire of piece i.
Stream order is torch's: the op is captured on the caller's thread with an event on the producer's current
stream (``capture``), the side streams wait for that event (never a device-wide synchronize), and source
tensors are held by ``record_stream`` until their copies finish. A staged op ends for its caller with an event
recorded on the host-to-device stream after its last copies (``OpEnd``): ``Work.wait()`` makes the caller's
current stream wait for it, and the worker returns the slabs once the copies ran (``settle``). Every
``torch.cuda`` call is behind a device check: CPU tensors whose staging is forced
(``BIMETAL_CF_FORCE_STAGING=1``, for tests and the GPU check's ``--cpu`` mode) go through ``HostCopyDouble``, a
test double for the copy engine (and, as ``CALLER_DOUBLE``, the caller's current stream) that copies
synchronously and records which events a stream was made to wait for.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch

from bimetal.env import read_flag

ENV_FORCE = "BIMETAL_CF_FORCE_STAGING"
ALIGN = 64
"""Byte alignment of every region packed into a slab (any dtype's view of it is aligned)."""


def is_device(tensor: torch.Tensor) -> bool:
    """True for tensors that live on an accelerator (CUDA and ROCm tensors both report ``cuda``)."""
    return not tensor.is_cpu


def force_staging() -> bool:
    """Whether ``BIMETAL_CF_FORCE_STAGING=1`` asks cpu-forward to stage CPU tensors too (read at group creation)."""
    return read_flag(ENV_FORCE)  # the table's check refuses anything but 0 or 1


class PoolExhausted(RuntimeError):
    """No staging slab came free within the timeout."""


class PinnedPool:
    """Pinned host slabs of ``slab_bytes`` each, at most ``max_bytes`` of them in all.

    ``take`` hands out a view of a free slab as ``numel`` elements of ``dtype`` (any dtype, any count up to one
    slab); it allocates a slab only while under the byte bound and otherwise waits (up to ``timeout``) for one
    to come back: a slow peer slows the sender instead of growing memory.
    """

    def __init__(self, max_bytes: int, slab_bytes: int, pin: bool | None = None,
                 device: torch.device | None = None):
        if slab_bytes < ALIGN or max_bytes < slab_bytes:
            raise ValueError(f"staging pool of {max_bytes} bytes cannot hold one slab of {slab_bytes} bytes")
        self.max_bytes, self.slab_bytes = max_bytes, slab_bytes
        self.capacity = max_bytes // slab_bytes
        """How many slabs fit under the bound."""
        self.device = device or torch.device("cpu")
        """The GPU the slabs are pinned for: pinning makes a context on the current device of the allocating
        thread (a worker thread's is GPU 0), so every allocation runs under this device instead."""
        self._pin = self.device.type == "cuda" if pin is None else pin
        self._free: list[torch.Tensor] = []
        self._slabs: dict[int, torch.Tensor] = {}  # data pointer -> slab
        self._cond = threading.Condition()
        self._returning = 0  # slabs of ops completed for their caller, back once their last copies ran (settle)
        self.allocations = 0
        """Slabs allocated so far (flat after warm-up: the test of 'no allocation per call')."""

    @property
    def held_bytes(self) -> int:
        """Bytes of pinned memory the pool holds (in use or free); never above ``max_bytes``."""
        return len(self._slabs) * self.slab_bytes

    def _slab(self, timeout: timedelta, wait: bool) -> torch.Tensor | None:
        with self._cond:
            while not self._free:
                if len(self._slabs) < self.capacity and not self._returning:  # (a returning slab is waited for)
                    on = torch.cuda.device(self.device) if self._pin and self.device.type == "cuda" \
                        else contextlib.nullcontext()
                    with on:
                        slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self._pin)
                    self._slabs[slab.data_ptr()] = slab
                    self.allocations += 1
                    return slab
                if not wait:
                    return None
                if not self._cond.wait(timeout.total_seconds()):
                    raise PoolExhausted(f"no staging slab came free in {timeout} (the pool holds "
                                        f"{self.capacity} x {self.slab_bytes} bytes, all in use)")
            return self._free.pop()

    def take(self, dtype: torch.dtype, numel: int, timeout: timedelta) -> torch.Tensor:
        """A free slab seen as ``numel`` elements of ``dtype`` (waits while all are in use)."""
        self._fits(dtype, numel)
        slab = self._slab(timeout, True)
        assert slab is not None
        return slab[:numel * _esize(dtype)].view(dtype)

    def try_take(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """Like ``take`` but None at once when no slab is free and the bound is reached."""
        self._fits(dtype, numel)
        slab = self._slab(timedelta(0), False)
        return None if slab is None else slab[:numel * _esize(dtype)].view(dtype)

    def _fits(self, dtype: torch.dtype, numel: int) -> None:
        if numel * _esize(dtype) > self.slab_bytes:
            raise ValueError(f"{numel} x {dtype} does not fit one staging slab of {self.slab_bytes} bytes")

    def give(self, buf: torch.Tensor, expected: bool = False) -> None:
        """Return a buffer ``take`` handed out (any view starting at its slab's first byte); ``expected``: one
        announced by ``returning``."""
        with self._cond:
            self._free.append(self._slabs[buf.data_ptr()])
            if expected:
                self._returning -= 1
            self._cond.notify_all()

    def returning(self, count: int) -> None:
        """``count`` slabs in use will come back by themselves (their copies are enqueued, ``settle``): until
        they do, a take waits for them rather than allocating (no allocation after warm-up, whatever the
        timing of those copies), and ``try_take`` answers None."""
        with self._cond:
            self._returning += count


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_rounds(unit: int, pieces: int, element_size: int, slab_bytes: int) -> list[tuple[int, int]]:
    """Element ranges [a, b) of ``unit`` such that one round, ``pieces`` regions of (b - a) elements each (every
    region aligned), fits one slab. An all-gather over W ranks has W + 1 pieces: its rounds get smaller, never
    more than one slab each. Raises ValueError when not even one element per piece fits."""
    if unit <= 0:
        return []
    per = (slab_bytes // max(1, pieces)) // ALIGN * ALIGN // element_size
    if per < 1:
        raise ValueError(f"a staging slab of {slab_bytes} bytes cannot hold {pieces} pieces of one element")
    return [(a, min(unit, a + per)) for a in range(0, unit, per)]


class DoubleEvent:
    """An event the copy double recorded: complete at once (its copies ran synchronously). It counts the
    ``synchronize`` calls made on it, so a test can tell a stream-ordered wait from a blocking one."""

    def __init__(self, stream: HostCopyDouble):
        self.stream = stream
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def query(self) -> bool:
        return True


class HostCopyDouble:
    """Test double for a device stream, used only for CPU tensors whose staging is forced: copies run at once on
    the calling thread and their events are already complete. The staged code paths above it (pool, rounds,
    pipelining, counters, the end event a ``Work`` orders the caller's stream on) are the ones device tensors
    take. ``waited`` lists the events this stream was made to wait for (``wait_event``), in order."""

    def __init__(self) -> None:
        self.waited: list[object] = []
        self._lock = threading.Lock()

    def wait_event(self, event: object) -> None:
        with self._lock:
            self.waited.append(event)


CALLER_DOUBLE = HostCopyDouble()
"""The double of the caller's current stream for CPU tensors (``current_stream``); a staged op's ``Work.wait()``
makes it wait for the op's end event, as it makes ``torch.cuda.current_stream()`` wait on a GPU."""


def current_stream(device: torch.device) -> object:
    """The caller's current stream of ``device`` (the double ``CALLER_DOUBLE`` for CPU)."""
    return CALLER_DOUBLE if device.type == "cpu" else torch.cuda.current_stream(device)


def record_end(stream: object) -> object:
    """An event recorded on ``stream`` after everything enqueued on it so far (a staged op's end)."""
    if isinstance(stream, HostCopyDouble):
        return DoubleEvent(stream)
    event = torch.cuda.Event()
    event.record(stream)  # type: ignore[arg-type]
    return event


def on_stream(stream: object) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)`` for a device stream; nothing for the double."""
    if isinstance(stream, HostCopyDouble):
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)  # type: ignore[arg-type]


class OpEnd:
    """Where a staged op ends for its caller: the event recorded on its host-to-device stream after its last
    copy (set on the worker before the op's future completes) and the device whose current stream ``order``
    makes wait for it. None while the op has no device outputs (sends, host ops)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event: object | None = None

    def order(self) -> None:
        """Make the caller's current stream wait for the op's end (never blocks the Python thread)."""
        if self.event is not None:
            current_stream(self.device).wait_event(self.event)  # type: ignore[attr-defined]


class CopyStreams:
    """Side streams for device <-> host copies of one device, created on first use (doubles for CPU)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[object, object]] = {}
        self._lock = threading.Lock()

    def pair(self, device: torch.device) -> tuple[object, object]:
        """(device-to-host stream, host-to-device stream) for ``device``."""
        with self._lock:
            if device not in self._streams:
                if device.type == "cpu":
                    self._streams[device] = (HostCopyDouble(), HostCopyDouble())
                else:
                    self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
            return self._streams[device]


def capture(tensors: list[torch.Tensor]) -> object | None:
    """On the caller's thread: an event on the current stream of the tensors' device (None for CPU), so that the
    copies made later on a worker thread come after the kernels that produce (or last read) the tensors."""
    for t in tensors:
        if is_device(t):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            return event
    return None


def after(stream: object, ready: object | None) -> None:
    """Make ``stream`` wait for ``ready`` (from ``capture``) without blocking the host."""
    if ready is not None and not isinstance(stream, HostCopyDouble):
        stream.wait_event(ready)  # type: ignore[attr-defined]


def copy_to_host(src: torch.Tensor, dst: torch.Tensor, stream: object) -> object:
    """Enqueue ``dst.copy_(src)`` on ``stream``; ``src`` is held (``record_stream``) until the copy ran.

    Returns the event recorded after the copy; ``event.synchronize()`` means ``dst`` holds the data.
    """
    if isinstance(stream, HostCopyDouble):
        dst.copy_(src)
        return DoubleEvent(stream)
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # type: ignore[arg-type]
        event = torch.cuda.Event()
        event.record(stream)  # type: ignore[arg-type]
    return event


def copy_to_device(src: torch.Tensor, dst: torch.Tensor, stream: object) -> object:
    """Enqueue ``dst.copy_(src)`` (host -> device) on ``stream``; ``dst`` is held until it ran. Returns its event."""
    if isinstance(stream, HostCopyDouble):
        dst.copy_(src)
        return DoubleEvent(stream)
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        dst.copy_(src, non_blocking=True)
        dst.record_stream(stream)  # type: ignore[arg-type]
        event = torch.cuda.Event()
        event.record(stream)  # type: ignore[arg-type]
    return event


def settle(kept: list[tuple[object, torch.Tensor]], pool: PinnedPool) -> None:
    """On the worker, after the op completed for its caller: wait for the host-to-device copies it left enqueued
    ((event, slab) pairs, announced with ``pool.returning``) and give their slabs back to the pool."""
    error: BaseException | None = None
    while kept:
        event, slab = kept.pop(0)
        try:
            event.synchronize()  # type: ignore[attr-defined]
        except BaseException as exc:  # (a device error: raised once every slab is back in the pool's count)
            error = error or exc
        pool.give(slab, expected=True)
    if error is not None:
        raise error
