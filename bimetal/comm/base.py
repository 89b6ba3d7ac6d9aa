"""What every bimetal transport shares: a Python ``torch.distributed.ProcessGroup`` with names, async
``Work`` on futures, per-group sequence numbers, clear errors and byte counters.

torch 2.13 hands every collective of a group registered with ``extended_api=True`` to the Python object
the creator returns (see DESIGN.md); a transport subclasses ``BimetalProcessGroup`` and implements the
ops it supports. Every op goes through ``_begin`` (sequence number, op record for error messages) and
returns ``make_work(future)``; a failure becomes a ``TransportError`` / ``TransportTimeout`` whose message
names the group description, the operation, the peer and the sequence number.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import timedelta

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

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in ("ops", "bytes_sent", "bytes_received", "bytes_staged",
                                                  "bytes_direct")}


@dataclass(frozen=True)
class OpRecord:
    """Which operation, for error messages: ``<group> <op> #<seq> (peer <p>)``."""

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
    """

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:  # type: ignore[override]
        return self._future

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
        self._future.wait()


def make_work(future: torch.futures.Future) -> dist.Work:
    """A torch ``Work`` whose ``wait()`` and ``get_future()`` follow ``future``."""
    return BimetalWork(future)


def completed_work(value: object = None) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return make_work(fut)


def check_dtype(op: OpRecord, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    if tensor.dtype not in allowed:
        raise UnsupportedOperation(f"{op.describe()}: dtype {tensor.dtype} is not supported by this transport; "
                                   f"supported: {', '.join(str(d).replace('torch.', '') for d in allowed)}")


class BimetalProcessGroup(dist.ProcessGroup):
    """Base of the bimetal transports; subclasses implement the torch op methods they support."""

    backend_name = "bimetal"

    def __init__(self, rank: int, size: int, timeout: timedelta, global_ranks: list[int] | None = None):
        # (torch's stubs list only the overload that takes a store; the (rank, size) one exists)
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self.timeout = timeout
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self.counters = CommCounters()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._name = ""
        self._desc = ""
        self._closed = False
        self.store: dist.Store | None = None
        """The group's store, for the desync report after a timeout (set by the creator)."""

    # --- names: DeviceMesh, DTensor and functional collectives need them ---------------------------
    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's method name)
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._desc

    def getBackendName(self) -> str:  # noqa: N802
        return self.backend_name

    def name(self) -> str:  # type: ignore[override]
        return self.backend_name

    def size(self) -> int:  # type: ignore[override]
        return self._size

    def rank(self) -> int:  # type: ignore[override]
        return self._rank

    # --- helpers for subclasses ----------------------------------------------------------------------
    @property
    def description(self) -> str:
        return self._desc or self._name or self.backend_name

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    def _begin(self, op: str, peer: int | None = None) -> OpRecord:
        """Start an op: check the group is open, take the next sequence number."""
        if self._closed:
            raise TransportError(f"group {self.description!r} {op}: the process group was shut down")
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        self.counters.add(ops=1)
        return OpRecord(self.description, op, seq, None if peer is None else self.global_rank(peer))

    def diagnose(self, op: OpRecord, wait_s: float | None = None) -> str:
        """After a timeout: publish where this rank is and say where the others are (desync detection).

        Each rank that times out writes ``{"op", "seq"}`` (JSON) under its group rank; peers that are alive
        but stuck elsewhere time out too and publish theirs. Returns a sentence fragment for the error.
        """
        if self.store is None:
            return ""
        # peers time out up to the skew between ranks later; the bound is timeout + 30 s in all
        wait_s = wait_s if wait_s is not None else min(25.0, max(5.0, self.timeout.total_seconds()))
        try:
            self.store.set(f"bimetal_diag/{self._rank}", json.dumps({"op": op.op, "seq": op.seq}))
        except Exception:
            return ""
        notes = []
        for r in range(self._size):
            if r == self._rank:
                continue
            key = f"bimetal_diag/{r}"
            try:
                self.store.wait([key], timedelta(seconds=wait_s))
                rec = json.loads(self.store.get(key))
                peer_op, peer_seq = rec["op"], rec["seq"]
                if not isinstance(peer_op, str) or not isinstance(peer_seq, int):
                    raise ValueError
            except (RuntimeError, ValueError, KeyError, TypeError):
                notes.append(f"rank {self.global_rank(r)} did not report (dead, or busy outside this group)")
                continue
            if {peer_op, op.op} == {"send", "recv"}:  # the two ends of point-to-point traffic
                notes.append(f"rank {self.global_rank(r)} is in {peer_op} #{peer_seq}")
            elif (peer_op, peer_seq) != (op.op, op.seq):
                notes.append(f"desync: rank {self.global_rank(r)} is in {peer_op} #{peer_seq}")
            else:
                notes.append(f"rank {self.global_rank(r)} is in the same {peer_op} #{peer_seq}")
        return "; ".join(notes)

    def unsupported(self, op: str, what: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"group {self.description!r}: {op} with {what} is not supported by "
                                    f"{self.backend_name}")

    def shutdown(self) -> None:  # type: ignore[override]
        self._closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r}, rank {self._rank} of {self._size})"
