"""The three device-direct wire protocols, as steps the proxy thread takes on each operation.

Chosen by size (both sides agree on the rendezvous one, which depends on the size alone):

* **inline** (host tensors up to ``inline`` bytes, and empty messages): the payload rides in the note itself,
  on the control channel. One control message per message, no slot, no write: the lowest latency there is
  (an engine write plus a note is two exchanges). Never used for GPU memory, which would then bounce through
  the host.
* **eager** (up to ``chunk`` bytes): the sender takes a credit (``credits.py``), writes into that slot and
  notifies ``eager``; the receiver copies the slot into the user's tensor (device to device) and owes the
  credit back.
* **rendezvous** (larger messages): as soon as the recv is posted, the receiver registers the user's tensor
  and sends ``rtr`` with its address (receiver first: no request-to-send round trip when the recv is posted
  before the data is ready, as a pipeline does). The sender writes it in ``chunk``-sized pieces, ``window`` in
  flight (over the engine's connection lanes) so the transfers pipeline, then notifies ``fin``. The data lands in
  the user's tensor directly: no copy at all. A sender that waits long for ``rtr`` sends ``rts`` with its
  size, so a size mismatch fails both sides with the sizes named instead of timing out.

Memory is registered through ``Registrations`` (``registrations.py``), never per message: the receive slots once,
a rendezvous receive's tensor once per storage (cached); on engines that need a registered source (RDMA) a send
from memory nobody registered is copied, chunk by chunk, into a registered ``SendPool`` buffer and written from
there.

Messages between a pair are matched in order per tag by a sequence number. ``Transfers`` holds the ops in
flight and the notes waiting for them; everything here runs on the proxy thread, except ``send_inline``, which
the caller's thread runs under the proxy's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from bimetal.comm.base import TransportError
from bimetal.comm.device_direct.control import ControlChannel
from bimetal.comm.device_direct.credits import Credits
from bimetal.comm.device_direct.engine import Engine, PeerFailedError, WriteStatus
from bimetal.comm.device_direct.notes import Note
from bimetal.comm.device_direct.ops import Counters, Op, OpState
from bimetal.comm.device_direct.pacing import Pacer
from bimetal.comm.device_direct.registrations import Registrations, SendPool

RTS_AFTER_S = 1.0  # a rendezvous sender without rtr this long tells its size (size-mismatch diagnosis)


class Transfers:
    """Ops in flight on one group and the protocol steps that move them (see the module docstring)."""

    def __init__(self, engine: Engine, control: ControlChannel, lock: threading.Lock, chunk: int, slots: int,
                 window: int, device: torch.device, peer_name: Callable[[int], str], reg_cache_bytes: int = 4 << 30
                 ) -> None:
        self.engine, self.control, self._lock = engine, control, lock
        self.chunk, self.window, self.peer_name = chunk, window, peer_name
        self.credits = Credits(slots)
        self.pacer = Pacer()
        self.counters = Counters()
        self.registrations = Registrations(engine, self.counters, reg_cache_bytes)
        # RDMA reads only registered memory: sends from anything else go through this pool (one buffer per write
        # in flight); Mooncake's TCP transport reads any memory, so it needs none
        self.send_pool = SendPool(window, chunk, device, self.registrations) \
            if engine.needs_source_registration else None
        self.pools: dict[int, torch.Tensor] = {}  # peer -> our receive slots for it
        self.remote: dict[int, int] = {}  # peer -> address of that peer's slot pool for us
        self.sends: list[Op] = []
        self.recvs: dict[tuple[int, int, int], Op] = {}
        self.arrived: dict[tuple[int, int, int], Note] = {}  # (peer, tag, seq) -> inline/eager/rts note
        self.rtr: dict[tuple[int, int, int], Note] = {}  # rtr/nack notes for sends not (yet) ready
        self.dead: dict[int, str] = {}  # peer -> why it failed
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream_device = self._stream.device if self._stream is not None else torch.device("cpu")

    def rendezvous(self, nbytes: int) -> bool:
        # the one choice both sides must make alike, so it depends on the size alone
        return nbytes > self.chunk

    def pending(self) -> list[Op]:
        return self.sends + list(self.recvs.values())

    # -- notes -----------------------------------------------------------------------------------------------

    def on_note(self, peer: int, note: Note) -> None:
        """A checked note from ``peer``: credits back, and the note to the op it belongs to (now or later)."""
        self.credits.returned(peer, note.credits)
        key = (peer, note.tag, note.seq)  # credit notes have none
        if note.kind in ("rtr", "nack"):
            self.rtr[key] = note  # picked up by the send (now, or when it is posted)
        elif note.kind == "fin":
            recv = self.recvs.pop(key, None)
            if recv is not None:
                self._release(recv)
                if self.engine.protocol == "tcp" and recv.flat.device.type != "cpu":
                    self.counters.engine_bounce(recv.flat.numel())  # bounced through the host inside the engine
                self.counters.received_bytes += recv.flat.numel()
                recv.fut.set_result(None)
        elif note.kind != "credit":  # inline, eager or rts: wait for the matching recv
            self.arrived[key] = note

    def notify(self, peer: int, k: str, payload: bytes = b"", **fields: Any) -> None:
        """Send a note from the proxy thread; owed credits ride along for free."""
        note = {"k": k, **fields}
        owed = self.credits.ride_along(peer)
        if owed:
            note["cr"] = owed
        with self._lock:
            self.send_note(peer, note, payload)

    def send_note(self, peer: int, note: dict[str, Any], payload: bytes) -> None:
        # (the caller holds the proxy's lock)
        self.counters.notes_sent += 1
        try:
            self.control.send(peer, note, payload)
        except TransportError as exc:
            raise PeerFailedError(str(exc)) from exc

    def return_credits(self, force: bool = False) -> None:
        for peer in self.credits.due(force):
            try:
                self.notify(peer, "credit")
            except PeerFailedError as exc:
                self.credits.forget(peer)
                self.peer_failed(peer, f"{self.peer_name(peer)} failed: {exc}")

    # -- send side -------------------------------------------------------------------------------------------

    def send_inline(self, op: Op) -> bool:
        """The whole of an inline send, on the caller's thread under the proxy's lock: the payload rides in the
        note, which the control channel queues and pushes at once (``close()`` flushes what the socket did not
        take). True when bytes are left for the proxy to push once the socket is writable."""
        data = op.flat.detach().numpy().tobytes() if op.flat.numel() else b""
        try:
            self.send_note(op.peer, {"k": "inline", "tag": op.tag, "seq": op.seq, "n": op.flat.numel()}, data)
        except PeerFailedError as exc:
            op.fut.set_exception(TransportError(f"{op.what}: {self.peer_name(op.peer)} failed: {exc}"))
            return False
        self.counters.inline_sent_bytes += op.flat.numel()
        left = bool(self.control.writers())
        op.fut.set_result(None)
        return left

    def advance_send(self, op: Op) -> bool:
        if op.state is OpState.NEW:
            if op.ready is not None and not op.ready.query():
                return False
            if self.send_pool is not None:  # already registered (it received earlier)? then written in place
                op.region = self.registrations.lookup(op.flat)
            if self.rendezvous(op.flat.numel()):
                op.state, op.since = OpState.WAIT_RTR, time.monotonic()
            else:  # (inline sends never get here: the caller's thread sent them)
                op.state = OpState.EAGER
        if op.state is OpState.WAIT_RTR:
            note = self.rtr.pop(op.key, None)
            if note is None:
                if time.monotonic() - op.since > RTS_AFTER_S:
                    self.notify(op.peer, "rts", tag=op.tag, seq=op.seq, n=op.flat.numel())
                    op.since = float("inf")  # once
                return False
            if note.kind == "nack" or note.n != op.flat.numel():
                self.fail(op, TransportError(f"{op.what}: {self.peer_name(op.peer)} posted a recv of {note.n} "
                                             f"bytes but this send has {op.flat.numel()}"))
                return True
            op.state, op.addr = OpState.WRITING, note.addr
        if op.state is OpState.EAGER:
            if op.slot < 0:
                slot = self.credits.take(op.peer)
                if slot is None:
                    return False
                op.slot = slot
            if not self._post(op, self.remote[op.peer] + op.slot * self.chunk, 0, op.flat.numel()):
                return False  # (keeps its credit until a send-pool buffer is free)
            op.state = OpState.EAGER_WRITING
        if op.state is OpState.WRITING:
            while len(op.pending) < self.window and op.off < op.flat.numel():
                n = min(self.chunk, op.flat.numel() - op.off)
                if not self._post(op, op.addr + op.off, op.off, n):
                    break
                op.off += n
        if op.state in (OpState.WRITING, OpState.EAGER_WRITING):
            return self._poll_send(op)
        return False

    def _post(self, op: Op, remote: int, off: int, n: int) -> bool:
        """Post the write of ``op``'s bytes ``off:off+n``; False when it must wait for a send-pool buffer."""
        buf = -1
        if self.send_pool is None or op.region is not None:
            local = op.flat.data_ptr() + off  # the engine reads the user's memory itself
        else:
            free = self.send_pool.take()
            if free is None:
                return False
            buf = free
            staged = self.send_pool.view(buf, n)
            self._copy(staged, op.flat[off:off + n])
            self.counters.send_copy_bytes += n
            if staged.device.type == "cpu" and op.flat.device.type != "cpu":
                self.counters.staged_bytes += n  # a host pool fed from GPU memory is host staging: say so
            local = staged.data_ptr()
        if not any(o.pending for o in self.sends if o.peer == op.peer):
            self.pacer.busy(op.peer)
        try:
            handle = self.engine.post_write(op.peer, local, remote, n)
        except BaseException:
            if buf >= 0:
                self.send_pool.give(buf)  # type: ignore[union-attr]
            raise
        op.pending.append((handle, n, buf))
        return True

    def _poll_send(self, op: Op) -> bool:
        busy, still = False, []
        for i, (handle, n, buf) in enumerate(op.pending):
            status = self.engine.poll(handle)
            if status is WriteStatus.PENDING:
                still.append((handle, n, buf))
                continue
            if buf >= 0:
                self.send_pool.give(buf)  # type: ignore[union-attr]
            if status is WriteStatus.FAILED:
                op.pending = still + op.pending[i + 1:]  # (their pool buffers go back when the op fails)
                raise PeerFailedError(f"a {n}-byte write to it did not complete")
            self._count(op.flat, n)
            self.pacer.completed(op.peer, n)
            busy = True
        op.pending = still
        done = not still and (op.state is OpState.EAGER_WRITING or op.off >= op.flat.numel())
        if done:
            if op.state is OpState.EAGER_WRITING:
                self.notify(op.peer, "eager", tag=op.tag, seq=op.seq, slot=op.slot, n=op.flat.numel())
            else:
                self.notify(op.peer, "fin", tag=op.tag, seq=op.seq)
            self._release(op)
            self.sends.remove(op)
            op.fut.set_result(None)
        return busy or done

    def _count(self, t: torch.Tensor, n: int) -> None:
        # Mooncake's TCP transport bounces GPU memory through host buffers inside the engine: that is staging
        if self.engine.protocol == "tcp" and t.device.type != "cpu":
            self.counters.engine_bounce(n)
        else:
            self.counters.direct_bytes += n

    # -- receive side ----------------------------------------------------------------------------------------

    def advance_recv(self, op: Op) -> bool:
        busy = False
        if op.state is OpState.NEW:
            if op.ready is not None and not op.ready.query():
                return False
            if self.rendezvous(op.flat.numel()):  # receiver first: advertise the user's tensor right away
                op.region = self.registrations.acquire(op.flat)  # registered once per storage, then cached
                op.state = OpState.RTR
                self.notify(op.peer, "rtr", tag=op.tag, seq=op.seq, n=op.flat.numel(), addr=op.flat.data_ptr())
                busy = True
            else:
                op.state = OpState.POSTED
        note = self.arrived.pop(op.key, None)
        if note is None:
            return busy
        return self._match_recv(op, note) or busy

    def _match_recv(self, op: Op, note: Note) -> bool:
        nbytes = op.flat.numel()
        if note.n != nbytes:
            self.fail(op, TransportError(
                f"{op.what}: {self.peer_name(op.peer)} sent {note.n} bytes but the recv tensor holds {nbytes}"))
            if note.kind == "eager":
                self.credits.owe(op.peer, note.slot)
            elif note.kind == "rts":
                self.notify(op.peer, "nack", tag=op.tag, seq=op.seq, n=nbytes)
            return True
        if note.kind == "rts":  # sizes agree: our rtr is on its way (or was lost with a dead peer)
            return False
        if note.kind == "inline":
            if nbytes:
                op.flat.copy_(torch.frombuffer(bytearray(note.payload), dtype=torch.uint8))
                self.counters.inline_received_bytes += nbytes
                if op.flat.device.type != "cpu":
                    self.counters.staged_bytes += nbytes  # a host payload into GPU memory is host staging: say so
        else:  # eager
            if nbytes:
                src = self.pools[op.peer][note.slot * self.chunk: note.slot * self.chunk + nbytes]
                self._copy(op.flat, src)
                self.counters.landing_copy_bytes += nbytes
                if src.device.type == "cpu" and op.flat.device.type != "cpu":
                    self.counters.staged_bytes += nbytes  # a CPU pool feeding a GPU tensor is host staging: say so
                elif self.engine.protocol == "tcp" and src.device.type != "cpu":
                    self.counters.engine_bounce(nbytes)  # the engine's TCP receive path bounced it through the host
            self.credits.owe(op.peer, note.slot)  # returned with the next note to the peer, or on its own shortly
        del self.recvs[op.key]
        self.counters.received_bytes += nbytes
        op.fut.set_result(None)
        return True

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):  # device to device on the proxy's own stream
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    # -- failure ---------------------------------------------------------------------------------------------

    def peer_failed(self, peer: int, reason: str) -> None:
        self.dead[peer] = reason
        self.credits.forget(peer)
        for op in [o for o in self.pending() if o.peer == peer]:
            self.fail(op, TransportError(f"{op.what}: {reason}"))

    def fail(self, op: Op, exc: BaseException) -> None:
        if op in self.sends:
            self.sends.remove(op)
        if self.recvs.get(op.key) is op:
            del self.recvs[op.key]
        for _, _, buf in op.pending:
            if buf >= 0:
                self.send_pool.give(buf)  # type: ignore[union-attr]
        op.pending = []
        self._release(op)
        if not op.fut.done():
            op.fut.set_exception(exc)

    def _release(self, op: Op) -> None:
        """``op`` no longer uses the registration of its tensor (which stays cached)."""
        if op.region is not None:
            self.registrations.release(op.region)
            op.region = None
