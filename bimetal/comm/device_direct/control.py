"""The proxy's control channel: one persistent TCP connection per peer for the notes of the device-direct protocol.

Data moves by one-sided engine writes; what moves here is the control plane: the JSON notes (``rtr``, ``fin``,
``eager``, credits, ...) and the payload of inline messages (small host tensors, never GPU memory). The engine's
own notification cannot carry them at the latency a pipeline needs: Mooncake's opens a new TCP connection for
every message (240-500 us each on loopback here), more than a whole 4 KiB cpu-forward message costs. A
connection that stays open costs one ``send`` and wakes the peer's proxy in ``select`` the moment a note lands.

Frames: an 8-byte header (note length, payload length; big-endian uint32), the note as UTF-8 JSON, the payload.
Both lengths are bounded, so a malformed frame closes that one connection instead of exhausting memory.

Set-up: every rank listens on its device-direct host (never on all addresses) and publishes host, port and a
random token in the group store; the lower rank of each pair connects and sends a hello with its rank and the
listener's token; a listener keeps only the ranks it expects with the right token. A stray connection cannot
hold the set-up up: hellos are read side by side without blocking, one that is wrong is dropped at once and
one that does not come within a couple of seconds is closed; once every expected rank is in, the listener is
closed, so later connections are refused rather than left in its backlog.

Sends never block the proxy: each peer has an outbound buffer, flushed whenever its socket is writable, so two
proxies that send to each other at once cannot deadlock.

A connection that ends (EOF or a reset) marks its peer closed with the reason; the proxy fails that peer's ops
at once, which is how a killed peer is noticed long before any timeout.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import select
import socket
import struct
import time
from typing import Any

from bimetal.comm.base import TransportError, TransportTimeout

_HEADER = struct.Struct("!II")
_MAX_NOTE = 64 << 10
_RECV_BYTES = 1 << 20
_FLUSH_ON_CLOSE_S = 5.0
_HELLO_S = 2.0  # an accepted connection must present its hello within this, or it is closed


class ControlChannel:
    """Persistent framed connections to every peer of one group (owned by the proxy thread after ``connect``)."""

    def __init__(self, host: str, rank: int, max_payload: int) -> None:
        self.rank, self.max_payload = rank, max_payload
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._token = secrets.token_hex(16)
        self.address = {"host": host, "port": self._listener.getsockname()[1], "token": self._token}
        self._socks: dict[int, socket.socket] = {}
        self._peer_of: dict[socket.socket, int] = {}
        self._out: dict[int, bytearray] = {}
        self._in: dict[int, bytearray] = {}
        self._inbox: list[tuple[int, dict[str, Any], bytes]] = []
        self._scratch = bytearray(_RECV_BYTES)
        self._view = memoryview(self._scratch)
        self.closed: dict[int, str] = {}  # peer -> why its connection ended (the proxy fails its ops)

    # -- set-up (training thread, before the proxy starts) ----------------------------------------------------

    def connect(self, peers: dict[int, dict[str, Any]], timeout: float) -> None:
        """Open the connections to ``peers`` (peer -> the ``address`` it published); both sides call it."""
        deadline = time.monotonic() + timeout
        for peer in sorted(p for p in peers if p > self.rank):
            where = peers[peer]
            try:
                sock = socket.create_connection((where["host"], int(where["port"])),
                                                timeout=max(deadline - time.monotonic(), 0.1))
                sock.sendall(_frame({"hello": self.rank, "token": where["token"]}, b""))
            except (OSError, KeyError, TypeError, ValueError) as exc:
                raise TransportError(f"device-direct control connection to group rank {peer} at {where!r} failed: "
                                     f"{exc}") from exc
            self._adopt(peer, sock)
        self._accept({p for p in peers if p < self.rank}, deadline, timeout)

    def _accept(self, expected: set[int], deadline: float, timeout: float) -> None:
        """Take the hellos of ``expected`` ranks; strangers and late connections never hold the set-up up.

        Every accepted connection gets ``_HELLO_S`` to present a hello with the token, read without blocking
        beside the others; one that says nothing, a wrong token or a duplicate is closed. When the set-up is
        done the listener is closed, so a later connection is refused instead of waiting in the backlog.
        """
        pending: dict[socket.socket, tuple[float, bytearray]] = {}
        self._listener.setblocking(False)
        try:
            while expected:
                now = time.monotonic()
                if now >= deadline:
                    raise TransportTimeout(f"device-direct control set-up: group ranks {sorted(expected)} did not "
                                           f"connect within {timeout:.0f} s")
                for sock in [s for s, (until, _) in pending.items() if until <= now]:
                    del pending[sock]
                    sock.close()  # no hello in time: a stranger (or a stuck peer) does not stall the others
                wake = min([deadline, *(until for until, _ in pending.values())])
                ready, _ = wait_ready([self._listener, *pending], [], wake - now)
                for sock in ready:
                    if sock is self._listener:
                        with contextlib.suppress(BlockingIOError, InterruptedError):
                            conn, _ = self._listener.accept()
                            conn.setblocking(False)
                            pending[conn] = (time.monotonic() + _HELLO_S, bytearray())
                        continue
                    peer = _read_hello(sock, pending[sock][1], self._token)
                    if peer is None:
                        continue  # hello not complete yet
                    del pending[sock]
                    if peer in expected:
                        expected.discard(peer)
                        self._adopt(peer, sock)
                    else:
                        sock.close()  # a stranger, a wrong token or a duplicate: dropped, the set-up goes on
        finally:
            for sock in pending:
                sock.close()
            self._listener.close()

    def _adopt(self, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = sock
        self._peer_of[sock] = peer
        self._out[peer] = bytearray()
        self._in[peer] = bytearray()

    # -- traffic (proxy thread) -----------------------------------------------------------------------------

    def send(self, peer: int, note: dict[str, Any], payload: bytes = b"") -> None:
        """Queue one frame for ``peer`` and push what the socket takes now; raises TransportError if it is gone."""
        if peer in self.closed:
            raise TransportError(self.closed[peer])
        self._out[peer] += _frame(note, payload)
        self._flush(peer)
        if peer in self.closed:
            raise TransportError(self.closed[peer])

    def readers(self) -> list[socket.socket]:
        return [s for p, s in self._socks.items() if p not in self.closed]

    def writers(self) -> list[socket.socket]:
        return [s for p, s in self._socks.items() if self._out[p] and p not in self.closed]

    def on_ready(self, sock: socket.socket, readable: bool) -> None:
        """``select`` said ``sock`` is readable (or writable): move bytes, parse whole frames into the inbox."""
        peer = self._peer_of.get(sock)
        if peer is None or peer in self.closed:
            return
        if not readable:
            self._flush(peer)
            return
        try:
            got = sock.recv_into(self._scratch)  # into a buffer kept for it: no 1 MiB allocation per read
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(peer, f"its control connection failed ({exc})")
            return
        if not got:
            self._close(peer, "it closed its control connection (its process exited or its group was shut down)")
            return
        buf = self._in[peer]
        buf += self._view[:got]
        while len(buf) >= _HEADER.size:
            size, payload = _HEADER.unpack_from(buf)
            if size > _MAX_NOTE or payload > self.max_payload:
                self._close(peer, f"it sent a malformed control frame ({size}-byte note, {payload}-byte payload)")
                return
            end = _HEADER.size + size + payload
            if len(buf) < end:
                break
            try:
                note = json.loads(bytes(buf[_HEADER.size:_HEADER.size + size]))
            except ValueError:
                note = None
            if isinstance(note, dict):
                self._inbox.append((peer, note, bytes(buf[_HEADER.size + size:end])))
            del buf[:end]

    def take(self) -> list[tuple[int, dict[str, Any], bytes]]:
        """The frames that arrived since the last call, per peer in the order they were sent."""
        frames, self._inbox = self._inbox, []
        return frames

    def _flush(self, peer: int) -> None:
        out = self._out[peer]
        while out:
            try:
                sent = self._socks[peer].send(out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._close(peer, f"its control connection failed ({exc})")
                return
            del out[:sent]

    def _close(self, peer: int, reason: str) -> None:
        self.closed.setdefault(peer, reason)
        self._out[peer].clear()

    def close(self) -> None:
        """Push out what is queued (bounded wait: notes of completed sends must reach the peer), then close all."""
        deadline = time.monotonic() + _FLUSH_ON_CLOSE_S
        while self.writers() and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                _, ready = wait_ready([], self.writers(), deadline - time.monotonic())
                for sock in ready:
                    self.on_ready(sock, readable=False)
        for sock in [*self._socks.values(), self._listener]:
            sock.close()
        self._socks.clear()
        self._peer_of.clear()


def wait_ready(readers: list[socket.socket], writers: list[socket.socket],
               timeout: float) -> tuple[list[socket.socket], list[socket.socket]]:
    """The sockets of ``readers`` that can be read and of ``writers`` that can be written, waiting up to ``timeout``.

    ``poll``, not ``select``: ``select`` refuses any descriptor numbered 1024 or above ("filedescriptor out of
    range"), which a rank reaches once its trainer holds enough files, sockets and groups open. A socket
    closed under us reports ready, so its read or write finds the error as it would with ``select``.
    """
    poller = select.poll()
    by_fd: dict[int, socket.socket] = {}
    masks: dict[int, int] = {}
    for sock, mask in [*((r, select.POLLIN) for r in readers), *((w, select.POLLOUT) for w in writers)]:
        fd = sock.fileno()
        if fd < 0:
            raise OSError("a socket of the device-direct control plane was closed")
        by_fd[fd] = sock
        masks[fd] = masks.get(fd, 0) | mask
    for fd, mask in masks.items():
        poller.register(fd, mask)
    events = poller.poll(max(timeout, 0.0) * 1000.0)
    trouble = select.POLLERR | select.POLLHUP | select.POLLNVAL
    readable = [by_fd[fd] for fd, ev in events if masks[fd] & select.POLLIN and ev & (select.POLLIN | trouble)]
    writable = [by_fd[fd] for fd, ev in events if masks[fd] & select.POLLOUT and ev & (select.POLLOUT | trouble)]
    return readable, writable


def _frame(note: dict[str, Any], payload: bytes) -> bytes:
    body = json.dumps(note, separators=(",", ":")).encode()
    return _HEADER.pack(len(body), len(payload)) + body + payload


def _read_hello(sock: socket.socket, buf: bytearray, token: str) -> int | None:
    """Read what is there of a hello into ``buf`` (never past its end): None while incomplete, -1 if bad."""
    try:
        want = _HEADER.size - len(buf)
        if want <= 0:
            size, payload = _HEADER.unpack_from(buf)
            if size > 1024 or payload:
                return -1
            want = _HEADER.size + size - len(buf)
        part = sock.recv(want)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return -1
    if not part:
        return -1
    buf += part
    if len(buf) < _HEADER.size:
        return None
    size, payload = _HEADER.unpack_from(buf)
    if size > 1024 or payload:
        return -1
    if len(buf) < _HEADER.size + size:
        return None
    try:
        note = json.loads(bytes(buf[_HEADER.size:]))
    except ValueError:
        return -1
    if not isinstance(note, dict) or note.get("token") != token:
        return -1
    peer = note.get("hello")
    return peer if isinstance(peer, int) and not isinstance(peer, bool) else -1
