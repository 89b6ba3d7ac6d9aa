"""The device-direct control channel on its own: set-up with tokens, framing, bounded frames, ends of connections."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
import time

import pytest

from bimetal.comm.base import TransportError, TransportTimeout
from bimetal.comm.device_direct.control import ControlChannel, wait_ready

pytestmark = pytest.mark.timeout(60)


def _pair(max_payload: int = 1 << 16, stray: bool = False) -> tuple[ControlChannel, ControlChannel]:
    a, b = ControlChannel("127.0.0.1", 0, max_payload), ControlChannel("127.0.0.1", 1, max_payload)
    if stray:  # a stranger connects to rank 1's listener first, with the wrong token: dropped, set-up goes on
        s = socket.create_connection(("127.0.0.1", b.address["port"]))
        body = b'{"hello":0,"token":"guess"}'
        s.sendall(struct.pack("!II", len(body), 0) + body)
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            b.connect({0: a.address}, timeout=10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=accept)
    t.start()
    a.connect({1: b.address}, timeout=10)
    t.join()
    assert not errors, errors
    return a, b


def _pump(channels: list[ControlChannel], until, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        readers = [s for c in channels for s in c.readers()]
        writers = [s for c in channels for s in c.writers()]
        r, w = wait_ready(readers, writers, 0.05)
        for c in channels:
            for s in w:
                c.on_ready(s, readable=False)
            for s in r:
                c.on_ready(s, readable=True)


def test_frames_both_ways_in_order_with_payloads() -> None:
    a, b = _pair(stray=True)
    got_a: list = []
    got_b: list = []
    big = bytes(range(256)) * 256  # 64 KiB: more than one recv, the largest payload allowed
    for i in range(50):
        a.send(1, {"k": "inline", "seq": i}, big if i % 10 == 0 else bytes([i]))
        b.send(0, {"k": "credit", "seq": i})

    def all_arrived() -> bool:
        got_a.extend(a.take())
        got_b.extend(b.take())
        return len(got_a) == len(got_b) == 50

    _pump([a, b], all_arrived)
    assert [(p, n["seq"]) for p, n, _ in got_b] == [(0, i) for i in range(50)]
    assert all(d == (big if n["seq"] % 10 == 0 else bytes([n["seq"]])) for _, n, d in got_b)
    assert [(p, n["seq"], d) for p, n, d in got_a] == [(1, i, b"") for i in range(50)]
    a.close()
    b.close()


def test_set_up_and_frames_work_on_descriptors_numbered_past_1024() -> None:
    """A rank of a large job holds many files and sockets: ``select`` refuses descriptors >= 1024, the channel not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        a, b = _pair()
        assert min(s.fileno() for s in [*a.readers(), *b.readers()]) >= 1024
        a.send(1, {"k": "inline", "seq": 1}, b"x")
        got: list = []

        def arrived() -> bool:
            got.extend(b.take())
            return bool(got)

        _pump([a, b], arrived)
        assert [(p, n["seq"], d) for p, n, d in got] == [(0, 1, b"x")]
        a.close()
        b.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_oversized_frame_closes_that_connection_naming_it() -> None:
    a, b = _pair(max_payload=1024)
    a.send(1, {"k": "inline"}, bytes(4096))
    _pump([a, b], lambda: 0 in b.closed)
    assert "malformed control frame" in b.closed[0] and "4096-byte payload" in b.closed[0]
    with pytest.raises(TransportError, match="malformed"):
        b.send(0, {"k": "credit"})
    a.close()
    b.close()


def test_a_peer_that_goes_away_is_noticed_at_once() -> None:
    a, b = _pair()
    a.close()
    _pump([b], lambda: 0 in b.closed)
    # noticed from the connection's end (its sentence says so), not from a deadline that ran out
    assert 0 in b.closed and "closed its control connection" in b.closed[0]
    b.close()


def test_a_peer_that_never_connects_times_out_naming_it() -> None:
    lonely = ControlChannel("127.0.0.1", 1, 1024)
    with pytest.raises(TransportTimeout, match=r"group ranks \[0\] did not connect within 1 s"):
        lonely.connect({0: {"host": "127.0.0.1", "port": 1, "token": "x"}}, timeout=1)
    lonely.close()


def test_a_silent_stranger_is_closed_in_time_and_late_connections_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from bimetal.comm.device_direct import control

    monkeypatch.setattr(control, "_HELLO_S", 0.3)
    a, b = ControlChannel("127.0.0.1", 0, 1024), ControlChannel("127.0.0.1", 1, 1024)
    port = b.address["port"]
    silent = socket.create_connection(("127.0.0.1", port))  # connects first and never says a word
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            b.connect({0: a.address}, timeout=10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=accept)
    t.start()
    silent.settimeout(5)  # < the connect timeout (10 s): an EOF here came from the hello deadline
    with contextlib.suppress(ConnectionResetError):  # a reset is a close too
        assert silent.recv(1) == b""  # EOF: the listener side closed it
    # closed after its hello deadline, while rank 1 is still waiting for rank 0 (which has not connected yet)
    assert t.is_alive()
    a.connect({1: b.address}, timeout=10)
    t.join(timeout=10)
    assert not errors and not t.is_alive()
    # after the set-up nobody is accepted any more: a late connection is refused, not parked in a backlog
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    got: list = []
    a.send(1, {"k": "credit"})
    _pump([a, b], lambda: bool(got.extend(b.take()) or got))
    assert [(p, n) for p, n, _ in got] == [(0, {"k": "credit"})]
    silent.close()
    a.close()
    b.close()
