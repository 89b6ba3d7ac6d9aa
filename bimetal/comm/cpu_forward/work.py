"""Where cpu-forward's operations run and how their callers wait: the worker threads (one per (direction, peer) of
point-to-point traffic, one for collectives, ``Workers``), the op deadline, and ``DirectWork``, the caller-thread
fast path.

The fast path (one stripe, CPU tensors, nothing of the same direction and peer still queued on a worker):
the Gloo operations are posted on the caller's thread, which cannot block (Gloo posts asynchronously), and
``wait()`` waits for them there with the group's deadline. No thread hand-off, no future, no allocation
beyond Gloo's own: a 4 KiB message costs what a Gloo one does plus a few Python calls.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bimetal.comm.base import OpRecord, TransportError, TransportTimeout, make_work
from bimetal.comm.cpu_forward.staging import OpEnd


class Timed(Protocol):
    """What ``DirectWork`` needs of its group: the op timeout and the desync report after one."""

    timeout: timedelta
    timeout_s: float

    def diagnose(self, op: OpRecord, wait_s: float | None = None) -> str: ...


class Named(Timed, Protocol):
    """What ``LeanWork`` needs besides: the group's name and global ranks, to word an op only when it fails."""

    global_ranks: list[int]

    @property
    def description(self) -> str: ...

Diagnose = Callable[[OpRecord, "float | None"], str]
"""A group's ``diagnose``: publish where this rank is, say where the peers are (waiting the given seconds, or the
group's default for ``None``)."""

_STOP = object()


class Worker:
    """One thread running jobs in order; each job completes its own future."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job()

    def stop(self, timeout: float) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout)


def _nothing() -> None:
    pass


def _ignore(value: Any) -> None:
    pass


CLOSED_REPORT_WAIT_S = 5.0
"""How long a rank whose peer closed the connection waits for the peers' reports of where they are: a peer that
timed out publishes its report right after its Gloo closed the pair; a dead one never does (its error comes this
much later, saying so)."""


class Deadline:
    """The op's deadline (start + group timeout) and the translation of Gloo's errors into ours."""

    def __init__(self, op: OpRecord, timeout: timedelta, diagnose: Diagnose | None = None):
        self.op, self.timeout, self.diagnose = op, timeout, diagnose
        self.end = time.monotonic() + timeout.total_seconds()
        self.release: Callable[[], None] = _nothing
        """Completes the op for its caller early (the worker goes on with the rest of it)."""
        self.complete: Callable[[Any], None] = _ignore
        """Like ``release`` with the future's value: a staged op whose last host-to-device copies are enqueued
        (its end event set) completes here, then returns its slabs once the copies ran."""

    def wait(self, work: dist.Work) -> None:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise self.expired()
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise self.translate(exc) from None

    def translate(self, exc: RuntimeError) -> TransportError:
        """Gloo's error of a wait as ours: a timeout names the op and where the peers are; so does a connection
        the peer closed, which is what a peer's own timeout looks like from here when it came first (two ranks
        in different operations both time out, and the one whose Gloo gives up first closes the pair)."""
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return self.expired()
        closed = re.search(r"Connection closed by peer\s*\S*", text)
        if closed is None or not self.diagnose:
            return TransportError(f"{self.op.describe()} failed: {text.splitlines()[0]}")
        # (Gloo's guess that the peer crashed is left out: the peers' reports say what it is doing)
        where = self.diagnose(self.op, CLOSED_REPORT_WAIT_S)
        return TransportError(f"{self.op.describe()} failed: {closed.group(0).rstrip('.')}"
                              + (f"; {where}" if where else ""))

    def expired(self) -> TransportTimeout:
        where = self.diagnose(self.op, None) if self.diagnose else ""
        return TransportTimeout(f"{self.op.describe()} did not complete within {self.timeout.total_seconds():g} s "
                                "(the peer did not answer: dead, stalled or in a different operation)"
                                + (f"; {where}" if where else ""))


class Workers:
    """A group's workers by key, what the fast path must know of them (jobs whose Gloo ops are not posted yet),
    and errors that came after their op had completed for its caller (reported by the next op of that key)."""

    def __init__(self, name: Callable[[], str], timeout: timedelta, diagnose: Diagnose):
        """``name()``: the group's description, for the threads' names (torch sets it after creation)."""
        self.name, self.timeout, self.diagnose = name, timeout, diagnose
        self._workers: dict[Any, Worker] = {}
        self._lock = threading.Lock()
        self._queued: dict[Any, int] = {}  # jobs submitted per key whose Gloo ops are not posted yet
        self._deferred: dict[Any, TransportError] = {}

    def _worker(self, key: Any) -> Worker:
        with self._lock:
            if key not in self._workers:
                self._workers[key] = Worker(f"bimetal-cf-{self.name()}-{key}")
            return self._workers[key]

    def submit(self, key: Any, op: OpRecord, body: Callable[[Deadline], Any], end: OpEnd | None = None
               ) -> dist.Work:
        """Run ``body(deadline)`` on ``key``'s worker; the ``Work`` completes with its value or its error.

        ``end``: a staged op with device outputs. Its future is then device-aware (torch's CUDA future, as
        NCCL's): completed on the worker inside the host-to-device stream, it records that stream's position,
        and its ``wait()`` and ``then()`` callbacks make the caller's current stream wait for it rather than
        block (``value()`` alone does not: torch's rule for NCCL's futures too). ``Work.wait()`` also orders the
        caller's current stream on ``end``'s event (``staging.OpEnd``), the call the CPU double records."""
        fut: torch.futures.Future = torch.futures.Future(devices=[end.device]) \
            if end is not None and end.device.type != "cpu" else torch.futures.Future()

        def complete(value: Any) -> None:  # the caller may go on; the worker still finishes the op
            if not fut.done():
                fut.set_result(value)

        def release() -> None:  # (failover's confirmation still to come)
            complete(None)

        def settle(exc: TransportError) -> None:
            if not fut.done():
                fut.set_exception(exc)
                return
            # Too late for this op's caller: the next op of this worker reports it, and it is printed now.
            self._deferred[key] = exc
            warnings.warn(f"{exc} (after the operation had completed for the caller)", RuntimeWarning, stacklevel=2)

        def job() -> None:
            try:
                try:
                    earlier = self._deferred.pop(key, None)
                    if earlier is not None:
                        raise TransportError(f"{op.describe()} not started: an earlier transfer with this peer "
                                             f"failed after completing: {earlier}")
                    d = Deadline(op, self.timeout, self.diagnose)
                    d.release, d.complete = release, complete
                    value = body(d)
                finally:  # every Gloo op of this job is posted (and waited for): the fast path may post again
                    with self._lock:
                        self._queued[key] -= 1
                if not fut.done():
                    fut.set_result(value)
            except TransportError as exc:
                settle(exc)
            except Exception as exc:  # a Gloo or torch error: name the op, keep the cause's first line
                settle(TransportError(f"{op.describe()} failed: {str(exc).splitlines()[0]}"))

        with self._lock:
            self._queued[key] = self._queued.get(key, 0) + 1
        self._worker(key).submit(job)
        return make_work(fut, end)

    def direct(self, key: Any) -> bool:
        """Whether an op on ``key`` may be posted on the caller's thread: nothing of that key still waits on its
        worker to be posted (Gloo matches a pair's messages in posting order), and no late error is pending.

        Read without the lock (each dict read is atomic): only the caller's own ``submit`` raises a count, and a
        worker lowers it after posting, so a stale read can only send an op the slow (queued) way."""
        return not self._queued.get(key) and key not in self._deferred

    def stop(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.stop(timeout=5.0)


class DirectWork(dist.Work):
    """Gloo works posted on the caller's thread; ``wait()`` waits for them with the op's deadline (the group's
    timeout from the op's start), then runs ``finish`` once if given (checksum check, copy into a non-contiguous
    target, counters). ``error``: the op failed while posting; ``wait()`` raises it.
    """

    def __init__(self, pg: Timed, op: OpRecord, works: list[Any],
                 finish: Callable[[], None] | None = None, error: TransportError | None = None):
        super().__init__()
        self._pg, self._op, self._works, self._finish = pg, op, works, finish
        self._end = time.monotonic() + pg.timeout_s
        self._error: BaseException | None = error
        self._settled = error is not None
        self._lock = threading.Lock()
        self._future: torch.futures.Future | None = None

    def _deadline(self) -> Deadline:
        """What words a timeout or a Gloo error (made only then)."""
        return Deadline(self._op, self._pg.timeout, self._pg.diagnose)

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                for w in self._works:
                    remaining = self._end - time.monotonic()
                    if remaining <= 0:
                        raise self._deadline().expired()
                    try:
                        w.wait(timedelta(seconds=remaining))
                    except RuntimeError as exc:
                        raise self._deadline().translate(exc) from None
                if self._finish is not None:
                    self._finish()
            except TransportError as exc:
                self._error = exc
            except Exception as exc:  # a torch error in the finishing step: name the op
                self._error = TransportError(f"{self._op.describe()} failed: {str(exc).splitlines()[0]}")
            finally:
                self._settled = True
                self._works = []

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        if not self._settled:  # (settled: no lock to take)
            self._settle()
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:  # type: ignore[override]
        self.wait()

    def is_completed(self) -> bool:  # type: ignore[override]
        if not self._settled and all(w.is_completed() for w in self._works):
            self._settle()
        return self._settled

    def is_success(self) -> bool:  # type: ignore[override]
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        return self._error if self.is_completed() else None

    def get_future(self) -> torch.futures.Future:  # type: ignore[override]
        """A future completed when the op is (Gloo's point-to-point works have no future of their own, so a
        helper thread waits for it: only callers that ask for the future pay for the thread)."""
        with self._lock:
            if self._future is not None:
                return self._future
            fut: torch.futures.Future = torch.futures.Future()
            self._future = fut

        def complete() -> None:
            self._settle()
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(None)

        if self._settled:
            complete()
        else:
            threading.Thread(target=complete, name="bimetal-cf-future", daemon=True).start()
        return fut


class LeanWork(DirectWork):
    """The work of the one-message fast path (``p2p.Lean``): one Gloo work, nothing to finish.

    Only what the common case needs runs per op: ``wait()`` is Gloo's own wait (the stripe's Gloo context has
    the group's timeout, counted here from the wait rather than from the op's start), under the work's lock so
    that a second waiter (``get_future``'s thread) cannot take the first one's completion; the words of a
    failure or a timeout (group, op, number, peer, where the peers are) are made only when it fails, from
    ``what`` = (op, number, peer's group rank). ``wait`` and the other queries (``is_completed``, ``exception``,
    ``get_future``) are ``DirectWork``'s, through ``_settle``. Fields that start the same for every op are the
    class's: each attribute set on a torch ``Work`` subclass costs about 0.1 us.
    """

    _finish = None
    _error: BaseException | None = None
    _settled = False
    _future: torch.futures.Future | None = None
    _pg: Named

    def __init__(self, pg: Named, what: tuple[str, int, int], work: Any):  # DirectWork's fields, lazily worded
        dist.Work.__init__(self)
        self._pg, self._what, self._works, self._lock = pg, what, [work], threading.Lock()

    @property
    def _op(self) -> OpRecord:  # type: ignore[override]
        kind, seq, peer = self._what
        return OpRecord(self._pg.description, kind, seq, self._pg.global_ranks[peer])

    def _settle(self) -> None:
        with self._lock:
            if not self._settled:
                try:
                    self._works[0].wait()
                except RuntimeError as exc:
                    self._error = self._deadline().translate(exc)
                finally:
                    self._settled = True
                    self._works = []
