"""Topology exchange: every rank publishes its ``RankRecord`` as JSON through the c10d store and
builds the same validated ``ClusterView`` from all of them.

Every rank validates every record in rank order, so a bad record stops the job on all ranks with the
same sentence naming the rank and the field.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from bimetal import env
from bimetal.topology import store_exchange
from bimetal.topology.records import ClusterView, RankRecord, TopologyError, local_nics
from bimetal.topology.vendor import detect_vendor, is_simulated

HOST_ENV = "BIMETAL_HOST"
KEY_PREFIX = "bimetal/topo/v1"


def host_identity() -> str:
    """A name shared by exactly the ranks that share a node.

    ``$BIMETAL_HOST`` wins. Otherwise the host name - plus the network namespace when this process is
    in a named namespace other than init's, because namespaces on one box are separate nodes to us (the
    lab), while ranks in one namespace share its loopback like GPUs share NVLink.
    """
    named = env.read(HOST_ENV)
    if named:
        return named
    host = socket.gethostname()
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        if mine != os.stat("/proc/1/ns/net").st_ino:
            for name in sorted(os.listdir("/run/netns")):
                if os.stat(os.path.join("/run/netns", name)).st_ino == mine:
                    return f"{host}/{name}"
            return f"{host}/netns-{mine}"
    except OSError:
        pass
    return host


def local_record(rank: int, local_rank: int | None = None) -> RankRecord:
    """This rank's record: vendor, device and memory from the runtime (or the simulation), NICs from the OS."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    vendor = detect_vendor(rank)
    device, memory = "cpu", 0
    if is_simulated():
        device = f"cpu (simulated {vendor})"
        if env.read("BIMETAL_SIMULATE_DEVICE") == "cuda" and torch.cuda.is_available():  # the one GPU, shared
            props = torch.cuda.get_device_properties(0)
            device, memory = f"{props.name} (shared, simulated {vendor})", int(props.total_memory)
    elif vendor in ("nvidia", "amd"):
        index = local_rank % max(torch.cuda.device_count(), 1)
        props = torch.cuda.get_device_properties(index)
        device, memory = props.name, int(props.total_memory)
    return RankRecord(
        rank=rank,
        local_rank=local_rank,
        host=host_identity(),
        vendor=vendor,
        device=device,
        memory_bytes=memory,
        nics=tuple(local_nics()),
    )


def exchange_topology(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(seconds=120),
    record: RankRecord | None = None,
    prefix: str = KEY_PREFIX,
) -> ClusterView:
    """Publish this rank's record, read everyone's, and return the validated view (same on every rank)."""
    record = record if record is not None else local_record(rank)

    def missing(r: int, exc: BaseException) -> TopologyError:
        return TopologyError(f"rank {r} did not publish its topology record within {timeout.total_seconds():.0f} s; "
                             "check that every rank started and reaches the same store")

    def not_json(r: int, exc: BaseException) -> TopologyError:
        return TopologyError(f"topology record of rank {r} is not valid JSON ({exc})")

    payload = json.loads(record.to_json())
    records = store_exchange.exchange(store, prefix, rank, payload, range(world_size), timeout,
                                      lambda value, r: RankRecord.from_dict(value, expected_rank=r), missing, not_json)
    return ClusterView(records)
