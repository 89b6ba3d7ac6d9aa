"""What every bimetal transport shares: a Python ``torch.distributed.ProcessGroup`` with names, async
``Work`` on futures, per-group sequence numbers, clear errors and byte counters.

torch 2.13 hands every collective of a group registered with ``extended_api=True`` to the Python object
the creator returns (see DESIGN.md). ``BimetalProcessGroup`` declares every operation torch routes there
(``distributed_c10d`` calls and the C++ trampoline's overrides) as a template method: each public op goes
through ``_run`` (open check, sequence number, op counter, dtype check, then ``Work`` from the future or
work the transport returns), and a transport supplies only the data movement, ``_do_<op>``. An op whose
``_do_`` a transport lacks raises ``UnsupportedOperation`` naming the op, the transport and the transports
that do it. A failure becomes a ``TransportError`` / ``TransportTimeout`` whose message names the group
description, the operation, the peer and the sequence number.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
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

from bimetal import transports
from bimetal.comm.named import NamedGroup
from bimetal.comm.work import (
    SUPPORTED_DTYPES,
    BimetalWork,
    CommCounters,
    OpRecord,
    TransportError,
    TransportTimeout,
    UnsupportedOperation,
    check_dtype,
    completed_work,
    make_work,
)
from bimetal.topology import store_exchange

__all__ = ["SUPPORTED_DTYPES", "BimetalProcessGroup", "BimetalWork", "CommCounters", "OpRecord", "TransportError",
           "TransportTimeout", "UnsupportedOperation", "check_dtype", "completed_work", "make_work"]

_TRANSPORTS: list[type[BimetalProcessGroup]] = []
"""Every transport class (``__init_subclass__``), for the "who does it" part of ``not_implemented``."""
_HINTS = {"monitored_barrier": " (Gloo does): use barrier, it has the group's timeout",
          "recv_anysource": " (Gloo does): receive from a named source"}


def _flat(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for lst in lists for t in lst]


class BimetalProcessGroup(NamedGroup):
    """Base of the bimetal transports: every torch op as a template method over the subclass's ``_do_<op>``."""

    backend_name = "bimetal"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TRANSPORTS.append(cls)

    def __init__(self, rank: int, size: int, timeout: timedelta, global_ranks: list[int] | None = None):
        super().__init__(rank, size)
        self.timeout = timeout
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self.counters = CommCounters()
        self._closed = False
        self.store: dist.Store | None = None
        """The group's store, for the desync report after a timeout (set by the creator)."""

    # --- the operations: one path each, the transport supplies ``_do_<op>(op, ...)`` ------------------------
    def _run(self, name: str, do: str, tensors: Sequence[torch.Tensor], *args: Any, peer: int | None = None
             ) -> dist.Work:
        """The template method: refuse what the transport lacks, begin (sequence number, counter), check every
        tensor's dtype, move the data (``do``), and give torch a ``Work`` (``do`` returns one or a future)."""
        move = getattr(self, do, None)
        if move is None:
            raise self.not_implemented(name, do)
        op = self._begin(name, peer)
        for t in tensors:
            check_dtype(op, t)
        done = move(op, *args)
        return done if isinstance(done, dist.Work) else make_work(done)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        return self._run("send", "_do_send", tensors, tensors, dstRank, tag, peer=dstRank)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        return self._run("recv", "_do_recv", tensors, tensors, srcRank, tag, peer=srcRank)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:  # type: ignore[override]
        return self._run("recv_anysource", "_do_recv_anysource", tensors, tensors, tag)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("broadcast", "_do_broadcast", tensors, tensors, opts or BroadcastOptions())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("all_reduce", "_do_allreduce", tensors, tensors, opts or AllreduceOptions())

    allreduce_coalesced = allreduce  # type: ignore[assignment]  # (the same op on a list, options with reduceOp)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("reduce", "_do_reduce", tensors, tensors, opts or ReduceOptions())

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> dist.Work:
        return self._run("all_gather", "_do_allgather", [*inputs, *_flat(output_lists)], output_lists, inputs,
                         opts or AllgatherOptions())

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],  # type: ignore[override]
                            inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("all_gather_coalesced", "_do_allgather_coalesced", [*inputs, *_flat(output_lists)],
                         output_lists, inputs, opts or AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                          opts: Any = None) -> dist.Work:
        return self._run("all_gather_into_tensor", "_do_all_gather_into", [input, output], output, input,
                         opts or AllgatherOptions())

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],  # type: ignore[override]
                                        inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("all_gather_into_tensor_coalesced", "_do_all_gather_into_coalesced", [*inputs, *outputs],
                         outputs, inputs, opts or AllgatherOptions())

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> dist.Work:
        return self._run("gather", "_do_gather", [*inputs, *_flat(output_lists)], output_lists, inputs,
                         opts or GatherOptions())

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> dist.Work:
        return self._run("scatter", "_do_scatter", [*_flat(input_lists), *outputs], outputs, input_lists,
                         opts or ScatterOptions())

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter", "_do_reduce_scatter", [*_flat(input_lists), *outputs], outputs,
                         input_lists, opts or ReduceScatterOptions())

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                              opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter_tensor", "_do_reduce_scatter_into", [input, output], output, input,
                         opts or ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],  # type: ignore[override]
                                        inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter_tensor_coalesced", "_do_reduce_scatter_into_coalesced",
                         [*inputs, *outputs], outputs, inputs, opts or ReduceScatterOptions())

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                 opts: Any = None) -> dist.Work:
        return self._run("all_to_all", "_do_alltoall", [*inputs, *outputs], outputs, inputs,
                         opts or AllToAllOptions())

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # type: ignore[override]
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        return self._run("all_to_all_single", "_do_alltoall_single", [input, output], output, input,
                         list(output_split_sizes), list(input_split_sizes), opts or AllToAllOptions())

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("barrier", "_do_barrier", [], opts or BarrierOptions())

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> dist.Work:  # type: ignore[override]
        return self._run("monitored_barrier", "_do_monitored_barrier", [], opts, wait_all_ranks)

    def not_implemented(self, name: str, do: str) -> UnsupportedOperation:
        """The error for an op this transport has no ``do`` for: the op, the transport, who does it."""
        # (error path only: list every transport, loaded or not)
        for package in (t.module for t in transports.TABLE if t.module is not None):
            with contextlib.suppress(ImportError):
                importlib.import_module(package)
        choosable = {t.backend for t in transports.TABLE}  # (not the native or reference groups built on them)
        who = sorted({c.backend_name for c in _TRANSPORTS if getattr(c, do, None) is not None
                      and c.backend_name in choosable} - {self.backend_name})
        alternatives = f"{' and '.join(who)} {'does' if len(who) == 1 else 'do'} it" if who else \
            "no bimetal transport does it"
        hint = _HINTS.get(name, "")
        return UnsupportedOperation(f"group {self.description!r}: {name} is not supported by {self.backend_name}; "
                                    f"{alternatives}{hint}")

    # --- helpers for subclasses ----------------------------------------------------------------------
    @property
    def description(self) -> str:
        return self._desc or self._name or self.backend_name

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    def _begin(self, op: str, peer: int | None = None) -> OpRecord:
        """Start an op: check the group is open, take the next sequence number (the count of ops so far)."""
        if self._closed:
            raise TransportError(f"group {self.description!r} {op}: the process group was shut down")
        return OpRecord(self.description, op, self.counters.begin(), None if peer is None else self.global_rank(peer))

    def diagnose(self, op: OpRecord, wait_s: float | None = None) -> str:
        """After a timeout: publish where this rank is and say where the others are (desync detection).

        Each rank that times out writes ``{"op", "seq"}`` (JSON) under its group rank; peers that are alive
        but stuck elsewhere time out too and publish theirs. Returns a sentence fragment for the error.
        """
        if self.store is None:
            return ""
        # peers time out up to the skew between ranks later; the bound is timeout + 30 s in all
        wait_s = wait_s if wait_s is not None else min(25.0, max(5.0, self.timeout.total_seconds()))
        try:
            store_exchange.publish(self.store, "bimetal_diag", self._rank, {"op": op.op, "seq": op.seq})
        except Exception:
            return ""
        peers = [r for r in range(self._size) if r != self._rank]
        seen = store_exchange.poll(self.store, "bimetal_diag", peers, timedelta(seconds=wait_s), decode=_diag_record)
        notes = []
        for r in peers:
            rec = seen[r]
            if rec is None:
                notes.append(f"rank {self.global_rank(r)} did not report (dead, or busy outside this group)")
                continue
            peer_op, peer_seq = rec
            if {peer_op, op.op} == {"send", "recv"}:  # the two ends of point-to-point traffic
                notes.append(f"rank {self.global_rank(r)} is in {peer_op} #{peer_seq}")
            elif (peer_op, peer_seq) != (op.op, op.seq):
                notes.append(f"desync: rank {self.global_rank(r)} is in {peer_op} #{peer_seq}")
            else:
                notes.append(f"rank {self.global_rank(r)} is in the same {peer_op} #{peer_seq}")
        return "; ".join(notes)

    def unsupported(self, op: str, what: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"group {self.description!r}: {op} with {what} is not supported by "
                                    f"{self.backend_name}")

    def shutdown(self) -> None:  # type: ignore[override]
        self._closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r}, rank {self._rank} of {self._size})"


def _diag_record(value: Any, rank: int) -> tuple[str, int]:
    """A peer's ``{"op", "seq"}`` diagnostic record; anything else is refused (``poll`` reads it as no report)."""
    op, seq = value["op"], value["seq"]
    if not isinstance(op, str) or not isinstance(seq, int):
        raise ValueError(f"rank {rank}: bad diagnostic record {value!r}")
    return op, seq
