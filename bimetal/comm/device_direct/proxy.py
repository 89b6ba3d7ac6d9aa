"""The CPU proxy thread: owns the engine and runs the whole control plane of device-direct point-to-point.

The training thread calls ``send``/``recv``, which enqueue and return a Future at once; only the proxy
thread touches the engine. Two wire protocols, both one-sided writes into the receiver's registered memory:

* **eager** (messages up to ``chunk`` bytes): the sender takes a credit (a free slot of the receive pool the
  receiver registered for it), writes into that slot and notifies ``eager``; the receiver copies the slot into
  the user's tensor (device to device) and returns the credit. A fast sender never overwrites unconsumed data.
* **rendezvous** (larger messages): the sender notifies ``rts``; when the matching recv is posted the receiver
  registers the user's tensor and answers ``rtr`` with its address; the sender writes it in ``chunk``-sized
  pieces, ``window`` in flight so the transfers pipeline, then notifies ``fin``. The data lands in the user's
  tensor directly: no copy at all.

Notifications are JSON (validated, never pickled). Messages between a pair are matched in order per tag by
a sequence number, so arrival order of notifications does not matter. Every op has a deadline; peers with
pending ops are probed, so a dead peer fails its ops within the timeout with a message that names it.
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from bimetal.comm.base import TransportError, TransportTimeout
from bimetal.comm.device_direct.engine import Engine, PeerFailedError, WriteStatus

_PROBE_EVERY_S = 0.5
_NOTE_FIELDS = {"eager": ("tag", "seq", "slot", "n"), "rts": ("tag", "seq", "n"), "fin": ("tag", "seq"),
                "rtr": ("tag", "seq", "addr"), "credit": ("slot",)}


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
    pending: list[tuple[int, int]] = field(default_factory=list)  # (handle, nbytes) in flight
    addr: int = 0  # rendezvous: the receiver's registered address of the user tensor
    slot: int = -1


class Proxy:
    """One proxy thread per process group; ``close()`` joins it."""

    def __init__(self, engine: Engine, rank: int, global_ranks: list[int], chunk: int = 4 << 20, slots: int = 4,
                 window: int = 4, timeout: float = 300.0, device: torch.device | None = None) -> None:
        self.engine, self.rank, self.global_ranks = engine, rank, global_ranks
        self.chunk, self.nslots, self.window, self.timeout = chunk, slots, window, timeout
        self.device = device or torch.device("cpu")
        self.staged_bytes = 0  # bytes bounced through host memory: none by construction, counted to prove it
        self.direct_bytes = 0  # bytes the engine wrote from our memory into a peer's without a host bounce
        self.landing_copy_bytes = 0  # eager bytes copied slot -> user tensor on the same device
        self.received_bytes = 0
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._pools: dict[int, torch.Tensor] = {}
        self._remote: dict[int, int] = {}  # peer -> address of that peer's slot pool for us
        self._credits: dict[int, collections.deque[int]] = {}
        self._next_seq: dict[tuple[str, int, int], int] = collections.defaultdict(int)
        self._sends: list[_Op] = []
        self._recvs: dict[tuple[int, int, int], _Op] = {}
        self._arrived: dict[tuple[int, int, int], dict[str, Any]] = {}  # (peer, tag, seq) -> eager/rts note
        self._dead: dict[int, str] = {}
        self._last_probe = 0.0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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
        self._ops.put(op)
        return fut

    def close(self) -> None:
        """Stop and join the proxy thread (pending ops fail), then release registered memory and the engine."""
        self._stop.set()
        self._ops.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        for pool in self._pools.values():
            self.engine.unregister(pool.data_ptr())
        self._pools.clear()
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _peer_name(self, peer: int) -> str:
        return f"peer rank {self.global_ranks[peer]} (group rank {peer})"

    # -- proxy thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            idle = 0
            while not self._stop.is_set():
                if not (self._sends or self._recvs) and not self._wait_for_op():
                    continue  # nothing to do: block instead of spinning (notes wait in the engine meanwhile)
                busy = self._take_ops()
                busy |= self._take_notes()
                busy |= self._progress()
                self._check_health()
                idle = 0 if busy else idle + 1
                # spin (yielding the GIL) while a reply is imminent, back off when the peer is slow
                time.sleep(0 if idle < 200 else 0.0002)
        except BaseException as exc:  # a bug or a broken engine: every pending Work learns why
            self.error = exc
        self._fail_all(self.error or TransportError("the device-direct process group was shut down"))

    def _wait_for_op(self) -> bool:
        try:
            op = self._ops.get(timeout=0.05)
        except queue.Empty:
            return False
        if op is not None:
            self._admit(op)
        return True

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
        if op.peer in self._dead:
            op.fut.set_exception(TransportError(f"{op.what}: {self._dead[op.peer]}"))
            return
        key = (op.kind, op.peer, op.tag)
        op.seq = self._next_seq[key]
        self._next_seq[key] += 1
        if op.kind == "send":
            self._sends.append(op)
        else:
            self._recvs[(op.peer, op.tag, op.seq)] = op

    def _take_notes(self) -> bool:
        notes = self.engine.notifications()
        for text in notes:
            note = self._parse(text)
            if note is None:
                continue
            peer, k = note["src"], note["k"]
            if k == "credit":
                self._credits[peer].append(note["slot"])
            elif k == "rtr":
                send = next((s for s in self._sends if (s.peer, s.tag, s.seq) == (peer, note["tag"], note["seq"])),
                            None)
                if send is not None and send.state == "rts":
                    send.state, send.addr = "writing", note["addr"]
            elif k == "fin":
                recv = self._recvs.pop((peer, note["tag"], note["seq"]), None)
                if recv is not None:
                    self.engine.unregister(recv.flat.data_ptr())
                    if self.engine.protocol == "tcp" and recv.flat.device.type != "cpu":
                        self.staged_bytes += recv.flat.numel()  # bounced through the host inside the engine
                    self.received_bytes += recv.flat.numel()
                    recv.fut.set_result(None)
            else:  # eager or rts: wait for the matching recv
                self._arrived[(peer, note["tag"], note["seq"])] = note
        return bool(notes)

    def _parse(self, text: str) -> dict[str, Any] | None:
        try:
            note = json.loads(text)
        except ValueError:
            return None
        if not isinstance(note, dict) or note.get("k") not in _NOTE_FIELDS:
            return None
        fields = ("src",) + _NOTE_FIELDS[note["k"]]
        if not all(isinstance(note.get(f), int) and not isinstance(note.get(f), bool) for f in fields):
            return None
        if note["src"] not in self._remote:
            return None
        return note

    def _notify(self, peer: int, k: str, **fields: int) -> None:
        self.engine.notify(peer, json.dumps({"k": k, "src": self.rank, **fields}))

    def _progress(self) -> bool:
        busy = False
        for op in list(self._sends):
            try:
                busy |= self._advance_send(op)
            except PeerFailedError as exc:
                self._peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        for key in [k for k in self._recvs if k in self._arrived]:
            op = self._recvs[key]
            try:
                busy |= self._match_recv(op, self._arrived.pop(key))
            except PeerFailedError as exc:
                self._peer_failed(op.peer, f"{self._peer_name(op.peer)} failed: {exc}")
        return busy

    def _advance_send(self, op: _Op) -> bool:
        if op.state == "new":
            if op.ready is not None and not op.ready.query():
                return False
            nbytes = op.flat.numel()
            if nbytes == 0 or (nbytes <= self.chunk and op.flat.device == self.device):
                op.state = "eager"
            else:
                self._notify(op.peer, "rts", tag=op.tag, seq=op.seq, n=nbytes)
                op.state = "rts"
                return True
        if op.state == "eager":
            if not self._credits[op.peer]:
                return False
            op.slot = self._credits[op.peer].popleft()
            if op.flat.numel():
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

    def _post(self, op: _Op, remote: int, off: int, n: int) -> int:
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
            busy = True
        op.pending = still
        done = not still and (op.state == "eager-writing" or op.off >= op.flat.numel())
        if done:
            if op.state == "eager-writing":
                self._notify(op.peer, "eager", tag=op.tag, seq=op.seq, slot=op.slot, n=op.flat.numel())
            else:
                self._notify(op.peer, "fin", tag=op.tag, seq=op.seq)
            if self.engine.needs_source_registration and op.flat.numel():
                self.engine.unregister(op.flat.data_ptr())
            self._sends.remove(op)
            op.fut.set_result(None)
        return busy or done

    def _count(self, t: torch.Tensor, n: int) -> None:
        # Mooncake's TCP transport bounces GPU memory through host buffers inside the engine: that is staging
        if self.engine.protocol == "tcp" and t.device.type != "cpu":
            self.staged_bytes += n
        else:
            self.direct_bytes += n

    def _match_recv(self, op: _Op, note: dict[str, Any]) -> bool:
        if op.ready is not None and not op.ready.query():
            self._arrived[(op.peer, op.tag, op.seq)] = note
            return False
        nbytes = op.flat.numel()
        if note["n"] != nbytes:
            del self._recvs[(op.peer, op.tag, op.seq)]
            op.fut.set_exception(TransportError(
                f"{op.what}: {self._peer_name(op.peer)} sent {note['n']} bytes but the recv tensor holds {nbytes}"))
            if note["k"] == "eager":
                self._notify(op.peer, "credit", slot=note["slot"])
            return True
        if note["k"] == "eager":
            slot = note["slot"]
            if nbytes:
                src = self._pools[op.peer][slot * self.chunk: slot * self.chunk + nbytes]
                self._copy(op.flat, src)
                self.landing_copy_bytes += nbytes
                if src.device.type == "cpu" and op.flat.device.type != "cpu":
                    self.staged_bytes += nbytes  # a CPU pool feeding a GPU tensor is host staging: say so
                elif self.engine.protocol == "tcp" and src.device.type != "cpu":
                    self.staged_bytes += nbytes  # the engine's TCP receive path bounced it through the host
            del self._recvs[(op.peer, op.tag, op.seq)]
            self.received_bytes += nbytes
            op.fut.set_result(None)  # before the credit goes back: the user's thread need not wait for it
            self._notify(op.peer, "credit", slot=slot)
        else:  # rts: let the sender write straight into the user's tensor
            self.engine.register(op.flat.data_ptr(), nbytes, _location(op.flat))
            op.state = "rtr"
            self._notify(op.peer, "rtr", tag=op.tag, seq=op.seq, addr=op.flat.data_ptr())
        return True

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):  # device to device on the proxy's own stream
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

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
        for op in [o for o in self._sends + list(self._recvs.values()) if o.peer == peer]:
            self._fail(op, TransportError(f"{op.what}: {reason}"))

    def _fail(self, op: _Op, exc: BaseException) -> None:
        if op in self._sends:
            self._sends.remove(op)
        self._recvs.pop((op.peer, op.tag, op.seq), None)
        if op.state == "rtr":
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
