"""The cpu-forward process group: every tensor crosses through host memory and Gloo over TCP.

This class holds the group's state and names its parts; the base class (``bimetal.comm.base``) runs every op's
common path and calls the ``_do_<op>`` methods, which are the functions of these modules:

* ``p2p``: point-to-point: the caller-thread fast path (one stripe, CPU tensors), the staged chunk pipeline
  (``pipeline``, device tensors) and, with K > 1 stripes, failover transfers (``failover``, ``links``,
  ``status``, over the chunk sources and sinks of ``chunks``);
* ``collectives``: every collective as Gloo ops on the stripes, staged in rounds for device tensors
  (``rounds``, ``staged_ops``);
* ``work``: the worker threads (one per direction and peer, one for collectives), the op deadline and the
  fast paths' ``DirectWork`` and ``LeanWork``.

Device tensors are staged through pinned buffers from a pool bounded in bytes (``bimetal.comm.staging``);
CPU tensors go to Gloo as they are (unless ``BIMETAL_CF_FORCE_STAGING=1``). Fault injection for tests wraps
the stripes from outside (``faults``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.base import BimetalProcessGroup
from bimetal.comm.cpu_forward import collectives, p2p
from bimetal.comm.cpu_forward.failover import Failover
from bimetal.comm.cpu_forward.links import StripeSet
from bimetal.comm.cpu_forward.stats import StripeStats
from bimetal.comm.cpu_forward.work import Workers
from bimetal.comm.staging import CopyStreams, PinnedPool, force_staging, is_device
from bimetal.comm.striping import SINGLE_BYTES, CpuForwardOptions, chunk_plan
from bimetal.topology.local_device import rank_device
from bimetal.transports import SIM_NATIVE


class CpuForwardProcessGroup(BimetalProcessGroup):
    """``bimetal_cpu_forward``: Gloo stripes + host staging, with every op torch routes to a process group
    except ``recv_anysource`` and ``monitored_barrier``."""

    backend_name = "bimetal_cpu_forward"

    def __init__(self, stripes: list[dist.ProcessGroupGloo], rank: int, size: int, timeout: timedelta,
                 options: CpuForwardOptions, global_ranks: list[int] | None = None,
                 interfaces: list[str | None] | None = None, checksum: bool = False):
        super().__init__(rank, size, timeout, global_ranks)
        self.stripes: list[Any] = list(stripes)  # Any: torch's stubs for ProcessGroupGloo lack most ops
        self.options = options
        self.interfaces = interfaces or [None] * len(stripes)
        self.checksum = checksum
        """CRC32 on point-to-point host messages (``BIMETAL_CF_CHECKSUM=1``): a mismatch fails the receive."""
        slab = max(options.chunk_bytes, SINGLE_BYTES if len(stripes) > 1 else 0)
        # a failover transfer keeps one chunk per stripe in flight: a send and a receive at once need 2K + more
        slabs = max(options.pool_buffers, 4 * len(stripes) if len(stripes) > 1 else 0)
        self.device = rank_device()
        """This rank's device as the launcher assigned it (``local_device``): the GPU the pool pins for."""
        self.pool = PinnedPool(slabs * slab, slab, device=self.device)
        """Pinned staging: ``pool_buffers`` slabs of the largest chunk, a bound in bytes (``staging``)."""
        self.stage_all = force_staging()
        """``BIMETAL_CF_FORCE_STAGING=1``: CPU tensors take the staged paths too (tests, ``gpu_check --cpu``)."""
        self.streams = CopyStreams()
        self.timeout_s = timeout.total_seconds()
        self.workers = Workers(lambda: self.description, timeout, self.diagnose)
        self._stripe_turn: dict[tuple[str, int], int] = {}
        self.links = StripeSet(self.stripes, self.interfaces)
        """Which stripes still work; with K > 1, point-to-point transfers fail over (``failover.py``)."""
        self.stats = StripeStats(len(self.stripes))
        self.failover = Failover(self.links, lambda: self.description, self.global_ranks, options.chunk_bytes,
                                 options.stall_seconds(timeout), self.stats)
        self.lean = p2p.Lean(self.stripes[0], options.chunk_bytes, self.workers, self.counters) \
            if len(self.stripes) == 1 and not checksum and not self.stage_all else None
        """The one-message fast path (``p2p.Lean``), None where it does not apply."""

    def comm_stats(self) -> dict[str, int]:
        """The base counters, the staging pool's allocations, failovers and bytes per stripe (point-to-point)."""
        out = self.counters.snapshot()
        out["pool_buffers_allocated"] = self.pool.allocations
        out["stripes_dead"] = len(self.links.dead)
        out.update(self.stats.snapshot())
        if len(self.stats.stripe_bytes) == 1:  # every point-to-point byte sent rode stripe 0
            out["bytes_stripe0"] = out["bytes_sent"]
        return out

    # --- what the parts share ------------------------------------------------------------------------------
    def stages(self, *tensors: torch.Tensor) -> bool:
        """Whether the op goes through the pinned pool: a device tensor, or staging forced for CPU ones."""
        return self.stage_all or any(is_device(t) for t in tensors)

    def turn(self, direction: str, peer: int) -> int:
        """The k-th send to a peer pairs with its k-th receive from us: both sides count (and rotate) the same way."""
        key = (direction, peer)
        turn = self._stripe_turn.get(key, 0)
        self._stripe_turn[key] = turn + 1
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

    # --- point-to-point: a message that fits one Gloo op skips the common path's generic steps ---------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        lean = self.lean
        if lean is not None and len(tensors) == 1:
            work = lean.send(self, tensors[0], dstRank, tag)
            if work is not None:
                return work
        return super().send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        lean = self.lean
        if lean is not None and len(tensors) == 1:
            work = lean.recv(self, tensors[0], srcRank, tag)
            if work is not None:
                return work
        return super().recv(tensors, srcRank, tag)

    # --- the data movement of each op (``BimetalProcessGroup`` runs the common path) ------------------------
    _do_send = p2p.send
    _do_recv = p2p.recv
    _do_allreduce = collectives.allreduce
    _do_broadcast = collectives.broadcast
    _do_reduce = collectives.reduce
    _do_allgather = collectives.allgather
    _do_allgather_coalesced = collectives.allgather_coalesced
    _do_all_gather_into = collectives.all_gather_into
    _do_all_gather_into_coalesced = collectives.all_gather_into_coalesced
    _do_gather = collectives.gather
    _do_scatter = collectives.scatter
    _do_reduce_scatter = collectives.reduce_scatter
    _do_reduce_scatter_into = collectives.reduce_scatter_into
    _do_reduce_scatter_into_coalesced = collectives.reduce_scatter_into_coalesced
    _do_alltoall = collectives.alltoall
    _do_alltoall_single = collectives.alltoall_single
    _do_barrier = collectives.barrier

    def shutdown(self) -> None:  # type: ignore[override]
        if self._closed:
            return
        super().shutdown()
        self.lean = None
        self.workers.stop()
        self.failover.stop()
        self.stripes = []


class StagedNativeGroup(CpuForwardProcessGroup):
    """The simulated native back-end (``bimetal_sim_native``) when simulated vendors share one GPU
    (``BIMETAL_SIMULATE_DEVICE=cuda``): cpu-forward's staged path, so a one-vendor group takes device tensors for
    every op, where plain Gloo refuses most of them. Built by the sim-native creator after its vendor check, on
    the NIC it chose (``bimetal.comm.registry``); it stands in for NCCL/RCCL on the one-GPU check, it is not how a
    real native group moves data."""

    backend_name = SIM_NATIVE
    native_path = "staged"
    """What the group table shows next to the back-end name."""
