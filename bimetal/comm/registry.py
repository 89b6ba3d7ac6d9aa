"""Registration of bimetal's torch.distributed back-ends.

* ``bimetal_cpu_forward``: cross-vendor transport through pinned host memory and Gloo (comm/cpu_forward).
* ``bimetal_device_direct``: cross-vendor transport through an RDMA transfer engine (comm/device_direct).
* ``bimetal_sim_native``: the native back-end under simulation. It is Gloo, but like NCCL/RCCL it refuses a
  group whose ranks run different (simulated) vendors, and like them it takes the NIC of its GPU: on a node
  with several NICs (a lab node), local rank i's traffic goes over NIC i, so a homogeneous baseline is not
  held to one NIC while the transports under test use them all. With ``BIMETAL_SIMULATE_DEVICE=cuda`` (simulated
  vendors sharing one GPU) it is cpu-forward's staged path on that same NIC (``StagedNativeGroup``), so that
  FSDP, tensor parallelism and the hierarchical all-reduce run on device tensors, which Gloo refuses;
* ``bimetal_per_hop``: a pipeline group that sends and receives over the group of each pair of ranks
  (``bimetal.comm.per_hop``; made by ``bimetal.parallel.pipeline_groups`` with its routes as ``pg_options``);
* ``bimetal_host_copy`` and ``bimetal_ideal``: the reference boundaries of ``bimetal bench gpu-ladder``
  (``bimetal.comm.reference``): copy to host + stock Gloo, and a link that keeps the schedule but moves no bytes.

Creators import their transport lazily, so ``import bimetal`` stays cheap and a transport that is not
built (or whose library is missing) fails when a group asks for it, with a message that says so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal import env
from bimetal.errors import UserError
from bimetal.topology import store_exchange
from bimetal.transports import CPU_FORWARD, DEVICE_DIRECT, HOST_COPY, IDEAL, PER_HOP, SIM_NATIVE, TABLE

__all__ = ["CPU_FORWARD", "DEVICE_DIRECT", "HOST_COPY", "IDEAL", "PER_HOP", "SIM_NATIVE", "register_backends",
           "staged_native"]


# transport back-end name -> module with ``create_process_group(dist_backend_opts, pg_options)``
_TRANSPORT_MODULES = {t.backend: t.module for t in TABLE if t.module is not None}


class TransportUnavailableError(RuntimeError):
    """A group asked for a bimetal transport that cannot be built in this process."""


class VendorMismatchError(RuntimeError):
    """A native (vendor-library) group was asked to span ranks of different vendors."""


def _transport_creator(name: str):
    def create(dist_backend_opts: Any, pg_options: Any):
        module_name = _TRANSPORT_MODULES[name]
        try:
            module = importlib.import_module(module_name)
            factory = module.create_process_group
        except (ImportError, AttributeError) as exc:
            raise TransportUnavailableError(
                f"the {name} transport is not available in this build ({module_name}: {exc}); "
                "choose another transport for cross-vendor groups"
            ) from exc
        return factory(dist_backend_opts, pg_options)

    return create


@dataclass(frozen=True)
class VendorRecord:
    """What each member of a native group tells the others: its vendor (checked by ``bimetal.schema``)."""

    __pydantic_config__ = {"extra": "forbid"}  # bimetal.schema.SHAPE, spelt out: pydantic loads only when used

    vendor: str


def _vendor_handshake(store: dist.Store, rank: int, size: int, timeout: timedelta, vendor: str) -> list[str]:
    """Every rank of a new group learns every member's vendor (JSON over the group's store)."""
    from bimetal.schema import check  # lazily: importing pydantic costs ~0.5 s, import bimetal stays cheap

    def decode(value: Any, r: int) -> str:
        try:
            return check(VendorRecord, value, f"vendor record of group rank {r}").vendor
        except UserError:
            raise VendorMismatchError(f"malformed vendor record from group rank {r}: {value!r}") from None

    return store_exchange.exchange(store, "bimetal_vendor", rank, {"vendor": vendor}, range(size), timeout, decode)


def _create_sim_native(dist_backend_opts: Any, pg_options: Any):
    from bimetal.topology.vendor import detect_vendor

    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    vendor = detect_vendor(global_ranks[rank] if global_ranks else None)
    vendors = _vendor_handshake(store, rank, size, dist_backend_opts.timeout, vendor)
    if len(set(vendors)) > 1:
        members = ", ".join(f"{g}:{v}" for g, v in zip(global_ranks, vendors))
        raise VendorMismatchError(
            f"the native back-end cannot form a group across vendors (ranks {members}); "
            "NCCL and RCCL do not interoperate - use a bimetal transport for this group"
        )
    from bimetal.comm.striping import CpuForwardOptions, build_stripes, choose_interfaces

    timeout = dist_backend_opts.timeout
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    from bimetal.topology.local_device import local_rank

    # (not cpu-forward's env: its NIC choice is its own) the candidate of this local rank, as NCCL takes its GPU's NIC
    (nic,) = choose_interfaces(CpuForwardOptions(stripes=1, local_rank=local_rank()))
    stripes = build_stripes(store, rank, size, timeout, [nic])
    if not staged_native():
        return stripes[0]
    from bimetal.comm.cpu_forward import StagedNativeGroup

    opts = CpuForwardOptions(stripes=1, interfaces=[nic] if nic else [], local_rank=local_rank()).resolved()
    pg = StagedNativeGroup(stripes, rank, size, timeout, opts, global_ranks=global_ranks, interfaces=[nic])
    pg.store = dist.PrefixStore("bimetal_cf", store)
    return pg


def staged_native() -> bool:
    """Whether the simulated native groups run on cpu-forward's staged path: ``BIMETAL_SIMULATE_DEVICE=cuda``, the
    simulated vendors share one GPU, and Gloo takes device tensors for few ops. ``cpu-staged`` runs the same code
    on CPU tensors (staged through the pool with ``BIMETAL_CF_FORCE_STAGING=1``), where no GPU is."""
    return env.read("BIMETAL_SIMULATE_DEVICE") in ("cuda", "cpu-staged")


def _create_per_hop(dist_backend_opts: Any, pg_options: Any):
    from bimetal.comm import per_hop

    return per_hop.create_process_group(dist_backend_opts, pg_options)


def _reference_creator(name: str):
    def create(dist_backend_opts: Any, pg_options: Any):
        from bimetal.comm import reference

        return getattr(reference, name)(dist_backend_opts, pg_options)

    return create


_registered = False


def register_backends() -> None:
    """Register the bimetal back-ends with torch.distributed (idempotent)."""
    global _registered
    if _registered:
        return
    for name in _TRANSPORT_MODULES:
        dist.Backend.register_backend(name, _transport_creator(name), extended_api=True, devices=["cpu", "cuda"])
    dist.Backend.register_backend(SIM_NATIVE, _create_sim_native, extended_api=True, devices=["cpu"])
    dist.Backend.register_backend(PER_HOP, _create_per_hop, extended_api=True, devices=["cpu", "cuda"])
    for name, creator in ((HOST_COPY, "create_host_copy"), (IDEAL, "create_ideal")):
        dist.Backend.register_backend(name, _reference_creator(creator), extended_api=True, devices=["cpu", "cuda"])
    _registered = True
