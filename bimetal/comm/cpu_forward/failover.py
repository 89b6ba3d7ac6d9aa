"""Stripe failover for cpu-forward point-to-point transfers: when one stripe of a message stalls or fails,
its chunks are re-sent on the stripes that still work, and the stripe is left for the rest of the group's life.

Used when a group has K > 1 stripes (one stripe keeps the plain path of ``pg.py``: nothing to fail over to).

Protocol. Round 0 follows the plan both sides compute (``striping.chunk_plan``: stripe shares by bytes, with
the weights the previous transfer's final status agreed on, see ``balance``); each side skips the stripes
it already holds dead. When the receiver has seen every chunk it posted arrive or get lost
with its stripe, it sends a *status* on every stripe it holds alive: a fixed-layout int64 tensor
``[magic, transfer number, round, flags, dead-stripe mask, missing count, bitmap of missing chunks]`` (no
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

import contextlib
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch

from bimetal.comm.base import TransportError
from bimetal.comm.cpu_forward.balance import WEIGHT_SCALE, rebalance

if TYPE_CHECKING:
    from bimetal.comm.cpu_forward.work import Deadline

MAGIC = 0x626D6631  # "bmf1"
CONTROL_TAG = 0x7FFF0001  # status messages; chunks keep the caller's tag
POISON_TAG = 0x7FFF0002  # the dummy receive that kills a stripe; never sent
MAX_STRIPES = 62  # the dead-stripe mask is one int64
_HEADER = 6
DONE, MORE, CORRUPT = 0, 1, 2
_GRACE_S = 2.0  # waiter threads outlive the op deadline a little: the coordinator reports the timeout


class _Stalled:
    """A stalled stripe's op as this rank sees it (test hook): never completes; fails once the stripe dies."""

    def __init__(self, gone: threading.Event):
        self._gone = gone

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._gone.wait(timeout.total_seconds() if timeout is not None else None):
            raise RuntimeError("stripe closed while stalled (injected fault)")
        raise RuntimeError("timed out on a stalled stripe (injected fault)")


class StripeSet:
    """The Gloo contexts of one group and which of them still work; shared by all of the group's transfers."""

    def __init__(self, pgs: list[Any], interfaces: list[str | None]):
        self.pgs = pgs
        self.interfaces = interfaces
        self.dead: dict[int, str] = {}
        """Stripe -> why it was left (stall or the Gloo error); never used again."""
        self._lock = threading.Lock()
        self._gone = [threading.Event() for _ in pgs]
        self._stall_after: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.pgs)

    def alive(self) -> list[int]:
        with self._lock:
            return [s for s in range(len(self.pgs)) if s not in self.dead]

    def is_dead(self, s: int) -> bool:
        with self._lock:
            return s in self.dead

    def dead_mask(self) -> int:
        with self._lock:
            return sum(1 << s for s in self.dead)

    def stall_after(self, stripe: int, ops: int) -> None:
        """Test hook: after ``ops`` more ops this rank posts nothing on ``stripe`` and sees nothing complete."""
        if not 0 <= stripe < len(self.pgs):
            raise ValueError(f"no stripe {stripe}; this group has {len(self.pgs)}")
        with self._lock:
            self._stall_after[stripe] = ops

    def post(self, s: int, kind: str, buf: torch.Tensor, peer: int, tag: int) -> Any:
        with self._lock:
            left = self._stall_after.get(s)
            if left is not None:
                if left <= 0:
                    return _Stalled(self._gone[s])
                self._stall_after[s] = left - 1
        pg = self.pgs[s]
        return pg.send([buf], peer, tag) if kind == "send" else pg.recv([buf], peer, tag)

    def kill(self, s: int, peer: int, reason: str, group: str, peer_global: int) -> None:
        """Leave stripe ``s`` for good: close its Gloo context (every pair) and warn once."""
        with self._lock:
            if s in self.dead:
                return
            self.dead[s] = reason
        # An application-side timeout makes Gloo close all pairs of the context and fail their ops.
        with contextlib.suppress(RuntimeError):
            self.pgs[s].recv([torch.zeros(1)], peer, POISON_TAG).wait(timedelta(milliseconds=1))
        self._gone[s].set()
        iface = self.interfaces[s] if s < len(self.interfaces) and self.interfaces[s] else "Gloo's default device"
        warnings.warn(f"bimetal cpu-forward group {group!r}: stripe {s} (interface {iface}) to peer {peer_global} "
                      f"is degraded ({reason}); its chunks are re-sent on the other stripes and later transfers "
                      "avoid it", RuntimeWarning, stacklevel=2)


class Waiter:
    """A thread that waits on one stripe's works in posting order and reports each outcome."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def watch(self, work: Any, end: float, report: Callable[[str | None], None]) -> None:
        self._jobs.put((work, end, report))

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, end, report = job
            try:
                work.wait(timedelta(seconds=max(0.001, end - time.monotonic())))
            except Exception as exc:  # the Gloo error of this stripe: the coordinator decides what it means
                report(short_error(exc))
            else:
                report(None)


class ChunkIO(Protocol):
    """Where chunk j's bytes come from (send) or go (receive); ``release`` after its op completed or was lost."""

    def buffer(self, j: int) -> torch.Tensor: ...

    def release(self, j: int, buf: torch.Tensor, ok: bool) -> None: ...


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
        words = _words(self.chunks)
        bufs = {s: torch.zeros(_HEADER + words + self.k, dtype=torch.int64) for s in self.stripes.alive()}

        def first(s: int) -> None:  # the receiver's dead stripes are dead: no need to wait them out here
            mask = Status.parse(bufs[s], self, round_).dead_mask
            for o in self.stripes.alive():
                if mask >> o & 1:
                    self.kill(o, "the peer found it dead")

        got = [bufs[s] for s in self._exchange("recv", bufs, first)]
        if any(not torch.equal(g, got[0]) for g in got[1:]):
            raise TransportError(f"{self.d.op.describe()}: the peer's status messages disagree (not used)")
        return Status.parse(got[0], self, round_)

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


def short_error(exc: BaseException) -> str:
    """A Gloo error's first sentence, without its source-file prefix."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]


def _words(chunks: int) -> int:
    return (chunks + 31) // 32


class Status:
    """The receiver's status: fixed-layout int64, validated field by field (it comes off the network)."""

    def __init__(self, flags: int, dead_mask: int, missing: list[int], k: int, weights: list[int] | None = None):
        self.flags, self.dead_mask, self.missing, self.weights = flags, dead_mask, missing, weights
        alive = [s for s in range(k) if not dead_mask >> s & 1]
        self.assignment = [(j, alive[i % len(alive)]) for i, j in enumerate(missing)] if alive else []

    @staticmethod
    def encode(number: int, round_: int, flags: int, dead_mask: int, missing: set[int], chunks: int,
               weights: list[int] | None = None, k: int | None = None) -> torch.Tensor:
        """``weights``: the stripe shares of the next transfer (with DONE); all zero: keep the current ones."""
        bits = [0] * _words(chunks)
        for j in missing:
            bits[j // 32] |= 1 << (j % 32)
        shares = list(weights) if weights else [0] * (k or 0)  # (no words at all: read as "keep")
        return torch.tensor([MAGIC, number, round_, flags, dead_mask, len(missing), *bits, *shares],
                            dtype=torch.int64)

    @staticmethod
    def parse(raw: torch.Tensor, t: Transfer, round_: int) -> Status:
        v = [int(x) for x in raw.tolist()]
        magic, number, rnd, flags, mask, count = v[:_HEADER]
        words = _words(t.chunks)
        shares = v[_HEADER + words:]
        v = v[:_HEADER + words]
        missing = [w * 32 + b for w, word in enumerate(v[_HEADER:]) for b in range(32) if word >> b & 1]
        problems = [name for name, bad in (
            ("magic", magic != MAGIC), ("transfer number", number != t.number), ("round", rnd != round_),
            ("flags", flags not in (DONE, MORE, CORRUPT)), ("dead mask", not 0 <= mask < 1 << t.k),
            ("missing count", count != len(missing) or (flags == MORE) != (count > 0)),
            ("missing chunk", any(j >= t.chunks for j in missing) or any(w >> 32 for w in v[_HEADER:])),
            ("alive stripes", flags == MORE and mask == (1 << t.k) - 1),
            ("stripe weights", len(shares) not in (0, t.k) or any(not 0 <= w <= WEIGHT_SCALE for w in shares)
             or (any(shares) and (not any(shares[s] for s in range(t.k) if not mask >> s & 1)
                                  or any(shares[s] for s in range(t.k) if mask >> s & 1))))) if bad]
        if problems:
            raise TransportError(f"{t.d.op.describe()}: malformed status from the peer (bad "
                                 f"{', '.join(problems)}); not used")
        return Status(flags, mask, missing, t.k, shares if any(shares) else None)
