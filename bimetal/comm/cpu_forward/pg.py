"""The cpu-forward process group: every tensor crosses through host memory and Gloo over TCP.

This class names the transport's parts; the group's state is one ``state.GroupState``, which every op takes. The
base class (``bimetal.comm.base``) runs every op's common path and calls the ``_do_<op>`` methods, which hand the
state to the functions of these modules:

* ``p2p``: point-to-point: the caller-thread fast path (one stripe, CPU tensors), the staged chunk pipeline
  (``pipeline``, device tensors) and, with K > 1 stripes, failover transfers (``failover``, ``links``,
  ``status``, over the chunk sources and sinks of ``chunks``);
* ``collectives``: every collective as Gloo ops on the stripes, staged in rounds for device tensors
  (``rounds``, ``staged_ops``);
* ``work``: the worker threads (one per direction and peer, one for collectives), the op deadline and the
  fast paths' ``DirectWork`` and ``LeanWork``.

Device tensors are staged through pinned buffers from a pool bounded in bytes (``staging``); CPU tensors go to
Gloo as they are (unless ``BIMETAL_CF_FORCE_STAGING=1``). Fault injection for tests wraps the stripes from
outside (``faults``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.base import BimetalProcessGroup
from bimetal.comm.cpu_forward import collectives, p2p
from bimetal.comm.cpu_forward.state import GroupState
from bimetal.comm.striping import CpuForwardOptions
from bimetal.transports import SIM_NATIVE


def _on_state(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` (a function of the group's state) as the group's ``_do_<op>`` method."""

    def method(self: CpuForwardProcessGroup, *args: Any) -> Any:
        return op(self.state, *args)

    method.__name__ = method.__qualname__ = f"_do_{op.__name__}"
    return method


class CpuForwardProcessGroup(BimetalProcessGroup):
    """``bimetal_cpu_forward``: Gloo stripes + host staging, with every op torch routes to a process group
    except ``recv_anysource`` and ``monitored_barrier``."""

    backend_name = "bimetal_cpu_forward"

    def __init__(self, stripes: list[dist.ProcessGroupGloo], rank: int, size: int, timeout: timedelta,
                 options: CpuForwardOptions, global_ranks: list[int] | None = None,
                 interfaces: list[str | None] | None = None, checksum: bool = False):
        super().__init__(rank, size, timeout, global_ranks)
        self.state = GroupState.create(list(stripes), rank, size, timeout, options, self.global_ranks,
                                       interfaces or [None] * len(stripes), checksum, self.counters,
                                       lambda: self.description, self.diagnose)
        """Everything the ops read and share (``state``): stripes, staging pool, streams, workers, failover."""
        st = self.state
        self.lean = p2p.Lean(st.stripes[0], options.chunk_bytes, st.workers, self.counters) \
            if len(st.stripes) == 1 and not checksum and not st.stage_all else None
        """The one-message fast path (``p2p.Lean``), None where it does not apply."""

    def comm_stats(self) -> dict[str, int]:
        """The base counters, the staging pool's allocations, failovers and bytes per stripe (point-to-point)."""
        out = self.counters.snapshot()
        st = self.state
        out["pool_buffers_allocated"] = st.pool.allocations
        out["stripes_dead"] = len(st.links.dead)
        out.update(st.stats.snapshot())
        if len(st.stats.stripe_bytes) == 1:  # every point-to-point byte sent rode stripe 0
            out["bytes_stripe0"] = out["bytes_sent"]
        return out

    # --- point-to-point: a message that fits one Gloo op skips the common path's generic steps ---------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        lean = self.lean
        if lean is not None and len(tensors) == 1:
            work = lean.send(self.state, tensors[0], dstRank, tag)
            if work is not None:
                return work
        return super().send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        lean = self.lean
        if lean is not None and len(tensors) == 1:
            work = lean.recv(self.state, tensors[0], srcRank, tag)
            if work is not None:
                return work
        return super().recv(tensors, srcRank, tag)

    # --- the data movement of each op (``BimetalProcessGroup`` runs the common path) ------------------------
    _do_send = _on_state(p2p.send)
    _do_recv = _on_state(p2p.recv)
    _do_allreduce = _on_state(collectives.allreduce)
    _do_broadcast = _on_state(collectives.broadcast)
    _do_reduce = _on_state(collectives.reduce)
    _do_allgather = _on_state(collectives.allgather)
    _do_allgather_coalesced = _on_state(collectives.allgather_coalesced)
    _do_all_gather_into = _on_state(collectives.all_gather_into)
    _do_all_gather_into_coalesced = _on_state(collectives.all_gather_into_coalesced)
    _do_gather = _on_state(collectives.gather)
    _do_scatter = _on_state(collectives.scatter)
    _do_reduce_scatter = _on_state(collectives.reduce_scatter)
    _do_reduce_scatter_into = _on_state(collectives.reduce_scatter_into)
    _do_reduce_scatter_into_coalesced = _on_state(collectives.reduce_scatter_into_coalesced)
    _do_alltoall = _on_state(collectives.alltoall)
    _do_alltoall_single = _on_state(collectives.alltoall_single)
    _do_barrier = _on_state(collectives.barrier)

    def shutdown(self) -> None:  # type: ignore[override]
        if self._closed:
            return
        super().shutdown()
        self.lean = None
        self.state.workers.stop()
        self.state.failover.stop()
        self.state.stripes = []


class StagedNativeGroup(CpuForwardProcessGroup):
    """The simulated native back-end (``bimetal_sim_native``) when simulated vendors share one GPU
    (``BIMETAL_SIMULATE_DEVICE=cuda``): cpu-forward's staged path, so a one-vendor group takes device tensors for
    every op, where plain Gloo refuses most of them. Built by the sim-native creator after its vendor check, on
    the NIC it chose (``bimetal.comm.registry``); it stands in for NCCL/RCCL on the one-GPU check, it is not how a
    real native group moves data."""

    backend_name = SIM_NATIVE
    native_path = "staged"
    """What the group table shows next to the back-end name."""
