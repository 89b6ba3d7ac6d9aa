"""The state of one cpu-forward group, as the op modules (``p2p``, ``pipeline``, ``collectives``) take it.

``CpuForwardProcessGroup`` (``pg``) builds one ``GroupState`` and hands it to every op; the op modules import
this module, never the group's, so the parts of the transport import each other in one direction only. A plain
object also reads faster than the group: each attribute of a torch ``ProcessGroup`` subclass goes through pybind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from bimetal.comm.base import CommCounters, OpRecord
from bimetal.comm.cpu_forward.failover import Failover
from bimetal.comm.cpu_forward.links import StripeSet
from bimetal.comm.cpu_forward.staging import CopyStreams, PinnedPool, force_staging, is_device
from bimetal.comm.cpu_forward.stats import StripeStats
from bimetal.comm.cpu_forward.work import Workers
from bimetal.comm.striping import SINGLE_BYTES, CpuForwardOptions, chunk_plan
from bimetal.topology.local_device import rank_device


@dataclass(eq=False)
class GroupState:
    """One group's stripes, staging pool, streams, workers and failover, and the rules its ops share.

    Build it with ``GroupState.create``; ``name`` and ``desync_report`` are the group's own (its description can be set
    after creation; the desync report needs its store)."""

    rank: int
    size: int
    stripes: list[Any]
    """The Gloo contexts, one per interface (Any: torch's stubs for ProcessGroupGloo lack most ops); fault
    injection (``faults``) replaces items of this very list, which ``links`` holds too."""
    interfaces: list[str | None]
    options: CpuForwardOptions
    checksum: bool
    """CRC32 on point-to-point host messages (``BIMETAL_CF_CHECKSUM=1``): a mismatch fails the receive."""
    timeout: timedelta
    global_ranks: list[int]
    counters: CommCounters
    name: Callable[[], str]
    desync_report: Callable[[OpRecord, float | None], str]
    """The group's ``diagnose``: after a timeout, where the other ranks are."""
    device: torch.device
    """This rank's device as the launcher assigned it (``local_device``): the GPU the pool pins for."""
    pool: PinnedPool
    """Pinned staging: ``pool_buffers`` slabs of the largest chunk, a bound in bytes (``staging``)."""
    stage_all: bool
    """``BIMETAL_CF_FORCE_STAGING=1``: CPU tensors take the staged paths too (tests, ``gpu_check --cpu``)."""
    streams: CopyStreams
    workers: Workers
    links: StripeSet
    """Which stripes still work; with K > 1, point-to-point transfers fail over (``failover``)."""
    stats: StripeStats
    failover: Failover
    timeout_s: float
    turns: dict[tuple[str, int], int] = field(default_factory=dict)

    @classmethod
    def create(cls, stripes: list[Any], rank: int, size: int, timeout: timedelta, options: CpuForwardOptions,
               global_ranks: list[int], interfaces: list[str | None], checksum: bool, counters: CommCounters,
               name: Callable[[], str], diagnose: Callable[[OpRecord, float | None], str]) -> GroupState:
        slab = max(options.chunk_bytes, SINGLE_BYTES if len(stripes) > 1 else 0)
        # a failover transfer keeps one chunk per stripe in flight: a send and a receive at once need 2K + more
        slabs = max(options.pool_buffers, 4 * len(stripes) if len(stripes) > 1 else 0)
        device = rank_device()
        links = StripeSet(stripes, interfaces)
        stats = StripeStats(len(stripes))
        return cls(rank=rank, size=size, stripes=stripes, interfaces=interfaces, options=options, checksum=checksum,
                   timeout=timeout, global_ranks=global_ranks, counters=counters, name=name, desync_report=diagnose,
                   device=device, pool=PinnedPool(slabs * slab, slab, device=device), stage_all=force_staging(),
                   streams=CopyStreams(), workers=Workers(name, timeout, diagnose), links=links, stats=stats,
                   failover=Failover(links, name, global_ranks, options.chunk_bytes, options.stall_seconds(timeout),
                                     stats),
                   timeout_s=timeout.total_seconds())

    @property
    def description(self) -> str:
        """The group's name as errors show it (``BimetalProcessGroup.description``)."""
        return self.name()

    def diagnose(self, op: OpRecord, wait_s: float | None = None) -> str:
        return self.desync_report(op, wait_s)

    def stages(self, *tensors: torch.Tensor) -> bool:
        """Whether the op goes through the pinned pool: a device tensor, or staging forced for CPU ones."""
        return self.stage_all or any(is_device(t) for t in tensors)

    def turn(self, direction: str, peer: int) -> int:
        """The k-th send to a peer pairs with its k-th receive from us: both sides count (and rotate) the same way."""
        key = (direction, peer)
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        return turn

    def plan(self, numel: int, esize: int, first: int) -> list[tuple[int, int, int]]:
        return chunk_plan(numel, esize, self.options.chunk_bytes, len(self.stripes), first)

    def depth(self) -> int:
        """Chunks one staged transfer keeps in flight (and as many copying): a quarter of the pool, so that a send
        and a receive in flight at once never wait on each other for slabs."""
        return max(1, self.pool.capacity // 4)

    def pool_numel(self, t: torch.Tensor) -> int:
        """Elements of a staging buffer for ``t``'s dtype: one size per dtype (the largest chunk any plan makes),
        so the pool's buffers serve every message size and it stops allocating after warm-up."""
        most = max(self.options.chunk_bytes, SINGLE_BYTES if len(self.stripes) > 1 else 0)
        return max(1, most // t.element_size())

    def stripe(self, i: int) -> Any:
        """Stripe ``i`` for a collective; collectives do not fail over, so a degraded stripe is an error."""
        if self.links.is_dead(i):
            raise RuntimeError(f"stripe {i} (interface {self.interfaces[i] or 'default'}) of this group is degraded "
                               f"after a link fault ({self.links.dead.get(i)}); collectives do not fail over, only "
                               "point-to-point transfers do")
        return self.stripes[i]
