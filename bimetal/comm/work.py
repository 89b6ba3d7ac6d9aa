"""The pieces of a bimetal transport operation that need no process group: the errors, the op record that
names an op in messages, the byte counters, the dtype check and ``BimetalWork``, the torch ``Work`` over a
future (``bimetal.comm.base`` re-exports them; the transports import them from there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8, torch.bool)


class TransportError(RuntimeError):
    """A bimetal transport operation failed (peer gone, bad data, broken link)."""


class TransportTimeout(TransportError):
    """An operation did not complete within the group's timeout."""


class UnsupportedOperation(TransportError):
    """An op / dtype / option combination this transport does not implement."""


@dataclass
class CommCounters:
    """Bytes this group moved, split by whether they went through host memory (staging) or not."""

    ops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_staged: int = 0
    """Bytes copied device -> host or host -> device on their way through this group."""
    bytes_direct: int = 0
    """Bytes that left or arrived without a host copy (device-direct; CPU tensors on cpu-forward)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, value in amounts.items():
                setattr(self, name, getattr(self, name) + value)

    def begin(self, sent: int = 0, received: int = 0) -> int:
        """Count one more op; its number is the op's sequence number in its group. ``sent`` / ``received``: bytes
        it moves without a host copy, counted as it starts (cpu-forward's one-message fast path: one lock per op)."""
        with self.lock:
            self.ops += 1
            if sent or received:
                self.bytes_sent += sent
                self.bytes_received += received
                self.bytes_direct += sent + received
            return self.ops

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in ("ops", "bytes_sent", "bytes_received", "bytes_staged",
                                                  "bytes_direct")}


class OpRecord(NamedTuple):
    """Which operation, for error messages: ``<group> <op> #<seq> (peer <p>)`` (a tuple: made for every op)."""

    group: str
    op: str
    seq: int
    peer: int | None = None

    def describe(self) -> str:
        peer = f" with peer {self.peer}" if self.peer is not None else ""
        return f"group {self.group!r} {self.op} #{self.seq}{peer}"


class BimetalWork(dist.Work):
    """A torch ``Work`` over a future: ``wait()`` re-raises the op's error, ``get_future()`` gives the future.

    (torch's own future-wrapping work swallows the exception in ``wait()``, which would turn a failed
    transfer into silently wrong data; hence a Python subclass.)

    ``end``: an op whose results reach the device on a side stream (``staging.OpEnd``): ``wait()`` returns once
    the future completed (the copies are enqueued, not finished) and makes the caller's current stream wait
    for the op's end event, as torch's NCCL work does; the Python thread is not blocked on device work.
    """

    def __init__(self, future: torch.futures.Future, end: Any = None):
        super().__init__()
        self._future, self._end = future, end

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        self._future.wait()
        if self._end is not None:
            self._end.order()
        return True

    def get_future(self) -> torch.futures.Future:  # type: ignore[override]
        return self._future

    @property
    def end(self) -> Any:
        """The op's ``staging.OpEnd`` (None for an op with nothing to order on a device stream)."""
        return self._end

    def is_completed(self) -> bool:  # type: ignore[override]
        return self._future.done()

    def is_success(self) -> bool:  # type: ignore[override]
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:  # type: ignore[override]
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:
            return exc
        return None

    def synchronize(self) -> None:  # type: ignore[override]
        self.wait()


def make_work(future: torch.futures.Future, end: Any = None) -> dist.Work:
    """A torch ``Work`` whose ``wait()`` and ``get_future()`` follow ``future`` (``end``: see ``BimetalWork``)."""
    return BimetalWork(future, end)


def completed_work(value: object = None) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return make_work(fut)


def check_dtype(op: OpRecord, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    if tensor.dtype not in allowed:
        raise UnsupportedOperation(f"{op.describe()}: dtype {tensor.dtype} is not supported by this transport; "
                                   f"supported: {', '.join(str(d).replace('torch.', '') for d in allowed)}")
