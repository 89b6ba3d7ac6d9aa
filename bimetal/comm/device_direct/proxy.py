"""The CPU proxy thread: owns the engine and runs the whole control plane of device-direct point-to-point.

The training thread calls ``send``/``recv``, which enqueue and return a Future at once; only the proxy
thread touches the engine. Three wire protocols, chosen by size (both sides agree on the rendezvous one):

* **inline** (host tensors up to ``inline`` bytes, and empty messages): the payload rides in the note itself,
  on the control channel. One control message per message, no slot, no write: the lowest latency there is
  (an engine write plus a note is two exchanges). Never used for GPU memory, which would then bounce through
  the host.
* **eager** (up to ``chunk`` bytes): the sender takes a credit (a free slot of the receive pool the receiver
  registered for it), writes into that slot and notifies ``eager``; the receiver copies the slot into the
  user's tensor (device to device) and owes the credit back. Owed credits ride on the next note to that peer
  or, after a short delay (or when half the slots are owed), in a ``credit`` note of their own, so a
  ping-pong pays no extra control message. A fast sender never overwrites data the receiver has not consumed.
* **rendezvous** (larger messages): as soon as the recv is posted, the receiver registers the user's tensor
  and sends ``rtr`` with its address (receiver first: no request-to-send round trip when the recv is posted
  before the data is ready, as a pipeline does). The sender writes it in ``chunk``-sized pieces, ``window`` in
  flight (over the engine's connection lanes) so the transfers pipeline, then notifies ``fin``. The data lands in
  the user's tensor directly: no copy at all. A sender that waits long for ``rtr`` sends ``rts`` with its
  size, so a size mismatch fails both sides with the sizes named instead of timing out.

Notes are JSON (validated, never pickled) on the proxy's own persistent control connections (``control.py``;
the engine's notification opens a new connection per message, too slow for a pipeline's small messages).
Messages between a pair are matched in order per tag by a sequence number.

The proxy never spins (a spinning thread takes the CPU the engine's own threads need). It sleeps in
``select``, woken by a new op (a socket pair) or a note from a peer (its control connection). While writes are
in flight it naps, longer the longer they take, because the engine's completions can only be polled.
Every op has a deadline; a peer whose control connection ends fails its ops at once, and peers with pending
ops are probed through the engine, so a dead peer fails its ops within the timeout, naming it.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from bimetal.comm.base import TransportError, TransportTimeout
from bimetal.comm.device_direct.control import ControlChannel
from bimetal.comm.device_direct.engine import Engine, PeerFailedError, WriteStatus

_PROBE_EVERY_S = 0.5
_WRITE_NAP_S = 200e-6  # least cap on the poll interval while eager writes (<= one chunk) are in flight
_BULK_NAP_S = 1e-3  # least cap while rendezvous writes are in flight: their end is >= 4 MiB away
_LATE_SHARE = 1 / 32  # past its expected end, a write is polled every 1/32 of its expected time (or the cap)
_IDLE_NAP_S = 0.05  # longest sleep while only notes can move things (a note wakes the proxy at once)
_CREDIT_DELAY_S = 1e-3  # owed credits wait this long for a note to ride on before they get their own
_RTS_AFTER_S = 1.0  # a rendezvous sender without rtr this long tells its size (size-mismatch diagnosis)
_NOTE_FIELDS = {"inline": ("tag", "seq", "n"), "eager": ("tag", "seq", "slot", "n"), "rts": ("tag", "seq", "n"),
                "fin": ("tag", "seq"), "rtr": ("tag", "seq", "n", "addr"), "nack": ("tag", "seq", "n"),
                "credit": ()}


def _location(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"


def _ready_event(t: torch.Tensor) -> Any:
    """An event on the producing stream, so the proxy does not read (or overwrite) the tensor too early."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


@dataclass(eq=False)  # ops compare by identity (their tensors make == ambiguous)
class _Op:
    kind: str  # send | recv
    flat: torch.Tensor  # the user's bytes (uint8 view)
    peer: int
    tag: int
    what: str  # for error messages: group, op, sequence number
    fut: Future
    deadline: float
    ready: Any = None  # cuda event or None
    seq: int = -1
    state: str = "new"
    off: int = 0  # rendezvous sender: bytes posted
    pending: list[tuple[int, int]] = field(default_factory=list)  # (handle, nbytes) in flight, oldest first
    addr: int = 0  # rendezvous: the receiver's registered address of the user tensor
    slot: int = -1
    since: float = 0.0  # rendezvous sender: when it started waiting for rtr

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.peer, self.tag, self.seq)


class Proxy:
    """One proxy thread per process group; ``close()`` joins it."""

    def __init__(self, engine: Engine, rank: int, global_ranks: list[int], chunk: int = 4 << 20, slots: int = 8,
                 window: int = 16, timeout: float = 300.0, device: torch.device | None = None,
                 inline: int = 16 << 10, host: str = "127.0.0.1") -> None:
        self.engine, self.rank, self.global_ranks = engine, rank, global_ranks
        self.chunk, self.nslots, self.window, self.timeout = chunk, slots, window, timeout
        self.inline = min(inline, chunk)
        self.device = device or torch.device("cpu")
        self.staged_bytes = 0  # bytes bounced through host memory: none by construction, counted to prove it
        self.direct_bytes = 0  # bytes the engine wrote from our memory into a peer's without a host bounce
        self.landing_copy_bytes = 0  # eager bytes copied slot -> user tensor on the same device
        self.inline_sent_bytes = 0  # host-tensor bytes that rode inside our notifications (not staged: no bounce)
        self.inline_received_bytes = 0
        self.received_bytes = 0
        self.notes_sent = 0  # control messages, for profiling (`comm_stats`)
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._pools: dict[int, torch.Tensor] = {}
        self._remote: dict[int, int] = {}  # peer -> address of that peer's slot pool for us
        self._credits: dict[int, collections.deque[int]] = {}
        self._owed: dict[int, list[int]] = collections.defaultdict(list)  # peer -> slots we consumed, not returned
        self._owed_since: dict[int, float] = {}
        self._next_seq: dict[tuple[str, int, int], int] = collections.defaultdict(int)
        self._sends: list[_Op] = []
        self._recvs: dict[tuple[int, int, int], _Op] = {}
        self._arrived: dict[tuple[int, int, int], dict[str, Any]] = {}  # (peer, tag, seq) -> inline/eager/rts note
        self._rtr: dict[tuple[int, int, int], dict[str, Any]] = {}  # rtr/nack notes for sends not (yet) ready
        self._dead: dict[int, str] = {}
        self._rate: dict[int, float] = {}  # peer -> measured write rate (bytes/s), to pace the polls
        self._since: dict[int, float] = {}  # peer -> start of the current busy period, or last completion
        self._done: dict[int, int] = collections.defaultdict(int)  # bytes completed this round, per peer
        self._last_probe = 0.0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.control = ControlChannel(host, rank, self.inline)  # publish .address; connect before start()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()  # sequence numbers and control sends: the caller's thread sends inline notes
        self._thread = threading.Thread(target=self._run, name=f"bimetal-dd-proxy-{rank}", daemon=True)

    # -- set-up and API (training thread) -----------------------------------------------------------------

    def add_peer(self, peer: int) -> int:
        """Allocate and register our receive slots for ``peer``; returns their address (publish it)."""
        pool = torch.empty(self.chunk * self.nslots, dtype=torch.uint8, device=self.device)
        self.engine.register(pool.data_ptr(), pool.numel(), _location(pool))
        self._pools[peer] = pool
        return pool.data_ptr()

    def connect(self, peer: int, endpoint: dict[str, Any], remote_pool: int) -> None:
        self.engine.connect(peer, endpoint)
        self._remote[peer] = remote_pool
        self._credits[peer] = collections.deque(range(self.nslots))

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
        op = _Op(kind, flat, peer, tag, what, fut, time.monotonic() + self.timeout, _ready_event(tensor))
        with self._lock:
            key = (kind, peer, tag)
            op.seq = self._next_seq[key]
            self._next_seq[key] += 1
            if kind == "send" and peer not in self._dead and (
                    flat.numel() == 0 or (flat.numel() <= self.inline and flat.device.type == "cpu")):
                self._send_inline(op)  # on the caller's thread: the note goes out now, one thread hop less
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
        for pool in self._pools.values():
            self.engine.unregister(pool.data_ptr())
        self._pools.clear()
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _peer_name(self, peer: int) -> str:
        return f"peer rank {self.global_ranks[peer]} (group rank {peer})"

    def _rendezvous(self, nbytes: int) -> bool:
        # the one choice both sides must make alike, so it depends on the size alone
        return nbytes > self.chunk

    # -- proxy thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            last_busy = time.monotonic()
            while not self._stop.is_set():
                busy = self._take_ops()
                busy |= self._take_notes()
                busy |= self._progress()
                self._check_closed()
                self._return_credits(force=False)
                self._check_health()
                now = time.monotonic()
                if busy:
                    last_busy = now
                    continue
                self._sleep(self._nap(now - last_busy))
        except BaseException as exc:  # a bug or a broken engine: every pending Work learns why
            self.error = exc
        self._fail_all(self.error or TransportError("the device-direct process group was shut down"))

    def _nap(self, idle: float) -> float:
        """How long to sleep when nothing moved: a new op or a note ends the sleep early anyway."""
        if not (self._sends or self._recvs or self._owed):
            return _IDLE_NAP_S
        nap = _IDLE_NAP_S
        if self._owed:
            nap = min(nap, _CREDIT_DELAY_S)
        writing = [op for op in self._sends if op.pending]
        waiting_gpu = any(op.state == "new" and op.ready is not None for op in self._sends + list(self._recvs.values()))
        if waiting_gpu:
            nap = min(nap, _WRITE_NAP_S, max(idle / 4, 20e-6))
        for op in writing:  # completions can only be polled, and each poll costs CPU the engine needs
            nap = min(nap, self._write_nap(op, idle))
        return nap

    def _write_nap(self, op: _Op, idle: float) -> float:
        """Sleep until the oldest write of ``op`` is due by the link rate measured so far (half its expected
        time, to be safe), then poll with a back-off capped at a small share of that time: a write that takes
        200 ms on a slow link is polled a few dozen times, not a thousand (on 2 cores the polls were what made
        device-direct slower than cpu-forward there), and one that takes 200 us is not left waiting."""
        now = time.monotonic()
        expected = op.pending[0][1] / self._rate[op.peer] if op.peer in self._rate else 0.0
        due = self._since[op.peer] + expected / 2
        if due > now:
            return due - now
        cap = max(_BULK_NAP_S if op.state == "writing" else _WRITE_NAP_S, expected * _LATE_SHARE)
        return min(cap, max(idle / 4, 20e-6))

    def _sleep(self, timeout: float) -> None:
        try:
            readable, writable, _ = select.select([self._wake_r, *self.control.readers()], self.control.writers(),
                                                  [], timeout)
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

    def _admit(self, op: _Op) -> None:
        # a recv whose message arrived before its peer went away still gets it
        if op.peer in self._dead and not (op.kind == "recv" and op.key in self._arrived):
            op.fut.set_exception(TransportError(f"{op.what}: {self._dead[op.peer]}"))
            return
        if op.kind == "send":
            self._sends.append(op)
        else:
            self._recvs[op.key] = op

    # -- notes ---------------------------------------------------------------------------------------------

    def _take_notes(self) -> bool:
        frames = self.control.take()
        for peer, raw, payload in frames:
            note = self._parse(peer, raw, payload)
            if note is None:
                continue
            k = note["k"]
            self._credits[peer].extend(note.get("cr", ()))
            key: tuple[int, int, int] = (peer, note.get("tag", 0), note.get("seq", -1))  # credit notes have none
            if k in ("rtr", "nack"):
                self._rtr[key] = note  # picked up by the send (now, or when it is posted)
            elif k == "fin":
                recv = self._recvs.pop(key, None)
                if recv is not None:
                    self.engine.unregister(recv.flat.data_ptr())
                    if self.engine.protocol == "tcp" and recv.flat.device.type != "cpu":
                        self.staged_bytes += recv.flat.numel()  # bounced through the host inside the engine
                    self.received_bytes += recv.flat.numel()
                    recv.fut.set_result(None)
            elif k != "credit":  # inline, eager or rts: wait for the matching recv
                self._arrived[key] = note
        return bool(frames)

    def _check_closed(self) -> None:
        """Fail the ops of peers whose control connection ended. Runs after ``_progress``, so a message that
        arrived just before its sender exited is still matched, not failed."""
        for peer, reason in list(self.control.closed.items()):
            if peer not in self._dead:
                self._peer_failed(peer, f"{self._peer_name(peer)} failed: {reason}")

    def _parse(self, peer: int, note: dict[str, Any], payload: bytes) -> dict[str, Any] | None:
        if note.get("k") not in _NOTE_FIELDS or peer not in self._remote:
            return None
        fields = _NOTE_FIELDS[note["k"]]
        if not all(isinstance(note.get(f), int) and not isinstance(note.get(f), bool) for f in fields):
            return None
        note["payload"] = payload
        credits = note.get("cr", [])
        if not isinstance(credits, list) or not all(isinstance(c, int) and 0 <= c < self.nslots for c in credits):
            return None
        if len(payload) != (note["n"] if note["k"] == "inline" else 0):
            return None  # a payload belongs to an inline note, and is exactly its size
        return note

    def _notify(self, peer: int, k: str, payload: bytes = b"", **fields: Any) -> None:
        """Send a note from the proxy thread; owed credits ride along for free."""
        note = {"k": k, **fields}
        if self._owed.get(peer):
            note["cr"] = self._owed.pop(peer)
            self._owed_since.pop(peer, None)
        with self._lock:
            self._send_note(peer, note, payload)

    def _send_note(self, peer: int, note: dict[str, Any], payload: bytes) -> None:
        # (the caller holds self._lock)
        self.notes_sent += 1
        try:
            self.control.send(peer, note, payload)
        except TransportError as exc:
            raise PeerFailedError(str(exc)) from exc

    def _owe(self, peer: int, slot: int) -> None:
        self._owed[peer].append(slot)
        self._owed_since.setdefault(peer, time.monotonic())

    def _return_credits(self, force: bool) -> None:
        now = time.monotonic()
        for peer in list(self._owed):
            owed = self._owed[peer]
            if force or 2 * len(owed) >= self.nslots or now - self._owed_since.get(peer, now) >= _CREDIT_DELAY_S:
                try:
                    self._notify(peer, "credit")
                except PeerFailedError as exc:
                    self._owed.pop(peer, None)
                    self._peer_failed(peer, f"{self._peer_name(peer)} failed: {exc}")

    # -- progress ------------------------------------------------------------------------------------------

    def _progress(self) -> bool:
        busy = False
        for op in list(self._sends):
            try:
                busy |= self._advance_send(op)
            except PeerFailedError as exc:
                self._peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        self._measure_links()
        for op in list(self._recvs.values()):
            try:
                busy |= self._advance_recv(op)
            except PeerFailedError as exc:
                self._peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        return busy

    def _advance_send(self, op: _Op) -> bool:
        if op.state == "new":
            if op.ready is not None and not op.ready.query():
                return False
            nbytes = op.flat.numel()
            if self._rendezvous(nbytes):
                op.state, op.since = "wait-rtr", time.monotonic()
            else:  # (inline sends never get here: the caller's thread sent them)
                op.state = "eager"
        if op.state == "wait-rtr":
            note = self._rtr.pop(op.key, None)
            if note is None:
                if time.monotonic() - op.since > _RTS_AFTER_S:
                    self._notify(op.peer, "rts", tag=op.tag, seq=op.seq, n=op.flat.numel())
                    op.since = float("inf")  # once
                return False
            if note["k"] == "nack" or note["n"] != op.flat.numel():
                self._fail(op, TransportError(f"{op.what}: {self._peer_name(op.peer)} posted a recv of {note['n']} "
                                              f"bytes but this send has {op.flat.numel()}"))
                return True
            op.state, op.addr = "writing", note["addr"]
        if op.state == "eager":
            if not self._credits[op.peer]:
                return False
            op.slot = self._credits[op.peer].popleft()
            remote = self._remote[op.peer] + op.slot * self.chunk
            op.pending.append((self._post(op, remote, 0, op.flat.numel()), op.flat.numel()))
            op.state = "eager-writing"
        if op.state == "writing":
            while len(op.pending) < self.window and op.off < op.flat.numel():
                n = min(self.chunk, op.flat.numel() - op.off)
                op.pending.append((self._post(op, op.addr + op.off, op.off, n), n))
                op.off += n
        if op.state in ("writing", "eager-writing"):
            return self._poll_send(op)
        return False

    def _send_inline(self, op: _Op) -> None:
        """The whole of an inline send, on the caller's thread under ``self._lock``: the payload rides in the note,
        which the control channel queues and pushes at once (``close()`` flushes what the socket did not take)."""
        data = op.flat.detach().numpy().tobytes() if op.flat.numel() else b""
        try:
            self._send_note(op.peer, {"k": "inline", "tag": op.tag, "seq": op.seq, "n": op.flat.numel()}, data)
        except PeerFailedError as exc:
            op.fut.set_exception(TransportError(f"{op.what}: {self._peer_name(op.peer)} failed: {exc}"))
            return
        self.inline_sent_bytes += op.flat.numel()
        if self.control.writers():
            self._poke()  # the socket did not take it all: the proxy pushes the rest when it is writable
        op.fut.set_result(None)

    def _post(self, op: _Op, remote: int, off: int, n: int) -> int:
        if not any(o.pending for o in self._sends if o.peer == op.peer):
            self._since[op.peer] = time.monotonic()  # the link to the peer starts a busy period now
        local = op.flat.data_ptr() + off
        if self.engine.needs_source_registration and off == 0:
            self.engine.register(op.flat.data_ptr(), op.flat.numel(), _location(op.flat))
        return self.engine.post_write(op.peer, local, remote, n)

    def _poll_send(self, op: _Op) -> bool:
        busy, still = False, []
        for handle, n in op.pending:
            status = self.engine.poll(handle)
            if status is WriteStatus.PENDING:
                still.append((handle, n))
                continue
            if status is WriteStatus.FAILED:
                raise PeerFailedError(f"a {n}-byte write to it did not complete")
            self._count(op.flat, n)
            self._done[op.peer] += n
            busy = True
        op.pending = still
        done = not still and (op.state == "eager-writing" or op.off >= op.flat.numel())
        if done:
            if op.state == "eager-writing":
                self._notify(op.peer, "eager", tag=op.tag, seq=op.seq, slot=op.slot, n=op.flat.numel())
            else:
                self._notify(op.peer, "fin", tag=op.tag, seq=op.seq)
            if self.engine.needs_source_registration:
                self.engine.unregister(op.flat.data_ptr())
            self._sends.remove(op)
            op.fut.set_result(None)
        return busy or done

    def _measure_links(self) -> None:
        """Bytes that completed per busy second to each peer: a moving average of the link's write rate."""
        now = time.monotonic()
        for peer, n in self._done.items():
            if n:
                sample = n / max(now - self._since[peer], 1e-6)
                self._rate[peer] = 0.7 * self._rate[peer] + 0.3 * sample if peer in self._rate else sample
                self._since[peer] = now
        self._done.clear()

    def _count(self, t: torch.Tensor, n: int) -> None:
        # Mooncake's TCP transport bounces GPU memory through host buffers inside the engine: that is staging
        if self.engine.protocol == "tcp" and t.device.type != "cpu":
            self.staged_bytes += n
        else:
            self.direct_bytes += n

    def _advance_recv(self, op: _Op) -> bool:
        if op.state == "new":
            if op.ready is not None and not op.ready.query():
                return False
            if self._rendezvous(op.flat.numel()):  # receiver first: advertise the user's tensor right away
                self.engine.register(op.flat.data_ptr(), op.flat.numel(), _location(op.flat))
                op.state = "rtr"
                self._notify(op.peer, "rtr", tag=op.tag, seq=op.seq, n=op.flat.numel(), addr=op.flat.data_ptr())
                busy = True
            else:
                op.state, busy = "posted", False
        else:
            busy = False
        note = self._arrived.pop(op.key, None)
        if note is None:
            return busy
        return self._match_recv(op, note) or busy

    def _match_recv(self, op: _Op, note: dict[str, Any]) -> bool:
        nbytes = op.flat.numel()
        if note["n"] != nbytes:
            self._fail(op, TransportError(
                f"{op.what}: {self._peer_name(op.peer)} sent {note['n']} bytes but the recv tensor holds {nbytes}"))
            if note["k"] == "eager":
                self._owe(op.peer, note["slot"])
            elif note["k"] == "rts":
                self._notify(op.peer, "nack", tag=op.tag, seq=op.seq, n=nbytes)
            return True
        if note["k"] == "rts":  # sizes agree: our rtr is on its way (or was lost with a dead peer)
            return False
        if note["k"] == "inline":
            if nbytes:
                op.flat.copy_(torch.frombuffer(bytearray(note["payload"]), dtype=torch.uint8))
                self.inline_received_bytes += nbytes
                if op.flat.device.type != "cpu":
                    self.staged_bytes += nbytes  # a host payload into GPU memory is host staging: say so
        else:  # eager
            slot = note["slot"]
            if nbytes:
                src = self._pools[op.peer][slot * self.chunk: slot * self.chunk + nbytes]
                self._copy(op.flat, src)
                self.landing_copy_bytes += nbytes
                if src.device.type == "cpu" and op.flat.device.type != "cpu":
                    self.staged_bytes += nbytes  # a CPU pool feeding a GPU tensor is host staging: say so
                elif self.engine.protocol == "tcp" and src.device.type != "cpu":
                    self.staged_bytes += nbytes  # the engine's TCP receive path bounced it through the host
            self._owe(op.peer, slot)  # returned with the next note to the peer, or on its own shortly
        del self._recvs[op.key]
        self.received_bytes += nbytes
        op.fut.set_result(None)
        return True

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):  # device to device on the proxy's own stream
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    # -- health ------------------------------------------------------------------------------------------

    def _check_health(self) -> None:
        now = time.monotonic()
        ops = self._sends + list(self._recvs.values())
        for op in ops:
            if now > op.deadline:
                self._fail(op, TransportTimeout(
                    f"{op.what} timed out after {self.timeout:.0f} s waiting for {self._peer_name(op.peer)}"))
        if now - self._last_probe < _PROBE_EVERY_S:
            return
        self._last_probe = now
        for peer in {op.peer for op in self._sends + list(self._recvs.values())}:
            if not self.engine.probe(peer):
                self._peer_failed(peer, f"{self._peer_name(peer)} is unreachable (its process died or its engine "
                                        "stopped)")

    def _peer_failed(self, peer: int, reason: str) -> None:
        self._dead[peer] = reason
        self._owed.pop(peer, None)
        for op in [o for o in self._sends + list(self._recvs.values()) if o.peer == peer]:
            self._fail(op, TransportError(f"{op.what}: {reason}"))

    def _fail(self, op: _Op, exc: BaseException) -> None:
        if op in self._sends:
            self._sends.remove(op)
        if self._recvs.get(op.key) is op:
            del self._recvs[op.key]
        if op.kind == "recv" and op.state == "rtr":
            self.engine.unregister(op.flat.data_ptr())
        if not op.fut.done():
            op.fut.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for op in self._sends + list(self._recvs.values()):
            self._fail(op, exc if isinstance(exc, TransportError) else TransportError(f"{op.what}: {exc!r}"))
        while True:
            try:
                left = self._ops.get_nowait()
            except queue.Empty:
                return
            if left is not None and not left.fut.done():
                left.fut.set_exception(TransportError(f"{left.what}: the device-direct process group was shut down"))
