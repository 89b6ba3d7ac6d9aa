"""The cpu-forward process group: every tensor crosses through host memory and Gloo over TCP.

Fast path: with one stripe, a CPU tensor's send or receive is posted to Gloo on the caller's thread and
waited for there (``work.DirectWork``), as long as nothing of the same direction and peer still waits on a
worker to be posted; that is what keeps small and mid-size messages at Gloo's speed.

Threads: each (direction, peer) of point-to-point traffic has its own worker, so a send that waits for a
slow receiver never holds up traffic with another peer or in the other direction (1F1B has both in
flight); collectives run on one worker in issue order, which is the same on every rank. The caller only
enqueues and gets a ``Work``; the worker posts the Gloo operations of every chunk (they progress
concurrently, over several stripes), waits for them with the group's deadline, and completes the future.

Device tensors are staged chunk by chunk through pinned buffers from a pool (see ``staging``): for a send,
the device-to-host copies of all chunks are queued on a side stream with one event each, and chunk i is
posted to Gloo as soon as its event fires, while later chunks are still copying; for a receive, chunk i is
copied to the device while chunk i+1 is still arriving. CPU tensors go to Gloo as they are (unless
``BIMETAL_CF_FORCE_STAGING=1``). Collectives on device tensors run in rounds through the same pool
(``rounds``, ``staged_ops``), except all-to-all with uneven splits, which stages whole tensors per call.

With more than one stripe, point-to-point transfers run through ``failover.Transfer``: a stripe that stalls
or fails mid-message is left for good and its chunks are re-sent on the others; the send completes when the
receiver confirms. Collectives do not fail over: on a degraded stripe they fail with an error saying so.
"""

from __future__ import annotations

import threading
import time
import warnings
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from bimetal.comm.base import (
    BimetalProcessGroup,
    OpRecord,
    TransportError,
    UnsupportedOperation,
    check_dtype,
    make_work,
)
from bimetal.comm.cpu_forward import rounds
from bimetal.comm.cpu_forward import staged_ops as so
from bimetal.comm.cpu_forward import staged_p2p as sp
from bimetal.comm.cpu_forward.chunks import HostChunks, StagedRecv, StagedSend
from bimetal.comm.cpu_forward.failover import StripeSet, Transfer, Waiter
from bimetal.comm.cpu_forward.stats import StripeStats
from bimetal.comm.cpu_forward.work import Deadline, DirectWork, Worker
from bimetal.comm.staging import (
    CopyStreams,
    PinnedPool,
    after,
    capture,
    copy_to_device,
    force_staging,
    is_device,
)
from bimetal.comm.striping import SINGLE_BYTES, CpuForwardOptions, chunk_plan


class CpuForwardProcessGroup(BimetalProcessGroup):
    """``bimetal_cpu_forward``: Gloo stripes + host staging, with the ops torch's parallel code uses."""

    backend_name = "bimetal_cpu_forward"

    def __init__(self, stripes: list[dist.ProcessGroupGloo], rank: int, size: int, timeout: timedelta,
                 options: CpuForwardOptions, global_ranks: list[int] | None = None,
                 interfaces: list[str | None] | None = None, checksum: bool = False):
        super().__init__(rank, size, timeout, global_ranks)
        self.stripes: list[Any] = list(stripes)  # Any: torch's stubs for ProcessGroupGloo lack most ops
        self.options = options
        self.interfaces = interfaces or [None] * len(stripes)
        self.checksum = checksum
        slab = max(options.chunk_bytes, SINGLE_BYTES if len(stripes) > 1 else 0)
        # a failover transfer keeps one chunk per stripe in flight: a send and a receive at once need 2K + more
        slabs = max(options.pool_buffers, 4 * len(stripes) if len(stripes) > 1 else 0)
        self.pool = PinnedPool(slabs * slab, slab)
        """Pinned staging: ``pool_buffers`` slabs of the largest chunk, a bound in bytes (``staging``)."""
        self.stage_all = force_staging()
        """``BIMETAL_CF_FORCE_STAGING=1``: CPU tensors take the staged paths too (tests, ``gpu_check --cpu``)."""
        self._streams = CopyStreams()
        self._workers: dict[Any, Worker] = {}
        self._workers_lock = threading.Lock()
        self._timeout_s = timeout.total_seconds()
        self._queued: dict[Any, int] = {}  # jobs submitted per worker key whose Gloo ops are not posted yet
        self._stripe_turn: dict[tuple[str, int], int] = {}
        self._fault: str | None = None
        self.links = StripeSet(self.stripes, self.interfaces)
        """Which stripes still work; with K > 1, point-to-point transfers fail over (``failover.py``)."""
        self.stall_s = options.stall_seconds(timeout)
        self._waiters: dict[Any, list[Waiter]] = {}
        self._deferred: dict[Any, TransportError] = {}
        self._weights: dict[Any, list[int]] = {}  # stripe shares per (direction, peer), agreed per transfer
        self.stats = StripeStats(len(self.stripes))

    def comm_stats(self) -> dict[str, int]:
        """The base counters, the staging pool's allocations, failovers and bytes per stripe (point-to-point)."""
        out = self.counters.snapshot()
        out["pool_buffers_allocated"] = self.pool.allocations
        out["stripes_dead"] = len(self.links.dead)
        out.update(self.stats.snapshot())
        if len(self.stats.stripe_bytes) == 1:  # every point-to-point byte sent rode stripe 0
            out["bytes_stripe0"] = out["bytes_sent"]
        return out

    # --- plumbing ------------------------------------------------------------------------------------
    def _stages(self, *tensors: torch.Tensor) -> bool:
        """Whether the op goes through the pinned pool: a device tensor, or staging forced for CPU ones."""
        return self.stage_all or any(is_device(t) for t in tensors)

    def _worker(self, key: Any) -> Worker:
        with self._workers_lock:
            if key not in self._workers:
                self._workers[key] = Worker(f"bimetal-cf-{self.description}-{key}")
            return self._workers[key]

    def _submit(self, key: Any, op: OpRecord, body: Callable[[Deadline], Any]) -> dist.Work:
        fut: torch.futures.Future = torch.futures.Future()

        def release() -> None:  # the caller may go on; the worker still finishes the op (failover's confirmation)
            if not fut.done():
                fut.set_result(None)

        def settle(exc: TransportError) -> None:
            if not fut.done():
                fut.set_exception(exc)
                return
            # Too late for this op's caller: the next op of this worker reports it, and it is printed now.
            self._deferred[key] = exc
            warnings.warn(f"{exc} (after the operation had completed for the caller)", RuntimeWarning, stacklevel=2)

        def job() -> None:
            try:
                try:
                    earlier = self._deferred.pop(key, None)
                    if earlier is not None:
                        raise TransportError(f"{op.describe()} not started: an earlier transfer with this peer "
                                             f"failed after completing: {earlier}")
                    d = Deadline(op, self.timeout, self.diagnose)
                    d.release = release
                    value = body(d)
                finally:  # every Gloo op of this job is posted (and waited for): the fast path may post again
                    self._queued_done(key)
                if not fut.done():
                    fut.set_result(value)
            except TransportError as exc:
                settle(exc)
            except Exception as exc:  # a Gloo or torch error: name the op, keep the cause's first line
                settle(TransportError(f"{op.describe()} failed: {str(exc).splitlines()[0]}"))

        with self._workers_lock:
            self._queued[key] = self._queued.get(key, 0) + 1
        self._worker(key).submit(job)
        return make_work(fut)

    def _queued_done(self, key: Any) -> None:
        with self._workers_lock:
            self._queued[key] -= 1

    def _direct(self, key: Any) -> bool:
        """Whether an op on ``key`` may be posted on the caller's thread: nothing of that key still waits on its
        worker to be posted (Gloo matches a pair's messages in posting order), and no late error is pending."""
        with self._workers_lock:
            return not self._queued.get(key) and key not in self._deferred

    def _turn(self, direction: str, peer: int) -> int:
        # k-th send to a peer pairs with its k-th receive from us: both sides count (and rotate) the same way.
        key = (direction, peer)
        turn = self._stripe_turn.get(key, 0)
        self._stripe_turn[key] = turn + 1
        return turn

    def inject_fault(self, kind: str | None, stripe: int = 0, after: int = 0) -> None:
        """Test hook: ``"corrupt"`` flips one byte of the next message sent (after its checksum);
        ``"stall"`` makes ``stripe`` of this rank stall after ``after`` more ops (nothing posted, nothing done)."""
        if kind == "stall":
            self.links.stall_after(stripe, after)
            return
        self._fault = kind

    # --- point to point ------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        op = self._begin("send", dst)
        check_dtype(op, tensor)
        if len(self.stripes) > 1:
            turn = self._turn("send", dst)
            ready = capture([tensor])
            return self._submit(("send", dst), op, lambda d: self._send_failover(tensor, dst, tag, turn, d, ready))
        if self._stages(tensor):
            ready = capture([tensor])
            return self._submit(("send", dst), op, lambda d: sp.send_staged(self, tensor, dst, tag, 0, d, ready))
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()  # (Gloo reads the bytes; any shape)
        if self._direct(("send", dst)):  # the fast path: posted here, waited for by the caller (work.py)
            return self._post_direct(op, lambda: self._post_send_host(flat, dst, tag))
        return self._submit(("send", dst), op, lambda d: self._wait_all(d, *self._post_send_host(flat, dst, tag)))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        op = self._begin("recv", src)
        check_dtype(op, tensor)
        if len(self.stripes) > 1:
            turn = self._turn("recv", src)
            ready = capture([tensor])
            return self._submit(("recv", src), op, lambda d: self._recv_failover(tensor, src, tag, turn, d, ready))
        if self._stages(tensor):
            ready = capture([tensor])
            return self._submit(("recv", src), op, lambda d: sp.recv_staged(self, tensor, src, tag, 0, d, ready))
        if self._direct(("recv", src)):
            return self._post_direct(op, lambda: self._post_recv_host(tensor, src, tag, op))
        return self._submit(("recv", src), op, lambda d: self._wait_all(d, *self._post_recv_host(tensor, src, tag, op)))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:  # type: ignore[override]
        raise self.unsupported("recv", "any source")

    def _plan(self, numel: int, esize: int, first: int) -> list[tuple[int, int, int]]:
        return chunk_plan(numel, esize, self.options.chunk_bytes, len(self.stripes), first)

    def _depth(self) -> int:
        """Chunks one staged transfer keeps in flight (and as many copying): a quarter of the pool, so that a send
        and a receive in flight at once never wait on each other for slabs."""
        return max(1, self.pool.capacity // 4)

    def _pool_numel(self, t: torch.Tensor) -> int:
        """Elements of a staging buffer for ``t``'s dtype: one size per dtype (the largest chunk any plan makes),
        so the pool's buffers serve every message size and it stops allocating after warm-up."""
        most = max(self.options.chunk_bytes, SINGLE_BYTES if len(self.stripes) > 1 else 0)
        return max(1, most // t.element_size())

    # --- K > 1: failover (failover.py) ---------------------------------------------------------------
    def _transfer(self, key: tuple[str, int], peer: int, tag: int, turn: int, data: torch.Tensor, d: Deadline,
                  window: int, crc: bool = False) -> tuple[Transfer, list[tuple[int, int]]]:
        """The transfer of ``data`` (flat) and its chunks' element ranges, planned with the stripe shares the
        previous transfer of ``key`` agreed on; with ``crc``, one more chunk (the checksum) on the first stripe."""
        with self._workers_lock:
            if key not in self._waiters:
                self._waiters[key] = [Waiter(f"bimetal-cf-{self.description}-{key}-s{s}")
                                      for s in range(len(self.stripes))]
        weights = self._weights.get(key)
        plan = chunk_plan(data.numel(), data.element_size(), self.options.chunk_bytes, len(self.stripes), turn,
                          weights)
        order = [(j, s) for j, (_, _, s) in enumerate(plan)] + ([(len(plan), plan[0][2])] if crc else [])
        t = Transfer(self.links, self._waiters[key], peer, self.global_rank(peer), tag, turn, order, d, self.stall_s,
                     max(window, len(self.stripes)), weights)
        return t, [(a, b) for a, b, _ in plan]

    def _settled(self, key: tuple[str, int], t: Transfer) -> None:
        """After a transfer of ``key`` completed: keep the shares it agreed on; a send counts its stripes' bytes
        and whether it failed over (the sender's side only, so that sums over ranks count each byte once)."""
        if t.next_weights is not None:
            self._weights[key] = t.next_weights
        if key[0] == "send":
            self.stats.transfer(t.moved, t.rounds)

    def _send_failover(self, tensor: torch.Tensor, dst: int, tag: int, turn: int, d: Deadline,
                       ready: object | None = None) -> None:
        flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().view(-1)
        if self._stages(flat):
            after(self._streams.pair(flat.device)[0], ready)
            t, ranges = self._transfer(("send", dst), dst, tag, turn, flat, d, self._depth())
            io: Any = StagedSend(flat, ranges, self.pool, self._streams.pair(flat.device)[0], self.timeout,
                                  self._pool_numel(flat))
            t.send(io)
            self._settled(("send", dst), t)
            self.counters.add(bytes_sent=flat.numel() * flat.element_size(),
                              bytes_staged=flat.numel() * flat.element_size())
            return
        data, crc = self._payload(flat)
        nbytes = data.numel() * data.element_size()
        # Up to one chunk, a pooled copy lets the caller go on once the data is on the wire, while the worker
        # waits for the receiver's confirmation (and re-sends from the copy): pipeline traffic keeps its latency.
        keep = self.pool.take(data.dtype, self._pool_numel(data), self.timeout) \
            if 0 < nbytes <= self.options.chunk_bytes else None
        if keep is not None:
            data = keep[:data.numel()].copy_(data)
        t, ranges = self._transfer(("send", dst), dst, tag, turn, data, d, 1 << 30, crc is not None)
        io = HostChunks(data, ranges, crc)
        try:
            t.send(io, d.release if keep is not None else None)
        finally:
            if keep is not None:
                self.pool.give(keep)
        self._settled(("send", dst), t)
        self.counters.add(bytes_sent=nbytes, bytes_direct=nbytes)

    def _recv_failover(self, tensor: torch.Tensor, src: int, tag: int, turn: int, d: Deadline,
                       ready: object | None = None) -> None:
        if self._stages(tensor):
            after(self._streams.pair(tensor.device)[1], ready)
            out = tensor.detach().view(-1) if tensor.is_contiguous() else torch.empty_like(tensor).view(-1)
            t, ranges = self._transfer(("recv", src), src, tag, turn, out, d, self._depth())
            staged = StagedRecv(out, ranges, self.pool, self._streams.pair(out.device)[1], self.timeout,
                                 self._depth(), self._pool_numel(out))

            def complete_staged() -> None:
                staged.finish()
                if not tensor.is_contiguous():
                    tensor.detach().copy_(out.view(tensor.shape))
                self.counters.add(bytes_received=out.numel() * out.element_size(),
                                  bytes_staged=out.numel() * out.element_size())
                d.release()

            t.recv(staged, None, complete_staged)
            self._settled(("recv", src), t)
            return
        direct = tensor.is_contiguous()
        target = tensor.view(-1) if direct else torch.empty(tensor.numel(), dtype=tensor.dtype)
        data = target.view(torch.uint8) if target.dtype == torch.bool else target
        t, ranges = self._transfer(("recv", src), src, tag, turn, data, d, 1 << 30, self.checksum)
        crc = torch.zeros(1, dtype=torch.int64) if self.checksum else None
        io = HostChunks(data, ranges, crc)
        verify = (lambda: int(crc.item()) == int(self._crc(data).item())) if crc is not None else None

        def complete() -> None:  # every byte is in (and checked): the caller may go on; the status follows
            if not direct:
                tensor.copy_(target.view(tensor.shape))
            self.counters.add(bytes_received=data.numel() * data.element_size(),
                              bytes_direct=data.numel() * data.element_size())
            d.release()

        t.recv(io, verify, complete)
        self._settled(("recv", src), t)

    def _payload(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bytes a host send puts on the wire, with their CRC when checksums are on (and the test fault)."""
        data = flat.view(torch.uint8) if flat.dtype is torch.bool else flat
        crc = self._crc(data) if self.checksum else None
        if self._fault == "corrupt" and data.numel():
            data = data.clone()
            data.reshape(-1).view(torch.uint8)[0] ^= 0xFF
            self._fault = None
        return data, crc

    # --- K = 1 -----------------------------------------------------------------------------------------
    def _post_direct(self, op: OpRecord, post: Callable[[], tuple[list[Any], Callable[[], None]]]) -> dist.Work:
        end = time.monotonic() + self._timeout_s

        def deadline() -> Deadline:
            return Deadline(op, self.timeout, self.diagnose)

        try:
            works, finish = post()
        except RuntimeError as exc:  # Gloo refuses to post (a closed pair): the caller's wait() reports it
            return DirectWork([], op, end, deadline,
                              error=TransportError(f"{op.describe()} failed: {str(exc).splitlines()[0]}"))
        return DirectWork(works, op, end, deadline, finish)

    def _host_chunks(self, data: torch.Tensor) -> list[torch.Tensor]:
        """``data`` whole when it fits one chunk (no reshape, no slice: each costs microseconds), else its chunks."""
        if data.numel() * data.element_size() <= self.options.chunk_bytes:
            return [data]
        flat = data.reshape(-1)
        return [flat[a:b] for a, b, _ in self._plan(flat.numel(), flat.element_size(), 0)]

    @staticmethod
    def _wait_all(d: Deadline, works: list[Any], finish: Callable[[], None]) -> None:
        for w in works:
            d.wait(w)
        finish()

    def _post_send_host(self, flat: torch.Tensor, dst: int, tag: int) -> tuple[list[Any], Callable[[], None]]:
        """K = 1, a CPU tensor: post its chunks (and CRC) to Gloo; ``finish`` counts it once they completed."""
        data, crc = self._payload(flat)
        stripe = self.stripes[0]
        works = [stripe.send([part], dst, tag) for part in self._host_chunks(data)]
        if crc is not None:
            works.append(stripe.send([crc], dst, tag))
        nbytes = data.numel() * data.element_size()

        def finish() -> None:  # (with one stripe, bytes_stripe0 is derived in comm_stats: one lock less per op)
            self.counters.add(bytes_sent=nbytes, bytes_direct=nbytes)

        return works, finish

    def _post_recv_host(self, tensor: torch.Tensor, src: int, tag: int, op: OpRecord
                        ) -> tuple[list[Any], Callable[[], None]]:
        direct = tensor.is_contiguous()
        target = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
        data = target.view(torch.uint8) if target.dtype is torch.bool else target
        stripe = self.stripes[0]
        works = [stripe.recv([part], src, tag) for part in self._host_chunks(data)]
        crc = torch.zeros(1, dtype=torch.int64) if self.checksum else None
        if crc is not None:
            works.append(stripe.recv([crc], src, tag))

        def finish() -> None:
            if crc is not None and int(crc.item()) != int(self._crc(data).item()):
                raise TransportError(f"{op.describe()}: checksum mismatch, the data was corrupted in transit "
                                     "(not used)")
            if not direct:
                tensor.copy_(target)
            nbytes = data.numel() * data.element_size()
            self.counters.add(bytes_received=nbytes, bytes_direct=nbytes)

        return works, finish

    @staticmethod
    def _crc(data: torch.Tensor) -> torch.Tensor:
        raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        return torch.tensor([zlib.crc32(raw)], dtype=torch.int64)  # type: ignore[arg-type]

    # --- collectives ---------------------------------------------------------------------------------
    def _collective(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                    call: Callable[[Callable[[torch.Tensor], torch.Tensor]], list[dist.Work]],
                    staged: Callable[[Callable[[torch.Tensor], torch.Tensor], so.Stripe], list[rounds.Staged]]
                    | None = None) -> dist.Work:
        # ``body`` returns the outputs: the future's value, like NCCL's
        """Run ``call(host)`` on the collective worker; ``host(t)`` is t's host (contiguous) stand-in. With
        device tensors (or staging forced), ``staged(flat, stripe)`` instead: the op in rounds through the pool."""
        op = self._begin(name)
        for t in (*ins, *outs):
            check_dtype(op, t)
        if staged is not None and self._stages(*ins, *outs):
            return self._submit("collective", op, self._staged_body(ins, outs, staged))

        def body(d: Deadline) -> list[torch.Tensor]:
            stand_in: dict[int, torch.Tensor] = {}
            in_ids = {id(t) for t in ins}

            def host(t: torch.Tensor) -> torch.Tensor:
                if id(t) not in stand_in:
                    if not is_device(t) and t.is_contiguous():
                        stand_in[id(t)] = t
                    elif id(t) in in_ids:
                        stand_in[id(t)] = t.detach().to("cpu", copy=True).contiguous()
                    else:
                        stand_in[id(t)] = torch.empty(t.shape, dtype=t.dtype)
                return stand_in[id(t)]

            for w in call(host):
                d.wait(w)
            staged = 0
            for t in outs:
                h = stand_in.get(id(t))
                if h is not None and h is not t:
                    t.copy_(h)
                    staged += h.numel() * h.element_size()
            staged += sum(t.numel() * t.element_size() for t in ins if is_device(t))
            self.counters.add(bytes_staged=staged)
            return list(outs)  # what NCCL's futures hold: the output tensors

        return self._submit("collective", op, body)

    def _staged_body(self, ins: list[torch.Tensor], outs: list[torch.Tensor],
                     staged: Callable[[Callable[[torch.Tensor], torch.Tensor], so.Stripe], list[rounds.Staged]]
                     ) -> Callable[[Deadline], list[torch.Tensor]]:
        """On the caller's thread: flat contiguous views (a contiguous copy, made on the producer's stream, for a
        strided tensor) and the producer's event; the returned body runs the rounds on the worker."""
        flat: dict[int, torch.Tensor] = {}
        for t in (*ins, *outs):
            if id(t) not in flat:
                if t.is_contiguous():
                    flat[id(t)] = t.detach().view(-1)
                elif any(t is i for i in ins):
                    flat[id(t)] = t.detach().contiguous().view(-1)
                else:
                    flat[id(t)] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        ready = capture([*ins, *outs])
        device = (ins or outs)[0].device

        def body(d: Deadline) -> list[torch.Tensor]:
            streams = self._streams.pair(device)
            ops = staged(lambda t: flat[id(t)], lambda i: self._cstripe(i % len(self.stripes)))
            nbytes = sum(rounds.run(s, self.pool, streams, ready, d, self.timeout) for s in ops)
            for t in outs:
                if not t.is_contiguous():
                    copy_to_device(flat[id(t)].view(t.shape), t, streams[1]).synchronize()  # type: ignore[attr-defined]
            self.counters.add(bytes_staged=nbytes)
            return list(outs)

        return body

    def _cstripe(self, i: int) -> Any:
        """Stripe ``i`` for a collective; collectives do not fail over, so a degraded stripe is an error."""
        if self.links.is_dead(i):
            raise RuntimeError(f"stripe {i} (interface {self.interfaces[i] or 'default'}) of this group is degraded "
                               f"after a link fault ({self.links.dead.get(i)}); collectives do not fail over, only "
                               "point-to-point transfers do")
        return self.stripes[i]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts or AllreduceOptions()

        def call(host: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            works = []
            for t in tensors:
                h = host(t)
                parts = self._stripe_parts(h)
                for i, part in enumerate(parts):
                    o = AllreduceOptions()
                    o.reduceOp = opts.reduceOp
                    works.append(self._cstripe(i).allreduce([part], o))
            return works

        return self._collective("all_reduce", tensors, tensors, call,
                                lambda f, st: [so.allreduce(f(t), st, opts.reduceOp) for t in tensors])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self.allreduce(tensors, opts)

    def _stripe_parts(self, h: torch.Tensor) -> list[torch.Tensor]:
        k = len(self.stripes)
        if k == 1 or h.numel() * h.element_size() < 2 * self.options.chunk_bytes:
            return [h]
        return [p for p in h.view(-1).tensor_split(k) if p.numel()]

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts or BroadcastOptions()
        root = opts.rootRank
        ins = tensors if self._rank == root else []

        def call(host: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            works = []
            for t in tensors:
                for i, part in enumerate(self._stripe_parts(host(t))):
                    o = BroadcastOptions()
                    o.rootRank = root
                    works.append(self._cstripe(i).broadcast([part], o))
            return works

        return self._collective("broadcast", ins, tensors, call,
                                lambda f, st: [so.broadcast(f(t), st, root, self._rank) for t in tensors])

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> dist.Work:
        outs = [t for lst in output_lists for t in lst]
        return self._collective("all_gather", inputs, outs, lambda h: [self._cstripe(0).allgather(
            [[h(t) for t in lst] for lst in output_lists], [h(t) for t in inputs], AllgatherOptions())],
            lambda f, st: [so.all_gather([f(o) for o in lst], f(i), st) for lst, i in zip(output_lists, inputs)])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                          opts: Any = None) -> dist.Work:
        return self._collective("all_gather_into_tensor", [input], [output], lambda h: [
            self._cstripe(0)._allgather_base(h(output), h(input), AllgatherOptions())],
            lambda f, st: [so.all_gather_into(f(output), f(input), st, self._size)])

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                                        opts: Any = None) -> dist.Work:
        return self._collective("all_gather_into_tensor_coalesced", inputs, outputs, lambda h: [
            self._cstripe(0)._allgather_base(h(o), h(i), AllgatherOptions()) for o, i in zip(outputs, inputs)],
            lambda f, st: [so.all_gather_into(f(o), f(i), st, self._size) for o, i in zip(outputs, inputs)])

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        ins = [t for lst in input_lists for t in lst]

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            o = ReduceScatterOptions()
            o.reduceOp = opts.reduceOp
            return [self._cstripe(0).reduce_scatter([h(t) for t in outputs], [[h(t) for t in lst]
                                                                            for lst in input_lists], o)]

        return self._collective("reduce_scatter", ins, outputs, call, lambda f, st: [
            so.reduce_scatter(f(o), [f(t) for t in lst], st, opts.reduceOp) for o, lst in zip(outputs, input_lists)])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                              opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            o = ReduceScatterOptions()
            o.reduceOp = opts.reduceOp
            return [self._cstripe(0)._reduce_scatter_base(h(output), h(input), o)]

        return self._collective("reduce_scatter_tensor", [input], [output], call, lambda f, st: [
            so.reduce_scatter_into(f(output), f(input), st, self._size, opts.reduceOp)])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                                        opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            works = []
            for out, inp in zip(outputs, inputs):
                o = ReduceScatterOptions()
                o.reduceOp = opts.reduceOp
                works.append(self._cstripe(0)._reduce_scatter_base(h(out), h(inp), o))
            return works

        return self._collective("reduce_scatter_tensor_coalesced", inputs, outputs, call, lambda f, st: [
            so.reduce_scatter_into(f(o), f(i), st, self._size, opts.reduceOp) for o, i in zip(outputs, inputs)])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # type: ignore[override]
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        equal = all(len(set(s)) <= 1 for s in (output_split_sizes, input_split_sizes)) and \
            input.numel() % self._size == 0 and output.numel() == input.numel()
        return self._collective("all_to_all_single", [input], [output], lambda h: [self._cstripe(0).alltoall_base(
            h(output), h(input), list(output_split_sizes), list(input_split_sizes), AllToAllOptions())],
            (lambda f, st: [so.all_to_all_equal(f(output), f(input), st, self._size)]) if equal else None)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                 opts: Any = None) -> dist.Work:
        equal = len({t.numel() for t in (*inputs, *outputs)}) == 1
        return self._collective("all_to_all", inputs, outputs, lambda h: [self._cstripe(0).alltoall(
            [h(t) for t in outputs], [h(t) for t in inputs], AllToAllOptions())],
            (lambda f, st: [so.all_to_all([f(t) for t in outputs], [f(t) for t in inputs], st)]) if equal else None)

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._collective("barrier", [], [], lambda h: [self._cstripe(0).barrier(BarrierOptions())])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> dist.Work:
        opts = opts or ScatterOptions()
        ins = [t for lst in input_lists for t in lst]

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            o = ScatterOptions()
            o.rootRank = opts.rootRank
            return [self._cstripe(0).scatter([h(t) for t in outputs], [[h(t) for t in lst] for lst in input_lists], o)]

        return self._collective("scatter", ins, outputs, call, lambda f, st: [
            so.scatter(f(outputs[0]), [f(t) for t in ins], st, opts.rootRank, self._size)])

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> dist.Work:
        opts = opts or GatherOptions()
        outs = [t for lst in output_lists for t in lst]

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            o = GatherOptions()
            o.rootRank = opts.rootRank
            return [self._cstripe(0).gather([[h(t) for t in lst] for lst in output_lists], [h(t) for t in inputs], o)]

        return self._collective("gather", inputs, outs, call, lambda f, st: [
            so.gather([f(t) for t in outs], f(inputs[0]), st, opts.rootRank, self._size)])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts or ReduceOptions()

        def call(h: Callable[[torch.Tensor], torch.Tensor]) -> list[dist.Work]:
            o = ReduceOptions()
            o.reduceOp, o.rootRank, o.rootTensor = opts.reduceOp, opts.rootRank, opts.rootTensor
            return [self._cstripe(0).reduce([h(t) for t in tensors], o)]

        return self._collective("reduce", tensors, tensors, call, lambda f, st: [
            so.reduce(f(t), st, opts.reduceOp, opts.rootRank) for t in tensors])

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:  # type: ignore[override]
        raise UnsupportedOperation(f"group {self.description!r}: monitored_barrier is not supported by "
                                   f"{self.backend_name}; use barrier (it has the group's timeout)")

    def shutdown(self) -> None:  # type: ignore[override]
        if self._closed:
            return
        super().shutdown()
        with self._workers_lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.stop(timeout=5.0)
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.stop()
        self.stripes = []
