"""The GPU ladder's reference boundaries (``bimetal.comm.reference``), two ranks on threads over real Gloo.

``RecordingStripe`` stands in for a byte counter on the wire: it hands every op to the real Gloo group
underneath and records the bytes of the tensors it was given, so the test sees what crossed, not what the
group says it sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import run_threads

from bimetal.comm.base import TransportError, UnsupportedOperation
from bimetal.comm.reference import TOKEN_BYTES, HostCopyGroup, IdealBoundaryGroup
from bimetal.comm.striping import build_stripes

TIMEOUT = timedelta(seconds=20)
pytestmark = pytest.mark.timeout(60)


class RecordingStripe:
    """A Gloo group that records the bytes of every tensor handed to send, recv and the collectives."""

    def __init__(self, gloo: Any) -> None:
        self.gloo = gloo
        self.sent: list[int] = []
        self.received: list[int] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.sent += [t.numel() * t.element_size() for t in tensors]
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self.received += [t.numel() * t.element_size() for t in tensors]
        return self.gloo.recv(tensors, src, tag)

    def __getattr__(self, name: str) -> Any:  # collectives: recorded as sent
        op = getattr(self.gloo, name)

        def call(*args: Any) -> Any:
            self.sent += [t.numel() * t.element_size() for t in args[0]] if isinstance(args[0], list) else []
            return op(*args)
        return call


def _pair(cls: type, body: Callable[[Any, RecordingStripe, int], None]) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        (gloo,) = build_stripes(dist.PrefixStore("ref", store), r, 2, TIMEOUT, [None])
        wire = RecordingStripe(gloo)
        pg = cls(wire, r, 2, TIMEOUT)
        try:
            body(pg, wire, r)
        finally:
            pg.shutdown()

    run_threads(rank)


SIZES = [(3, 1000), (5000,), (7, 11)]  # a 1F1B-like sequence of activation shapes


def test_ideal_group_keeps_the_order_and_moves_no_activation_bytes() -> None:
    seen: dict[int, Any] = {}
    posted = threading.Event()

    def body(pg: IdealBoundaryGroup, wire: RecordingStripe, r: int) -> None:
        if r == 0:
            time.sleep(0.3)  # the receiver is already waiting: its wait must last until this send is posted
            posted.set()
            for k, shape in enumerate(SIZES):
                pg.send([torch.full(shape, float(k))], 1, 0).wait()
            got = torch.empty(4, 4)
            pg.recv([got], 1, 0).wait()  # the gradient coming back
            pg.send([torch.arange(5)], 1, 0).wait()  # metadata (an int64 tensor) crosses for real
            seen[0] = (list(wire.sent), list(wire.received), pg.elided_bytes, got)
        else:
            bufs = [torch.full(shape, float("nan")) for shape in SIZES]
            works = [pg.recv([b], 0, 0) for b in bufs]  # posted before the sends, as a pipeline does
            works[0].wait()
            order_ok = posted.is_set()
            for w in works[1:]:
                w.wait()
            pg.send([torch.ones(4, 4)], 0, 0).wait()
            meta = torch.zeros(5, dtype=torch.int64)
            pg.recv([meta], 0, 0).wait()
            assert torch.equal(meta, torch.arange(5))
            seen[1] = (list(wire.sent), list(wire.received), order_ok, bufs)

    _pair(IdealBoundaryGroup, body)
    sent0, received0, elided, grad = seen[0]
    sent1, received1, order_ok, bufs = seen[1]
    payload = sum(torch.Size(s).numel() * 4 for s in SIZES)
    # floating-point payloads: a token per message, nothing else; the int64 metadata: its 40 bytes
    assert sent0 == [TOKEN_BYTES] * len(SIZES) + [40] and received0 == [TOKEN_BYTES]
    assert sent1 == [TOKEN_BYTES] and received1 == [TOKEN_BYTES] * len(SIZES) + [40]
    assert elided == payload  # what a real link would have carried
    assert order_ok, "a receive completed before its send was posted"
    for k, b in enumerate(bufs):  # filled with the stand-in pattern, not the sender's value k
        assert torch.isfinite(b).all() and not torch.equal(b, torch.full_like(b, float(k)))
        assert 0.5 < b.std().item() < 2.0
    assert torch.isfinite(grad).all() and not torch.equal(grad, torch.ones(4, 4))


def test_ideal_group_refuses_a_receive_that_does_not_match_the_send() -> None:
    def body(pg: IdealBoundaryGroup, wire: RecordingStripe, r: int) -> None:
        if r == 0:
            pg.send([torch.zeros(10)], 1, 0).wait()
        else:
            with pytest.raises(TransportError, match=r"message #0 holds 10 elements of torch.float32.*expects 12"):
                pg.recv([torch.empty(12)], 0, 0).wait()

    _pair(IdealBoundaryGroup, body)


def test_host_copy_group_moves_the_data_through_host_copies() -> None:
    def body(pg: HostCopyGroup, wire: RecordingStripe, r: int) -> None:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
        if r == 0:
            pg.send([x], 1, 0).wait()
        else:
            got = torch.empty(2, 3)
            pg.recv([got], 0, 0).wait()
            assert torch.equal(got, torch.arange(6, dtype=torch.float32).reshape(2, 3))
        y = torch.full((5,), float(r + 1))
        pg.allreduce([y]).wait()
        assert torch.equal(y, torch.full((5,), 3.0))
        z = torch.full((2,), float(r))
        pg.broadcast([z]).wait()  # root 0
        assert torch.equal(z, torch.zeros(2))
        flat = torch.empty(4)
        pg._allgather_base(flat, torch.full((2,), float(r))).wait()
        assert torch.equal(flat, torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert pg.counters.snapshot()["bytes_staged"] > 0
        assert (wire.sent if r == 0 else wire.received)[0] == 24  # the payload itself crossed (6 x float32)
        with pytest.raises(UnsupportedOperation, match="all_to_all_single is not supported by bimetal_host_copy"):
            pg.alltoall_base(torch.empty(2), torch.empty(2), [], [])
        pg.barrier().wait()

    _pair(HostCopyGroup, body)
