"""How long the proxy thread sleeps when nothing moved: it never spins, and it never oversleeps a write.

A spinning thread takes the CPU the engine's own threads need, and the engine's write completions can only
be polled. So the proxy sleeps in ``select`` (a new op or a note wakes it at once) and, while writes are in
flight, naps until the oldest is due by the write rate measured to that peer, then polls with a back-off
capped at a small share of the write's expected time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from bimetal.comm.device_direct.credits import CREDIT_DELAY_S
from bimetal.comm.device_direct.ops import Op, OpState

WRITE_NAP_S = 200e-6  # least cap on the poll interval while eager writes (<= one chunk) are in flight
BULK_NAP_S = 1e-3  # least cap while rendezvous writes are in flight: their end is >= 4 MiB away
LATE_SHARE = 1 / 32  # past its expected end, a write is polled every 1/32 of its expected time (or the cap)
IDLE_NAP_S = 0.05  # longest sleep while only notes can move things (a note wakes the proxy at once)


class Pacer:
    """The measured write rate per peer and the nap that follows from it."""

    def __init__(self) -> None:
        self._rate: dict[int, float] = {}  # peer -> measured write rate (bytes/s), to pace the polls
        self._since: dict[int, float] = {}  # peer -> start of the current busy period, or last completion
        self._done: dict[int, int] = {}  # bytes completed this round, per peer

    def busy(self, peer: int) -> None:
        """The link to ``peer`` starts a busy period now (its first write in flight)."""
        self._since[peer] = time.monotonic()

    def completed(self, peer: int, nbytes: int) -> None:
        self._done[peer] = self._done.get(peer, 0) + nbytes

    def measure(self) -> None:
        """Bytes that completed per busy second to each peer: a moving average of the link's write rate."""
        now = time.monotonic()
        for peer, n in self._done.items():
            if n:
                sample = n / max(now - self._since[peer], 1e-6)
                self._rate[peer] = 0.7 * self._rate[peer] + 0.3 * sample if peer in self._rate else sample
                self._since[peer] = now
        self._done.clear()

    def nap(self, idle: float, sends: list[Op], recvs: Iterable[Op], owing: bool) -> float:
        """How long to sleep after ``idle`` seconds without progress (a new op or a note ends it early)."""
        recvs = list(recvs)
        if not (sends or recvs or owing):
            return IDLE_NAP_S
        nap = IDLE_NAP_S
        if owing:
            nap = min(nap, CREDIT_DELAY_S)
        if any(op.state is OpState.NEW and op.ready is not None for op in sends + recvs):
            nap = min(nap, WRITE_NAP_S, max(idle / 4, 20e-6))
        for op in sends:  # completions can only be polled, and each poll costs CPU the engine needs
            if op.pending:
                nap = min(nap, self._write_nap(op, idle))
        return nap

    def _write_nap(self, op: Op, idle: float) -> float:
        """Sleep until the oldest write of ``op`` is due by the link rate measured so far (half its expected
        time, to be safe), then poll with a back-off capped at a small share of that time: a write that takes
        200 ms on a slow link is polled a few dozen times, not a thousand (on 2 cores the polls were what made
        device-direct slower than cpu-forward there), and one that takes 200 us is not left waiting."""
        now = time.monotonic()
        expected = op.pending[0][1] / self._rate[op.peer] if op.peer in self._rate else 0.0
        due = self._since[op.peer] + expected / 2
        if due > now:
            return due - now
        cap = max(BULK_NAP_S if op.state is OpState.WRITING else WRITE_NAP_S, expected * LATE_SHARE)
        return min(cap, max(idle / 4, 20e-6))
