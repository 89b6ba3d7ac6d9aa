"""cpu-forward's point-to-point paths, chosen per message by ``send`` / ``recv``:

* one stripe, a CPU tensor, nothing of that direction and peer queued: the fast path, posted to Gloo on the
  caller's thread and waited for there (``work.DirectWork``); queued behind earlier ops, the same on the worker.
  A contiguous message of at most one chunk without checksums is one Gloo op, and the group's ``send`` /
  ``recv`` take it before the common path (``Lean``: the op's number and bytes under one lock, no closure, and
  a ``work.LeanWork`` that is Gloo's own wait until it fails): 4.3-5.0 us of Python per op waited for on a
  2-core VM (against a completed stripe), where the common path took 15-19 us;
* one stripe, a device tensor (or staging forced): the staged chunk pipeline (``pipeline``) on the worker;
* K > 1 stripes: a failover transfer (``failover.Transfer``) over the chunk sources and sinks of ``chunks``,
  host tensors sent from or received into in place, device tensors staged chunk by chunk.

A host message carries its CRC32 as one more chunk when checksums are on (``BIMETAL_CF_CHECKSUM=1``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.base import SUPPORTED_DTYPES, OpRecord, TransportError
from bimetal.comm.cpu_forward import pipeline
from bimetal.comm.cpu_forward.chunks import HostChunks, StagedRecv, StagedSend
from bimetal.comm.cpu_forward.staging import OpEnd, after, capture
from bimetal.comm.cpu_forward.state import GroupState
from bimetal.comm.cpu_forward.work import Deadline, DirectWork, LeanWork


def send(g: GroupState, op: OpRecord, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
    (tensor,) = tensors
    key = ("send", dst)
    if len(g.stripes) > 1:
        turn = g.turn("send", dst)
        ready = capture([tensor])
        return g.workers.submit(key, op, lambda d: _send_failover(g, tensor, dst, tag, turn, d, ready))
    if g.stages(tensor):
        ready = capture([tensor])
        return g.workers.submit(key, op, lambda d: pipeline.send_staged(g, tensor, dst, tag, 0, d, ready))
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()  # (Gloo reads the bytes; any shape)
    if g.workers.direct(key):  # the fast path: posted here, waited for by the caller (work.py)
        return _post_direct(g, op, lambda: _post_send_host(g, flat, dst, tag))
    return g.workers.submit(key, op, lambda d: _wait_all(d, *_post_send_host(g, flat, dst, tag)))


def recv(g: GroupState, op: OpRecord, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
    (tensor,) = tensors
    key = ("recv", src)
    end = OpEnd(tensor.device) if g.stages(tensor) else None  # staged: wait() orders the caller's stream
    if len(g.stripes) > 1:
        turn = g.turn("recv", src)
        ready = capture([tensor])
        return g.workers.submit(key, op, lambda d: _recv_failover(g, tensor, src, tag, turn, d, ready, end), end)
    if end is not None:
        ready = capture([tensor])
        return g.workers.submit(key, op, lambda d: pipeline.recv_staged(g, tensor, src, tag, 0, d, end, ready),
                                 end)
    if g.workers.direct(key):
        return _post_direct(g, op, lambda: _post_recv_host(g, tensor, src, tag, op))
    return g.workers.submit(key, op, lambda d: _wait_all(d, *_post_recv_host(g, tensor, src, tag, op)))


def crc32(data: torch.Tensor) -> torch.Tensor:
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    return torch.tensor([zlib.crc32(raw)], dtype=torch.int64)  # type: ignore[arg-type]


def _payload(g: GroupState, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bytes a host send puts on the wire, with their CRC when checksums are on."""
    data = flat.view(torch.uint8) if flat.dtype is torch.bool else flat
    return data, crc32(data) if g.checksum else None


# --- K > 1: failover (failover.py) -------------------------------------------------------------------------
def _send_failover(g: GroupState, tensor: torch.Tensor, dst: int, tag: int, turn: int, d: Deadline,
                   ready: object | None = None) -> None:
    key = ("send", dst)
    flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().view(-1)
    if g.stages(flat):
        stream = g.streams.pair(flat.device)[0]
        after(stream, ready)
        t, ranges = g.failover.transfer(key, tag, turn, flat, d, g.depth())
        io = StagedSend(flat, ranges, g.pool, stream, g.timeout, g.pool_numel(flat), [j for j, _ in t.plan],
                        g.depth())
        try:
            t.send(io)
        finally:
            io.close()
        g.failover.settled(key, t)
        g.counters.add(bytes_sent=flat.numel() * flat.element_size(), bytes_staged=flat.numel() * flat.element_size())
        return
    data, crc = _payload(g, flat)
    nbytes = data.numel() * data.element_size()
    # Up to one chunk, a pooled copy lets the caller go on once the data is on the wire, while the worker
    # waits for the receiver's confirmation (and re-sends from the copy): pipeline traffic keeps its latency.
    keep = g.pool.take(data.dtype, g.pool_numel(data), g.timeout) \
        if 0 < nbytes <= g.options.chunk_bytes else None
    if keep is not None:
        data = keep[:data.numel()].copy_(data)
    t, ranges = g.failover.transfer(key, tag, turn, data, d, 1 << 30, crc is not None)
    try:
        t.send(HostChunks(data, ranges, crc), d.release if keep is not None else None)
    finally:
        if keep is not None:
            g.pool.give(keep)
    g.failover.settled(key, t)
    g.counters.add(bytes_sent=nbytes, bytes_direct=nbytes)


def _recv_failover(g: GroupState, tensor: torch.Tensor, src: int, tag: int, turn: int, d: Deadline,
                   ready: object | None = None, end: OpEnd | None = None) -> None:
    key = ("recv", src)
    if end is not None:
        stream = g.streams.pair(tensor.device)[1]
        after(stream, ready)
        out = tensor.detach().view(-1) if tensor.is_contiguous() else torch.empty_like(tensor).view(-1)
        t, ranges = g.failover.transfer(key, tag, turn, out, d, g.depth())
        staged = StagedRecv(out, ranges, g.pool, stream, g.timeout, g.depth(), g.pool_numel(out))

        t.recv(staged, None, lambda: pipeline.complete_in_stream_order(g, staged, tensor, out, stream, end, d))
        g.failover.settled(key, t)
        return
    direct = tensor.is_contiguous()
    target = tensor.view(-1) if direct else torch.empty(tensor.numel(), dtype=tensor.dtype)
    data = target.view(torch.uint8) if target.dtype == torch.bool else target
    t, ranges = g.failover.transfer(key, tag, turn, data, d, 1 << 30, g.checksum)
    crc = torch.zeros(1, dtype=torch.int64) if g.checksum else None
    verify = (lambda: int(crc.item()) == int(crc32(data).item())) if crc is not None else None

    def complete() -> None:  # every byte is in (and checked): the caller may go on; the status follows
        if not direct:
            tensor.copy_(target.view(tensor.shape))
        g.counters.add(bytes_received=data.numel() * data.element_size(),
                        bytes_direct=data.numel() * data.element_size())
        d.release()

    t.recv(HostChunks(data, ranges, crc), verify, complete)
    g.failover.settled(key, t)


# --- K = 1, host tensors ------------------------------------------------------------------------------------
LEAN_DTYPES = frozenset(d for d in SUPPORTED_DTYPES if d is not torch.bool)


class Lean:
    """The one-message fast path of a group with one stripe, no checksum and no forced staging (the group's
    ``lean``; None elsewhere and once the group is shut down): a contiguous CPU tensor of a dtype Gloo sends as
    is, no larger than one chunk, with nothing of that direction and peer queued on a worker, is one Gloo op
    posted on the caller's thread. No closure, no copy, one lock (the op's number and its bytes, counted once it is
    posted), and a ``LeanWork`` whose words are made only if it fails: what a small message costs on top of
    Gloo's own.

    Its fields are what an op reads, as plain attributes: each attribute of the group (a torch ``ProcessGroup``
    subclass, through pybind) costs about twice a plain object's, and a 64 KiB message has ~20 us to spare."""

    __slots__ = ("stripe", "limit", "workers", "counters")

    def __init__(self, stripe: Any, limit: int, workers: Any, counters: Any):
        self.stripe, self.limit, self.workers, self.counters = stripe, limit, workers, counters

    def send(self, g: GroupState, t: torch.Tensor, dst: int, tag: int) -> dist.Work | None:
        """``t`` sent as one Gloo op, or None where the fast path does not apply (the caller takes the common path)."""
        return self._post(g, t, dst, tag, "send")

    def recv(self, g: GroupState, t: torch.Tensor, src: int, tag: int) -> dist.Work | None:
        """The receiving side of ``send``: straight into the caller's tensor."""
        return self._post(g, t, src, tag, "recv")

    def _post(self, g: GroupState, t: torch.Tensor, peer: int, tag: int, kind: str) -> dist.Work | None:
        if not (t.is_cpu and t.dtype in LEAN_DTYPES and t.is_contiguous()):
            return None
        nbytes = t.nbytes
        if nbytes > self.limit or not self.workers.direct((kind, peer)):
            return None
        # Posted first, counted after: the count overlaps the transfer instead of delaying it (a reply's post is
        # on the round trip's critical path).
        sending = kind == "send"
        try:
            posted = self.stripe.send([t], peer, tag) if sending else self.stripe.recv([t], peer, tag)
        except RuntimeError as exc:  # Gloo refuses to post (a closed pair): the caller's wait() reports it
            seq = self.counters.begin(sent=nbytes) if sending else self.counters.begin(received=nbytes)
            op = OpRecord(g.description, kind, seq, g.global_ranks[peer])
            return DirectWork(g, op, [], error=_post_error(op, exc))
        seq = self.counters.begin(sent=nbytes) if sending else self.counters.begin(received=nbytes)
        return LeanWork(g, (kind, seq, peer), posted)


def _post_error(op: OpRecord, exc: RuntimeError) -> TransportError:
    return TransportError(f"{op.describe()} failed: {str(exc).splitlines()[0]}")


def _post_direct(g: GroupState, op: OpRecord,
                 post: Callable[[], tuple[list[Any], Callable[[], None]]]) -> dist.Work:
    try:
        works, finish = post()
    except RuntimeError as exc:  # Gloo refuses to post (a closed pair): the caller's wait() reports it
        return DirectWork(g, op, [], error=_post_error(op, exc))
    return DirectWork(g, op, works, finish)


def _host_chunks(g: GroupState, data: torch.Tensor) -> list[torch.Tensor]:
    """``data`` whole when it fits one chunk (no reshape, no slice: each costs microseconds), else its chunks."""
    if data.numel() * data.element_size() <= g.options.chunk_bytes:
        return [data]
    flat = data.reshape(-1)
    return [flat[a:b] for a, b, _ in g.plan(flat.numel(), flat.element_size(), 0)]


def _wait_all(d: Deadline, works: list[Any], finish: Callable[[], None]) -> None:
    for w in works:
        d.wait(w)
    finish()


def _post_send_host(g: GroupState, flat: torch.Tensor, dst: int, tag: int
                    ) -> tuple[list[Any], Callable[[], None]]:
    """Post a CPU tensor's chunks (and CRC) to Gloo; ``finish`` counts it once they completed."""
    data, crc = _payload(g, flat)
    stripe = g.stripes[0]
    works = [stripe.send([part], dst, tag) for part in _host_chunks(g, data)]
    if crc is not None:
        works.append(stripe.send([crc], dst, tag))
    nbytes = data.numel() * data.element_size()

    def finish() -> None:  # (with one stripe, bytes_stripe0 is derived in comm_stats: one lock less per op)
        g.counters.add(bytes_sent=nbytes, bytes_direct=nbytes)

    return works, finish


def _post_recv_host(g: GroupState, tensor: torch.Tensor, src: int, tag: int, op: OpRecord
                    ) -> tuple[list[Any], Callable[[], None]]:
    direct = tensor.is_contiguous()
    target = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
    data = target.view(torch.uint8) if target.dtype is torch.bool else target
    stripe = g.stripes[0]
    works = [stripe.recv([part], src, tag) for part in _host_chunks(g, data)]
    crc = torch.zeros(1, dtype=torch.int64) if g.checksum else None
    if crc is not None:
        works.append(stripe.recv([crc], src, tag))

    def finish() -> None:
        if crc is not None and int(crc.item()) != int(crc32(data).item()):
            raise TransportError(f"{op.describe()}: checksum mismatch, the data was corrupted in transit "
                                 "(not used)")
        if not direct:
            tensor.copy_(target)
        nbytes = data.numel() * data.element_size()
        g.counters.add(bytes_received=nbytes, bytes_direct=nbytes)

    return works, finish
