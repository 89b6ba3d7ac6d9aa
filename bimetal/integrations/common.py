"""What every trainer integration shares: the world that spans vendors, and the back-end a group's vendors give it.

An integration (torchtitan, Megatron) is a hook that hands each group its trainer makes the back-end bimetal's
classification (``bimetal.parallel.groups``) gives it, plus CPU stand-ins that apply only without a GPU. Both
start from the same world and classify the same way:

* ``world_backend``: the world group must span vendors, so it is never the native library;
* ``start_world``: bind this rank's GPU, register bimetal's back-ends, create the world (unless the trainer's
  script did), learn every rank's vendor over the store and print the cluster view on rank 0;
* ``group_backend``: one vendor -> the native back-end, two -> the chosen transport (Gloo for every group in an
  all-Gloo reference run);
* ``rank_entry``: a rank's ``python -m bimetal.integrations.<trainer>``, whose refusals end in one sentence.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from bimetal.comm.registry import CPU_FORWARD, register_backends
from bimetal.errors import UserError
from bimetal.parallel.context import _init_world
from bimetal.parallel.groups import classify, native_backend
from bimetal.topology.exchange import exchange_topology
from bimetal.topology.local_device import bind_rank_device
from bimetal.topology.records import ClusterView
from bimetal.topology.vendor import detect_vendor, is_simulated


def world_backend(vendor: str) -> str:
    """A world group that can span vendors: Gloo for CPU tensors; CUDA tensors through cpu-forward."""
    if is_simulated() or vendor == "cpu":
        return "gloo"
    return f"cpu:gloo,cuda:{CPU_FORWARD}"


def start_world(all_gloo: bool, timeout: timedelta) -> ClusterView:
    """This rank's device bound, bimetal's back-ends registered, the world created (if it is not yet) and every
    rank's vendor exchanged; rank 0 prints the cluster view. Collective: every rank calls it."""
    bind_rank_device()
    register_backends()
    if not dist.is_initialized():
        vendor = detect_vendor(int(os.environ.get("RANK", "0")))
        _init_world("gloo" if all_gloo else world_backend(vendor), timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    view = exchange_topology(dist.distributed_c10d._get_default_store(), rank, world, timeout)
    if rank == 0:
        print("bimetal cluster view:\n" + view.format_table(), flush=True)
    return view


def group_backend(vendors: tuple[str, ...], cross: str, simulated: bool, all_gloo: bool = False) -> str:
    """The back-end of a group whose ranks have ``vendors``: native inside one vendor, ``cross`` (a transport's
    torch back-end name) across vendors, Gloo everywhere in an all-Gloo reference run."""
    if all_gloo:
        return "gloo"
    if classify(vendors) == "cross-vendor":
        return cross
    return native_backend(vendors[0], simulated)


def rank_entry(main: Callable[[list[str]], int], label: str) -> int:
    """One rank's ``python -m bimetal.integrations.<trainer>``: ``main`` on this process's arguments; an error the
    user can cause ends in one sentence, exit 2, said by bimetal's launcher when it started the rank (else here,
    as ``<label>: ...``)."""
    try:
        status = main(sys.argv[1:])
        gc.collect()  # join Gloo's worker threads now, not in interpreter shutdown (see bimetal.entry.run_command)
        return status
    except UserError as exc:
        from bimetal.supervisor import report_outcome

        if not report_outcome(2, str(exc)):  # a rank of bimetal's launcher leaves the sentence to it
            print(f"{label}: {exc}", file=sys.stderr, flush=True)
        return 2
