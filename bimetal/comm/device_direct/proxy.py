"""The CPU proxy thread's event loop: it owns the engine and drives every device-direct point-to-point op.

The training thread calls ``send``/``recv``, which enqueue and return a Future at once (an inline send is
sent right there, one thread hop less); only the proxy thread touches the engine. Each turn of the loop
admits new ops, takes the notes that arrived, advances every op by its wire protocol (``transfers.py``),
fails the ops of peers whose control connection ended, returns owed credits and checks deadlines.

Notes are JSON (checked by ``notes.py``, never pickled) on the proxy's own persistent control connections
(``control.py``; the engine's notification opens a new connection per message, too slow for a pipeline's
small messages).

The proxy never spins (a spinning thread takes the CPU the engine's own threads need). It sleeps in
``select``, woken by a new op (a socket pair) or a note from a peer (its control connection); while writes are
in flight it naps as ``pacing.py`` decides, because the engine's completions can only be polled.
Every op has a deadline; a peer whose control connection ends fails its ops at once, and peers with pending
ops are probed through the engine, so a dead peer fails its ops within the timeout, naming it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import socket
import threading
import time
from typing import Any

import torch
from torch.futures import Future

from bimetal.comm.base import TransportError, TransportTimeout
from bimetal.comm.device_direct.control import ControlChannel, wait_ready
from bimetal.comm.device_direct.engine import Engine, PeerFailedError
from bimetal.comm.device_direct.notes import BadNote, check_note
from bimetal.comm.device_direct.ops import Counters, Op, ready_event
from bimetal.comm.device_direct.transfers import Transfers

log = logging.getLogger(__name__)
_PROBE_EVERY_S = 0.5


class Proxy:
    """One proxy thread per process group; ``close()`` joins it."""

    def __init__(self, engine: Engine, rank: int, global_ranks: list[int], chunk: int = 4 << 20, slots: int = 8,
                 window: int = 16, timeout: float = 300.0, device: torch.device | None = None,
                 inline: int = 16 << 10, host: str = "127.0.0.1", reg_cache_bytes: int = 4 << 30) -> None:
        self.engine, self.rank, self.global_ranks = engine, rank, global_ranks
        self.chunk, self.nslots, self.timeout = chunk, slots, timeout
        self.inline = min(inline, chunk)
        self.device = device or torch.device("cpu")
        self.control = ControlChannel(host, rank, self.inline)  # publish .address; connect before start()
        self._lock = threading.Lock()  # sequence numbers and control sends: the caller's thread sends inline notes
        try:  # (the send pool registers memory: a refusal must not leave the listener open)
            self.transfers = Transfers(engine, self.control, self._lock, chunk, slots, window, self.device,
                                       self._peer_name, reg_cache_bytes)
        except BaseException:
            self.control.close()
            raise
        self._ops: queue.Queue[Op | None] = queue.Queue()
        self._next_seq: dict[tuple[str, int, int], int] = collections.defaultdict(int)
        self._last_probe = 0.0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"bimetal-dd-proxy-{rank}", daemon=True)

    @property
    def counters(self) -> Counters:
        return self.transfers.counters

    # -- set-up and API (training thread) -----------------------------------------------------------------

    def add_peer(self, peer: int) -> int:
        """Allocate and register (once, for the group's life) our receive slots for ``peer``; returns their
        address (publish it)."""
        # zeros, not empty: the pages are touched here, so the NUMA node of a host pool is known when it is named
        pool = torch.zeros(self.chunk * self.nslots, dtype=torch.uint8, device=self.device)
        self.transfers.registrations.fixed(f"receive slots for group rank {peer}", pool)
        self.transfers.pools[peer] = pool
        return pool.data_ptr()

    def connect(self, peer: int, endpoint: dict[str, Any], remote_pool: int) -> None:
        self.engine.connect(peer, endpoint)
        self.transfers.remote[peer] = remote_pool
        self.transfers.credits.add_peer(peer)

    def start(self) -> None:
        self._thread.start()

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Future:
        return self._enqueue("send", tensor, peer, tag, what)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Future:
        return self._enqueue("recv", tensor, peer, tag, what)

    def _enqueue(self, kind: str, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Future:
        fut: Future = Future()
        if self._stop.is_set() or not self._thread.is_alive():
            fut.set_exception(TransportError(f"{what}: the device-direct proxy is not running ({self.error})"))
            return fut
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        op = Op(kind, flat, peer, tag, what, fut, time.monotonic() + self.timeout, ready_event(tensor))
        with self._lock:
            key = (kind, peer, tag)
            op.seq = self._next_seq[key]
            self._next_seq[key] += 1
            if kind == "send" and peer not in self.transfers.dead and (
                    flat.numel() == 0 or (flat.numel() <= self.inline and flat.device.type == "cpu")):
                if self.transfers.send_inline(op):
                    self._poke()  # the socket did not take it all: the proxy pushes the rest when it is writable
                return fut
        self._ops.put(op)
        self._poke()
        return fut

    def _poke(self) -> None:
        # full (the proxy has wake-ups pending anyway) or closed (the proxy is gone): either way, nothing to do
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def close(self) -> None:
        """Stop and join the proxy thread (pending ops fail), then release registered memory and the engine."""
        self._stop.set()
        self._ops.put(None)
        self._poke()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self.control.close()  # flushes the notes of completed sends first
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        self.transfers.registrations.close()
        self.transfers.pools.clear()
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _peer_name(self, peer: int) -> str:
        return f"peer rank {self.global_ranks[peer]} (group rank {peer})"

    # -- proxy thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            last_busy = time.monotonic()
            while not self._stop.is_set():
                busy = self._take_ops()
                busy |= self._take_notes()
                busy |= self._progress()
                self._check_closed()
                self.transfers.return_credits()
                self._check_health()
                now = time.monotonic()
                if busy:
                    last_busy = now
                    continue
                t = self.transfers
                self._sleep(t.pacer.nap(now - last_busy, t.sends, t.recvs.values(), t.credits.owing))
        except BaseException as exc:  # a bug or a broken engine: every pending Work learns why
            self.error = exc
        self._fail_all(self.error or TransportError("the device-direct process group was shut down"))

    def _sleep(self, timeout: float) -> None:
        try:
            readable, writable = wait_ready([self._wake_r, *self.control.readers()], self.control.writers(), timeout)
        except OSError:  # closed under us: the group is shutting down
            return
        for sock in writable:
            with self._lock:  # (the caller's thread may be sending inline notes on the same connection)
                self.control.on_ready(sock, readable=False)
        for sock in readable:
            if sock is not self._wake_r:
                with self._lock:  # a failed read closes the connection, which must not race a send on it
                    self.control.on_ready(sock, readable=True)
                continue
            with contextlib.suppress(OSError):  # drained (BlockingIOError) or closed
                while sock.recv(4096):
                    pass

    def _take_ops(self) -> bool:
        busy = False
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return busy
            if op is None:
                return busy
            busy = True
            self._admit(op)

    def _admit(self, op: Op) -> None:
        t = self.transfers
        # a recv whose message arrived before its peer went away still gets it
        if op.peer in t.dead and not (op.kind == "recv" and op.key in t.arrived):
            op.fut.set_exception(TransportError(f"{op.what}: {t.dead[op.peer]}"))
            return
        if op.kind == "send":
            t.sends.append(op)
        else:
            t.recvs[op.key] = op

    def _take_notes(self) -> bool:
        frames = self.control.take()
        for peer, raw, payload in frames:
            if peer not in self.transfers.remote:
                continue
            try:
                note = check_note(raw, payload, self.nslots)
            except BadNote as exc:
                log.warning("device-direct: dropped a control note from %s: %s", self._peer_name(peer), exc)
                continue
            self.transfers.on_note(peer, note)
        return bool(frames)

    def _check_closed(self) -> None:
        """Fail the ops of peers whose control connection ended. Runs after ``_progress``, so a message that
        arrived just before its sender exited is still matched, not failed."""
        for peer, reason in list(self.control.closed.items()):
            if peer not in self.transfers.dead:
                self.transfers.peer_failed(peer, f"{self._peer_name(peer)} failed: {reason}")

    def _progress(self) -> bool:
        t, busy = self.transfers, False
        for op in list(t.sends):
            try:
                busy |= t.advance_send(op)
            except PeerFailedError as exc:
                t.peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        t.pacer.measure()
        for op in list(t.recvs.values()):
            try:
                busy |= t.advance_recv(op)
            except PeerFailedError as exc:
                t.peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        return busy

    # -- health ------------------------------------------------------------------------------------------

    def _check_health(self) -> None:
        now = time.monotonic()
        for op in self.transfers.pending():
            if now > op.deadline:
                self.transfers.fail(op, TransportTimeout(
                    f"{op.what} timed out after {self.timeout:.0f} s waiting for {self._peer_name(op.peer)}"))
        if now - self._last_probe < _PROBE_EVERY_S:
            return
        self._last_probe = now
        for peer in {op.peer for op in self.transfers.pending()}:
            if not self.engine.probe(peer):
                self.transfers.peer_failed(peer, f"{self._peer_name(peer)} is unreachable (its process died or its "
                                                 "engine stopped)")

    def _fail_all(self, exc: BaseException) -> None:
        for op in self.transfers.pending():
            self.transfers.fail(op, exc if isinstance(exc, TransportError) else TransportError(f"{op.what}: {exc!r}"))
        while True:
            try:
                left = self._ops.get_nowait()
            except queue.Empty:
                return
            if left is not None and not left.fut.done():
                left.fut.set_exception(TransportError(f"{left.what}: the device-direct process group was shut down"))
