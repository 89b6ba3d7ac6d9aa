"""Two reference groups for measuring a pipeline boundary: what a naive port does, and what a perfect link does.

* ``bimetal_host_copy`` (``HostCopyGroup``): the compatibility baseline. Every op copies its device tensor to
  host memory on the caller's thread (a plain, synchronous ``.to("cpu")``), runs the stock Gloo op on the copy,
  and copies the result back when the caller waits: what a job that only has Gloo for a cross-vendor group
  must do by hand, since Gloo's point-to-point takes only CPU tensors. Nothing is chunked or overlapped.
  CPU tensors are copied too (a memcpy), so that ``--cpu`` runs take the same path.
* ``bimetal_ideal`` (``IdealBoundaryGroup``): a perfect link for the activations a pipeline boundary carries. A
  send of a floating-point tensor moves no payload: it sends a 24-byte token (sequence number, element count,
  dtype) over Gloo, and the receiver,
  once the token has arrived, fills its buffer on the device with a deterministic pseudo-random normal
  pattern. So the pipeline schedule's order and its blocking are real (a receive waits for the matching send
  to be posted, and a token that does not match the receive's size, dtype or turn fails the receive in one
  sentence), but no activation byte crosses: the time is what a link of infinite bandwidth and Gloo's small-
  message latency gives. What the receiver computes on is that pattern, not the sender's data, so the loss
  of a pipeline over this group means nothing; only its timing does. Collectives (the loss broadcast, the
  gradient-norm all-reduce: a few bytes per step) are real, as in ``HostCopyGroup``, and so are integer and
  byte messages (the pipeline stage's set-up metadata: pickled objects and their sizes), which the stages
  must read.

NCCL refuses two ranks on one GPU, so on one GPU this is the homogeneous reference of ``bimetal bench
gpu-ladder``. Both are registered by ``bimetal.comm.registry``; neither is a transport users choose for
training (not in ``bimetal.transports.TABLE``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.base import BimetalProcessGroup, OpRecord, TransportError
from bimetal.comm.cpu_forward.work import DirectWork
from bimetal.transports import HOST_COPY, IDEAL

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
"""dtype <-> the code a token carries (the dtypes every bimetal transport takes)."""
TOKEN_BYTES = 3 * 8
"""Bytes on the wire per point-to-point message of ``IdealBoundaryGroup``: sequence number, elements, dtype."""


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (synchronous for a device tensor: the caller's thread waits for the device)."""
    host = torch.empty(t.shape, dtype=t.dtype)
    host.copy_(t.detach())
    return host


class HostCopyGroup(BimetalProcessGroup):
    """``bimetal_host_copy``: copy to host, stock Gloo, copy back; send, recv, broadcast, all_reduce, all_gather
    into one tensor and barrier (any other op is refused by name, as in every bimetal transport)."""

    backend_name = HOST_COPY

    def __init__(self, gloo: Any, rank: int, size: int, timeout: timedelta, global_ranks: list[int] | None = None):
        super().__init__(rank, size, timeout, global_ranks)
        self.gloo = gloo  # Any: torch's stubs for ProcessGroupGloo lack most ops
        self.timeout_s = timeout.total_seconds()

    def _count(self, sent: int = 0, received: int = 0) -> None:
        self.counters.add(bytes_sent=sent, bytes_received=received, bytes_staged=sent + received)

    def _do_send(self, op: OpRecord, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        (t,) = tensors
        host = _to_host(t)
        self._count(sent=host.numel() * host.element_size())
        return DirectWork(self, op, [self.gloo.send([host], dst, tag)])

    def _do_recv(self, op: OpRecord, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        (t,) = tensors
        host = torch.empty(t.shape, dtype=t.dtype)
        self._count(received=host.numel() * host.element_size())
        return DirectWork(self, op, [self.gloo.recv([host], src, tag)], finish=lambda: _copy_back(t, host))

    def _collective(self, op: OpRecord, tensors: list[torch.Tensor], post: Callable[[list[torch.Tensor]], Any]
                    ) -> dist.Work:
        hosts = [_to_host(t) for t in tensors]
        self._count(sent=sum(h.numel() * h.element_size() for h in hosts))

        def back() -> None:
            for t, h in zip(tensors, hosts):
                _copy_back(t, h)
        return DirectWork(self, op, [post(hosts)], finish=back)

    def _do_broadcast(self, op: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._collective(op, tensors, lambda hs: self.gloo.broadcast(hs, opts))

    def _do_allreduce(self, op: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._collective(op, tensors, lambda hs: self.gloo.allreduce(hs, opts))

    def _do_all_gather_into(self, op: OpRecord, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist.Work:
        out = torch.empty(output.shape, dtype=output.dtype)
        src = _to_host(inp)
        self._count(sent=src.numel() * src.element_size())
        return DirectWork(self, op, [self.gloo._allgather_base(out, src, opts)], finish=lambda: _copy_back(output, out))

    def _do_barrier(self, op: OpRecord, opts: Any) -> dist.Work:
        return DirectWork(self, op, [self.gloo.barrier(opts)])

    def shutdown(self) -> None:  # type: ignore[override]
        super().shutdown()
        self.gloo = None


def _copy_back(t: torch.Tensor, host: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(host)


class IdealBoundaryGroup(HostCopyGroup):
    """``bimetal_ideal``: point-to-point moves a token, not the tensor (see the module docstring)."""

    backend_name = IDEAL

    def __init__(self, gloo: Any, rank: int, size: int, timeout: timedelta, global_ranks: list[int] | None = None,
                 seed: int = 0):
        super().__init__(gloo, rank, size, timeout, global_ranks)
        self.seed = seed
        self.elided_bytes = 0
        """Payload bytes the schedule handed to send that did not cross (the bytes a real link would move)."""
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def _do_send(self, op: OpRecord, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        (t,) = tensors
        if not t.is_floating_point():  # metadata the peer reads: moved for real
            return super()._do_send(op, tensors, dst, tag)
        turn = self._sent.get(dst, 0)
        self._sent[dst] = turn + 1
        token = torch.tensor([turn, t.numel(), _DTYPES.index(t.dtype)], dtype=torch.int64)
        self.counters.add(bytes_sent=TOKEN_BYTES)
        self.elided_bytes += t.numel() * t.element_size()
        return DirectWork(self, op, [self.gloo.send([token], dst, tag)])

    def _do_recv(self, op: OpRecord, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        (t,) = tensors
        if not t.is_floating_point():
            return super()._do_recv(op, tensors, src, tag)
        turn = self._received.get(src, 0)
        self._received[src] = turn + 1
        token = torch.empty(3, dtype=torch.int64)
        self.counters.add(bytes_received=TOKEN_BYTES)

        def fill() -> None:
            seq, numel, code = (int(v) for v in token.tolist())
            if (seq, numel, code) != (turn, t.numel(), _DTYPES.index(t.dtype)):
                sent = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype code {code}"
                raise TransportError(f"{op.describe()}: the schedules of the two ranks disagree: the peer's "
                                     f"message #{seq} holds {numel} elements of {sent}, this rank's receive #{turn} "
                                     f"expects {t.numel()} of {t.dtype}")
            self._fill(t)
        return DirectWork(self, op, [self.gloo.recv([token], src, tag)], finish=fill)

    def _fill(self, t: torch.Tensor) -> None:
        """The receiver's stand-in for the data: N(0, 1) from a generator of this rank on ``t``'s device (enqueued
        on the caller's current stream, so whatever reads ``t`` next is ordered after it)."""
        with torch.no_grad():
            gen = self._generators.get(t.device)
            if gen is None:
                gen = self._generators[t.device] = torch.Generator(device=t.device).manual_seed(
                    self.seed * 1_000_003 + self._rank)
            t.normal_(generator=gen)


def create_host_copy(dist_backend_opts: Any, pg_options: Any) -> HostCopyGroup:
    """Creator of ``bimetal_host_copy`` (torch's extended API): one Gloo context on the default interface."""
    return _create(HostCopyGroup, dist_backend_opts)


def create_ideal(dist_backend_opts: Any, pg_options: Any) -> IdealBoundaryGroup:
    """Creator of ``bimetal_ideal``; ``pg_options`` may be ``{"seed": N}`` (the fill pattern's seed)."""
    pg = _create(IdealBoundaryGroup, dist_backend_opts)
    if isinstance(pg_options, dict):
        pg.seed = int(pg_options.get("seed", 0))
    return pg


def _create(cls: Any, opts: Any) -> Any:
    from bimetal.comm.striping import build_stripes

    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    (gloo,) = build_stripes(opts.store, opts.group_rank, opts.group_size, timeout, [None])
    pg = cls(gloo, opts.group_rank, opts.group_size, timeout, list(opts.global_ranks_in_group) or None)
    pg.store = dist.PrefixStore("bimetal_ref", opts.store)
    return pg
