"""``bimetal_per_hop``: one pipeline group whose sends and receives each go over the group of their pair of ranks.

torch's pipelining and torchtitan's schedules hand every transfer of a pipeline to ONE group (``P2POp`` with the
pp group). When that group spans vendors, a single back-end would carry every hop: with pp=4 over two islands
the hops inside a vendor would also go through host memory and TCP. ``PerHopGroup`` is that one group, and it
routes:

* **send / recv**: to the group of the pair (this rank, peer). The pairs and their groups are given when the
  group is made (``PerHopOptions``): a native (vendor library) group inside a vendor, the chosen bimetal
  transport across. A native pair is TWO groups, one per direction (``Route.send``/``Route.recv``): NCCL runs
  the sends and receives of one communicator on one stream, so a send to the next stage and a receive from it
  issued one after the other (1F1B's mixed batches; torch coalesces them only for a plain ``ProcessGroup``)
  would wait on each other; one communicator per direction keeps each stream's order the same on both ends.
  A bimetal transport's point-to-point is asynchronous in both directions on one group.
* **every collective** (the loss broadcast from the last stage, the global grad-norm all-reduce, barriers,
  gathers; a few bytes per step): to one group over all the pipeline's ranks (``PerHopOptions.collectives``),
  on a bimetal transport when the ranks span vendors. Routing them over the chain of pairs would add
  2 * (pp - 1) sequential hops per collective and a reduction order of its own; the whole-group transport
  reduces as Gloo does, so a run's numbers match an all-Gloo run bit for bit.

A transfer to a rank that is not one of this rank's pairs is refused in one sentence naming the group and the
pairs it has: a pipeline talks to its neighbouring stages only.

The byte counters of the cross-vendor pairs are this group's cross-vendor traffic (``cross_vendor_counters``);
the native pairs have none (they are not bimetal transports) and the collectives group keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.named import NamedGroup
from bimetal.transports import PER_HOP


class NoRouteError(RuntimeError):
    """A send or receive to a rank this pipeline group has no pair with."""


@dataclass(frozen=True)
class Route:
    """How this rank talks to one peer: the group its sends go over and the one its receives come from."""

    peer: int
    """The peer's global rank."""
    send: dist.ProcessGroup
    recv: dist.ProcessGroup
    send_peer: int
    """The peer's rank inside ``send``."""
    recv_peer: int
    """The peer's rank inside ``recv``."""
    name: str
    """The pair's group name (``pp.dp0.hop1-2``), for errors and the report."""
    backend: str
    cross_vendor: bool


@dataclass
class PerHopOptions:
    """What ``dist.new_group(backend=PER_HOP, pg_options=...)`` needs: this rank's routes and the collectives group."""

    routes: dict[int, Route]
    """Peer global rank -> its route (this rank's pairs only)."""
    collectives: dist.ProcessGroup
    """A group over all the pipeline's ranks, in the same order, for every collective."""
    collectives_name: str = ""
    parts: list[str] = field(default_factory=list)
    """Names of every pair of the pipeline (this rank's or not), for the error of a missing route."""


_COLLECTIVES = (
    "broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "allgather_coalesced",
    "all_gather_single", "_allgather_base", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "monitored_barrier",
)
"""Every collective torch hands a Python ProcessGroup (``bimetal.comm.base`` lists the same), all delegated."""


class PerHopGroup(NamedGroup):
    """The pipeline's one group: point-to-point by peer over the pair's group, collectives over ``collectives``."""

    backend_name = PER_HOP

    def __init__(self, rank: int, size: int, global_ranks: list[int], options: PerHopOptions,
                 timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.global_ranks = list(global_ranks)
        self.routes = dict(options.routes)
        self.collectives = options.collectives
        self.collectives_name = options.collectives_name
        self.parts = list(options.parts)
        self.timeout = timeout

    # --- point-to-point: by peer ----------------------------------------------------------------------------
    def route(self, group_peer: int) -> Route:
        """The route to the peer at ``group_peer`` (its rank in this group)."""
        peer = self.global_ranks[group_peer]
        found = self.routes.get(peer)
        if found is None:
            me = self.global_ranks[self._rank]
            raise NoRouteError(
                f"pipeline group {self._desc or self._name!r}: rank {me} has no pair with rank {peer} (pairs: "
                f"{', '.join(self.parts) or 'none'}); a pipeline sends only between neighbouring stages")
        return found

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        r = self.route(dstRank)
        return r.send.send(tensors, r.send_peer, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        r = self.route(srcRank)
        return r.recv.recv(tensors, r.recv_peer, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:  # type: ignore[override]
        raise NoRouteError(f"pipeline group {self._desc or self._name!r}: recv_anysource cannot be routed to a "
                           "pair; receive from a named source")

    # --- counters -------------------------------------------------------------------------------------------
    def cross_vendor_counters(self) -> list[Any] | None:
        """The byte counters of this rank's cross-vendor pairs (each group once; [] when it has none), or None
        when one of them keeps no counters (stock Gloo across vendors)."""
        seen: dict[int, Any] = {}
        for r in self.routes.values():
            if not r.cross_vendor:
                continue
            for g in (r.send, r.recv):
                counters = getattr(g, "counters", None)
                if counters is None:
                    return None
                seen.setdefault(id(g), counters)
        return list(seen.values())

    def transport_groups(self) -> list[Any]:
        """This rank's groups that are bimetal transports (cross-vendor pairs, the collectives group)."""
        out: dict[int, Any] = {}
        for g in [*(x for r in self.routes.values() for x in (r.send, r.recv)), self.collectives]:
            if hasattr(g, "comm_stats"):
                out.setdefault(id(g), g)
        return list(out.values())

    def comm_stats(self) -> dict[str, int]:
        """The transport counters of ``transport_groups``, summed key by key (``bimetal.comm.meter``)."""
        total: dict[str, int] = {}
        for g in self.transport_groups():
            for key, value in g.comm_stats().items():
                total[key] = total.get(key, 0) + int(value)
        return total

    def shutdown(self) -> None:  # type: ignore[override]
        # The pair groups and the collectives group are groups of their own, destroyed with the others.
        pass

    def __repr__(self) -> str:
        return f"PerHopGroup({self._desc or self._name!r}, rank {self._rank} of {self._size})"


def _delegate(op: str) -> Any:
    def method(self: PerHopGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.collectives, op)(*args, **kwargs)

    method.__name__ = op
    method.__doc__ = f"``{op}`` over the collectives group (all the pipeline's ranks)."
    return method


for _op in _COLLECTIVES:
    setattr(PerHopGroup, _op, _delegate(_op))


def create_process_group(dist_backend_opts: Any, pg_options: Any) -> PerHopGroup:
    """The creator torch calls for a group on ``bimetal_per_hop`` (``pg_options``: this rank's ``PerHopOptions``)."""
    if not isinstance(pg_options, PerHopOptions):
        raise TypeError("a bimetal_per_hop group is built by bimetal.parallel.pipeline_groups with its routes "
                        "as pg_options (PerHopOptions); it cannot be created on its own")
    timeout = dist_backend_opts.timeout
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    size = dist_backend_opts.group_size
    ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    return PerHopGroup(dist_backend_opts.group_rank, size, ranks, pg_options, timeout)
