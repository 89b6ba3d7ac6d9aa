"""Stripe failover for cpu-forward point-to-point transfers: when one stripe of a message stalls or fails,
its chunks are re-sent on the stripes that still work, and the stripe is left for the rest of the group's life.

Used when a group has K > 1 stripes (one stripe keeps the plain paths of ``p2p`` and ``pipeline``: nothing to fail
over to). ``Failover`` is a group's failover state; ``Transfer`` one message; the stripes' liveness is ``links``, the
status message ``status``, the chunks' bytes come from and go to the chunk I/O of ``chunks``.

Protocol. Round 0 follows the plan both sides compute (``striping.chunk_plan``: stripe shares by bytes, with
the weights the previous transfer's final status agreed on, see ``balance``); each side skips the stripes
it already holds dead. When the receiver has seen every chunk it posted arrive or get lost
with its stripe, it sends a *status* on every stripe it holds alive: a fixed-layout int64 tensor (``status``, no
pickle). The sender waits for it on every stripe it holds alive, kills the stripes the mask names, and
re-sends the missing chunks: the i-th missing chunk on the (i mod n)-th of the n stripes the mask leaves
alive. Both sides derive that assignment from the one message, so they never disagree on which chunk rides
where; a stripe that one side holds alive and the other dead carries nothing that matches, stalls, and dies
on the other side too. A status with nothing missing is the acknowledgement a send waits for: only then
may the caller reuse the send buffer. (Messages up to one chunk are copied to a pooled buffer first, so
their caller goes on at once and the worker thread waits for the acknowledgement; the receiver's caller
goes on as soon as the data is complete.)

Stalls. Once the peer is known to be in the transfer (an op of the current phase completed), a stripe with
ops in flight that completes none for ``stall_s`` is declared stalled, but only while another stripe still
works: when every stripe stalls, the op's timeout decides (``TransportTimeout``), exactly as with one
stripe. A stripe is killed by timing out a dummy receive on it: Gloo then closes every pair of that context,
fails the ops still posted there and writes nothing more into their buffers (measured on torch 2.13), so
the buffer of a lost chunk may be reused at once and late data can never land in a later transfer. The
Gloo op stuck on the dead link is never waited for again. Each stripe warns once, when it dies.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from bimetal.comm.base import TransportError
from bimetal.comm.cpu_forward.balance import rebalance
from bimetal.comm.cpu_forward.chunks import ChunkIO
from bimetal.comm.cpu_forward.links import CONTROL_TAG, StripeSet, Waiter, short_error
from bimetal.comm.cpu_forward.stats import StripeStats
from bimetal.comm.cpu_forward.status import CORRUPT, DONE, HEADER, MORE, Status, word_count
from bimetal.comm.cpu_forward.work import Deadline
from bimetal.comm.striping import chunk_plan

__all__ = ["CORRUPT", "DONE", "MORE", "Failover", "Status", "Transfer"]

MAX_STRIPES = 62  # the dead-stripe mask is one int64
_GRACE_S = 2.0  # waiter threads outlive the op deadline a little: the coordinator reports the timeout


class Failover:
    """The failover side of one group: its stripes (``links``), one waiter thread per stripe and (direction, peer),
    the stripe shares each (direction, peer) agreed on last, and the per-stripe counters."""

    def __init__(self, links: StripeSet, name: Callable[[], str], global_ranks: list[int], chunk_bytes: int,
                 stall_s: float, stats: StripeStats):
        self.links, self.name, self.global_ranks, self.chunk_bytes = links, name, global_ranks, chunk_bytes
        self.stall_s, self.stats = stall_s, stats
        self._lock = threading.Lock()
        self._waiters: dict[Any, list[Waiter]] = {}
        self._weights: dict[Any, list[int]] = {}  # stripe shares per (direction, peer), agreed per transfer

    def transfer(self, key: tuple[str, int], tag: int, turn: int, data: torch.Tensor, d: Deadline, window: int,
                 crc: bool = False) -> tuple[Transfer, list[tuple[int, int]]]:
        """The transfer of ``data`` (flat) with peer ``key[1]`` and its chunks' element ranges, planned with the
        stripe shares the previous transfer of ``key`` agreed on; with ``crc``, one more chunk (the checksum) on
        the first stripe."""
        k, peer = len(self.links), key[1]
        with self._lock:
            if key not in self._waiters:
                self._waiters[key] = [Waiter(f"bimetal-cf-{self.name()}-{key}-s{s}") for s in range(k)]
        weights = self._weights.get(key)
        plan = chunk_plan(data.numel(), data.element_size(), self.chunk_bytes, k, turn, weights)
        order = [(j, s) for j, (_, _, s) in enumerate(plan)] + ([(len(plan), plan[0][2])] if crc else [])
        t = Transfer(self.links, self._waiters[key], peer, self.global_ranks[peer], tag, turn, order, d, self.stall_s,
                     max(window, k), weights)
        return t, [(a, b) for a, b, _ in plan]

    def settled(self, key: tuple[str, int], t: Transfer) -> None:
        """After a transfer of ``key`` completed: keep the shares it agreed on; a send counts its stripes' bytes
        and whether it failed over (the sender's side only, so that sums over ranks count each byte once)."""
        if t.next_weights is not None:
            self._weights[key] = t.next_weights
        if key[0] == "send":
            self.stats.transfer(t.moved, t.rounds)

    def stop(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.stop()


class Transfer:
    """One point-to-point message with failover; ``send`` / ``recv`` run it on the caller's worker thread."""

    def __init__(self, stripes: StripeSet, waiters: list[Waiter], peer: int, peer_global: int, tag: int,
                 number: int, plan: list[tuple[int, int]], deadline: Deadline, stall_s: float, window: int,
                 weights: list[int] | None = None):
        """``plan``: (chunk, stripe) of round 0 in posting order (``striping.chunk_plan``); ``weights``: the
        stripe shares that plan was made with (None: equal)."""
        self.stripes, self.waiters, self.peer, self.peer_global = stripes, waiters, peer, peer_global
        self.tag, self.number, self.chunks, self.d = tag, number, len(plan), deadline
        self.stall_s, self.window = stall_s, max(1, window)
        self.k = len(stripes)
        self.plan = plan
        self.weights = weights
        self.next_weights: list[int] | None = None
        """Stripe shares for the next transfer of this direction and peer, agreed in the final status."""
        self.moved: dict[int, int] = {}
        """Bytes per stripe whose op completed, all rounds."""
        self.rounds = 0
        """Re-send rounds this transfer needed (0: no stripe failed)."""
        self.last_error = ""

    def kill(self, s: int, reason: str) -> None:
        self.last_error = reason
        self.stripes.kill(s, self.peer, reason, self.d.op.group, self.peer_global)

    def no_stripe_left(self) -> TransportError:
        return TransportError(f"{self.d.op.describe()} failed: {self.last_error or 'no stripe left'} "
                              f"(all {self.k} stripes of the group are down)")

    # --- sender -------------------------------------------------------------------------------------------
    def send(self, io: ChunkIO, release: Callable[[], None] | None = None) -> None:
        """``release``: called once round 0 is on the wire, when ``io`` holds a private copy of the message."""
        plan, round_, active = self.plan, 0, False
        while True:
            _Phase(self, active).pump("send", plan, io)
            if release is not None and round_ == 0:
                release()
            status = self._await_status(round_)
            if status.flags == CORRUPT:
                raise TransportError(f"{self.d.op.describe()}: the receiver found a checksum mismatch, the data "
                                     "was corrupted in transit")
            if status.flags == DONE:
                self.next_weights = status.weights
                return
            plan, round_, active = status.assignment, round_ + 1, True
            self.rounds = round_

    def _await_status(self, round_: int) -> Status:
        words = word_count(self.chunks)
        bufs = {s: torch.zeros(HEADER + words + self.k, dtype=torch.int64) for s in self.stripes.alive()}

        def first(s: int) -> None:  # the receiver's dead stripes are dead: no need to wait them out here
            mask = Status.parse(bufs[s], round_, self.number, self.chunks, self.k, self.d.op).dead_mask
            for o in self.stripes.alive():
                if mask >> o & 1:
                    self.kill(o, "the peer found it dead")

        got = [bufs[s] for s in self._exchange("recv", bufs, first)]
        if any(not torch.equal(g, got[0]) for g in got[1:]):
            raise TransportError(f"{self.d.op.describe()}: the peer's status messages disagree (not used)")
        return Status.parse(got[0], round_, self.number, self.chunks, self.k, self.d.op)

    def _exchange(self, kind: str, bufs: dict[int, torch.Tensor],
                  first: Callable[[int], None] | None = None) -> list[int]:
        """Send or receive the status on every stripe of ``bufs``; return those where it went through.

        Waited here in turn, not on the waiter threads (they would cost two thread hops per message). The
        peer is inside the transfer, so the first status goes through within about one stall timeout (the
        peer may be waiting out a stall itself): 2 x ``stall_s`` in all, else the peer is gone or desynced.
        Once one went through, the others came with it: a stripe still silent after ``stall_s`` is dead.
        A Gloo wait that times out closes its stripe, which is what a stripe that ends silent must be.
        """
        works = {}
        for s, buf in bufs.items():
            if self.stripes.is_dead(s):
                continue
            try:
                works[s] = self.stripes.post(s, kind, buf, self.peer, CONTROL_TAG)
            except RuntimeError as exc:
                self.kill(s, short_error(exc))
        confirm_by = time.monotonic() + 2 * self.stall_s
        done: list[int] = []
        for s, work in works.items():
            if self.stripes.is_dead(s):
                continue
            now = time.monotonic()
            limit = max(confirm_by - now, 0.1 * self.stall_s) if not done else self.stall_s
            try:
                work.wait(timedelta(seconds=max(0.001, min(limit, self.d.end - now))))
            except RuntimeError as exc:
                if time.monotonic() >= self.d.end - 0.01:
                    raise self.d.expired() from None
                self.kill(s, short_error(exc) if time.monotonic() - now < limit - 0.01 else
                          f"no status for {limit:.3g} s")
                continue
            done.append(s)
            if len(done) == 1 and first is not None:
                first(s)
        if not done:
            other = "receiver did not confirm the transfer" if kind == "recv" else "sender did not take the status"
            raise TransportError(f"{self.d.op.describe()} failed: the {other} within {2 * self.stall_s:g} s "
                                 "(dead, stalled, or in a message of another size)"
                                 + (f"; {self.last_error}" if self.last_error else ""))
        return done

    # --- receiver -----------------------------------------------------------------------------------------
    def recv(self, io: ChunkIO, verify: Callable[[], bool] | None = None,
             complete: Callable[[], None] | None = None) -> None:
        """``complete``: called when every chunk is in and verified, before the final status goes out."""
        plan, missing, round_, active = self.plan, set(range(self.chunks)), 0, False
        first_phase: _Phase | None = None
        while True:
            phase = _Phase(self, active)
            first_phase = first_phase or phase
            missing -= phase.pump("recv", plan, io)
            alive = self.stripes.alive()
            if not alive:
                raise self.no_stripe_left()
            flags = MORE if missing else (DONE if verify is None or verify() else CORRUPT)
            dead = self.stripes.dead_mask()
            if flags == DONE:  # measured on round 0 only: a re-send round says nothing about the links' rates
                self.next_weights = rebalance(self.weights, self.k, dead, first_phase.moved if round_ == 0 else {},
                                              {s: t - first_phase.start for s, t in first_phase.finish.items()})
            status = Status.encode(self.number, round_, flags, dead, missing, self.chunks, self.next_weights,
                                   self.k)
            if flags == DONE and complete is not None:
                complete()
            # (the sender's chunks follow once it has the status: the next round starts with the peer seen)
            self._exchange("send", {s: status for s in alive})
            if flags == CORRUPT:
                raise TransportError(f"{self.d.op.describe()}: checksum mismatch, the data was corrupted in "
                                     "transit (not used)")
            if flags == DONE:
                return
            plan = [(j, alive[i % len(alive)]) for i, j in enumerate(sorted(missing))]
            round_, active = round_ + 1, True
            self.rounds = round_


class _Phase:
    """Ops of one transfer in flight on the stripes, and the rule that declares a stripe stalled."""

    def __init__(self, t: Transfer, active: bool):
        self.t = t
        self.events: queue.Queue = queue.Queue()
        self.pending: dict[int, deque[tuple[Any, ...]]] = {s: deque() for s in range(t.k)}
        self.clock: dict[int, float] = {}  # when the stripe last completed an op or went from idle to busy
        self.done_at: dict[int, float] = {}  # when it last completed one
        self.active_at = time.monotonic() if active else None
        self.start = time.monotonic()
        self.moved: dict[int, int] = {}  # bytes per stripe whose op completed, and when the last one did
        self.finish: dict[int, float] = {}

    def _others_work(self, s: int) -> bool:
        """Whether another stripe is fine while ``s`` stalls: idle (its share done), or still completing ops
        at least half a stall timeout after ``s`` last moved. (Stripes that stop within a moment of each
        other stalled together: the peer, not a link; the op timeout decides then.)"""
        since = max(self.active_at or 0.0, self.clock[s]) + self.t.stall_s / 2
        return any(o != s and (not self.pending[o] or self.done_at.get(o, 0.0) >= since)
                   for o in self.t.stripes.alive())

    def post(self, s: int, kind: str, buf: torch.Tensor, tag: int, token: tuple[Any, ...]) -> bool:
        t = self.t
        if t.stripes.is_dead(s):
            return False
        try:
            work = t.stripes.post(s, kind, buf, t.peer, tag)
        except RuntimeError as exc:  # the pair is already closed
            t.kill(s, short_error(exc))
            return False
        if not self.pending[s]:
            self.clock[s] = time.monotonic()
        self.pending[s].append(token)
        t.waiters[s].watch(work, t.d.end + _GRACE_S, lambda err: self.events.put((s, token, err)))
        return True

    def pump(self, kind: str, plan: list[tuple[int, int]], io: ChunkIO) -> set[int]:
        """Post the chunks of ``plan`` (at most ``window`` in flight); return those whose op completed."""
        todo, done = deque(plan), set()
        inflight = 0

        def fill() -> None:
            nonlocal inflight
            while todo and inflight < self.t.window:
                j, s = todo.popleft()
                if self.t.stripes.is_dead(s):
                    continue
                buf = io.buffer(j)
                if self.post(s, kind, buf, self.t.tag, ("chunk", j, buf, s)):
                    inflight += 1
                else:
                    io.release(j, buf, False)

        def finished(token: tuple[Any, ...], ok: bool) -> None:
            nonlocal inflight
            if token[0] == "chunk":
                inflight -= 1
                if ok:
                    done.add(token[1])
                    s = token[3]
                    self.moved[s] = self.moved.get(s, 0) + token[2].numel() * token[2].element_size()
                    self.finish[s] = time.monotonic()
                    self.t.moved[s] = self.t.moved.get(s, 0) + token[2].numel() * token[2].element_size()
                io.release(token[1], token[2], ok)
                fill()

        if len(plan) == 1 and self.active_at is None:
            return self._single(kind, plan[0], io)
        fill()
        self.run(lambda token: finished(token, True), lambda token: finished(token, False))
        return done

    def _single(self, kind: str, chunk: tuple[int, int], io: ChunkIO) -> set[int]:
        """One chunk, the peer not yet seen: no stall can be told from a late peer, so the waiter threads have
        nothing to decide; wait here (two thread hops less for small messages)."""
        t, (j, s) = self.t, chunk
        if t.stripes.is_dead(s):
            return set()
        buf = io.buffer(j)
        ok = False
        try:
            t.stripes.post(s, kind, buf, t.peer, t.tag).wait(timedelta(seconds=max(0.001, t.d.end - time.monotonic())))
            ok = True
            t.moved[s] = t.moved.get(s, 0) + buf.numel() * buf.element_size()
        except RuntimeError as exc:
            if time.monotonic() >= t.d.end - 0.01:
                raise t.d.expired() from None
            t.kill(s, short_error(exc))
        finally:
            io.release(j, buf, ok)
        return {j} if ok else set()

    def run(self, on_done: Callable[[tuple[Any, ...]], None], on_lost: Callable[[tuple[Any, ...]], None]) -> None:
        """Until no op is pending on a live stripe; completions go to ``on_done``, ops of dead stripes to
        ``on_lost``."""
        t = self.t
        while True:
            for s in range(t.k):
                while self.pending[s] and t.stripes.is_dead(s):
                    on_lost(self.pending[s].popleft())
            live = [s for s in range(t.k) if self.pending[s]]
            if not live:
                return
            now = time.monotonic()
            if now >= t.d.end:
                raise t.d.expired()
            wake = t.d.end
            if self.active_at is not None:
                due = {s: max(self.active_at, self.clock[s]) + t.stall_s for s in live}
                stalled = [s for s in live if now >= due[s]]
                doomed = [s for s in stalled if self._others_work(s)]
                for s in doomed:
                    t.kill(s, f"no progress for {t.stall_s:g} s")
                if doomed:
                    continue
                wake = min([wake, *(due[s] for s in live if s not in stalled)])
            try:
                s, token, err = self.events.get(timeout=max(0.0, wake - now))
            except queue.Empty:
                continue
            if not any(tok is token for tok in self.pending[s]):
                continue  # lost with its stripe already
            if err is not None:
                t.kill(s, err)
                continue
            self.pending[s] = deque(tok for tok in self.pending[s] if tok is not token)
            self.clock[s] = self.done_at[s] = time.monotonic()
            self.active_at = self.active_at or self.clock[s]
            on_done(token)


