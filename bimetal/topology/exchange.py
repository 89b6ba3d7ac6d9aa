"""Topology exchange: every rank publishes its ``RankRecord`` as JSON through the c10d store and
builds the same validated ``ClusterView`` from all of them.

Every rank validates every record in rank order, so a bad record stops the job on all ranks with the
same sentence naming the rank and the field.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from bimetal import env
from bimetal.errors import UserError
from bimetal.topology import local_device, pci, store_exchange, versions
from bimetal.topology.interfaces import candidate_nics, named_interfaces
from bimetal.topology.records import ClusterView, RankRecord, TopologyError
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


def local_record(rank: int, local_rank: int | None = None, interfaces: Sequence[str] | None = None) -> RankRecord:
    """This rank's record: vendor, device (``local_device.rank_device``) and memory from the runtime (or the
    simulation), candidate interfaces (``interfaces``: the config's list, else ``BIMETAL_IFACES``, else the
    default) with its order of preference and its RDMA device (``pci``: its GPU's NICs first), and software
    versions."""
    if local_rank is None:
        local_rank = local_device.local_rank()
    vendor = detect_vendor(rank)
    host = host_identity()
    mine = versions.local_versions(rank)
    device, memory, index = "cpu", 0, -1
    gpu = local_device.rank_device()
    if gpu.type == "cuda":
        props = torch.cuda.get_device_properties(gpu)
        index, device, memory = gpu.index or 0, props.name, int(props.total_memory)
    if is_simulated():
        device = f"{device} (shared, simulated {vendor})" if gpu.type == "cuda" else f"cpu (simulated {vendor})"
    nics = candidate_nics(interfaces, host)
    return RankRecord(
        rank=rank,
        local_rank=local_rank,
        host=host,
        vendor=vendor,
        device=device,
        memory_bytes=memory,
        nics=tuple(nics),
        device_index=index,
        torch=mine["torch"],
        bimetal=mine["bimetal"],
        engine=mine["engine"],
        named=tuple(named_interfaces(interfaces)[0]),
        gpu_pci=pci.rank_gpu() or "",
        nic_order=tuple(pci.rank_order([n.name for n in nics], local_rank)),
        rdma=rdma_choice(local_rank),
    )


def rdma_choice(local_rank: int) -> tuple[str, ...]:
    """The RDMA device device-direct's engine opens on this rank and why: the devices ``BIMETAL_DD_DEVICES``
    names, else the one paired with the rank's GPU (``pci.rank_rdma``), else none (the engine opens every one)."""
    named = env.read("BIMETAL_DD_DEVICES")
    if named:
        return (named, "explicit BIMETAL_DD_DEVICES")
    return pci.rank_rdma(local_rank) or ()


def exchange_topology(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(seconds=120),
    record: RankRecord | None = None,
    prefix: str = KEY_PREFIX,
    interfaces: Sequence[str] | None = None,
) -> ClusterView:
    """Publish this rank's record, read everyone's, and return the validated view (same on every rank).
    ``interfaces``: the config's list of interfaces (``parallel.interfaces``), if any."""
    if record is None:
        try:
            record = local_record(rank, interfaces=interfaces)
        except UserError as exc:  # the others hear why instead of waiting for this record until the timeout
            store_exchange.publish(store, prefix, rank, {"error": str(exc)})
            raise

    def missing(r: int, exc: BaseException) -> TopologyError:
        return TopologyError(f"rank {r} did not publish its topology record within {timeout.total_seconds():.0f} s; "
                             "check that every rank started and reaches the same store")

    def not_json(r: int, exc: BaseException) -> TopologyError:
        return TopologyError(f"topology record of rank {r} is not valid JSON ({exc})")

    payload = json.loads(record.to_json())
    def decode(value: object, r: int) -> RankRecord:
        if isinstance(value, dict) and set(value) == {"error"}:
            raise TopologyError(f"rank {r} could not describe itself: {value['error']}")
        return RankRecord.from_dict(value, expected_rank=r)

    records = store_exchange.exchange(store, prefix, rank, payload, range(world_size), timeout, decode, missing,
                                      not_json)
    return ClusterView(records)
