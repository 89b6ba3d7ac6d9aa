"""cpu-forward transport: device -> pinned host -> Gloo (striped over NICs) -> host -> device.

Registered as ``bimetal_cpu_forward`` (``bimetal.comm.registry``). Options: pass a
``CpuForwardOptions`` as ``pg_options`` to ``dist.new_group``, or set the environment variables
``BIMETAL_CF_STRIPES`` (Gloo contexts per group), ``BIMETAL_CF_IFACES`` (comma-separated interface per
stripe), ``BIMETAL_CF_CHUNK_BYTES`` (pipelining chunk, default 4M; sizes like 64K), ``BIMETAL_CF_POOL_BUFFERS``
(pinned staging slabs of the largest chunk, default 8),
``BIMETAL_CF_FORCE_STAGING=1`` (stage CPU tensors too), ``BIMETAL_CF_CHECKSUM=1`` (CRC32 on point-to-point
messages; a mismatch fails the receive instead of training on corrupted data) and ``BIMETAL_CF_STALL_S``
(seconds without progress before one stripe of a point-to-point transfer is left and its chunks re-sent on
the others; default min(10, timeout / 3); see ``failover``). All of them are read in one place,
``CpuForwardOptions.resolved`` (``bimetal.comm.striping``), except ``BIMETAL_CF_FORCE_STAGING`` (``staging``).
The group itself is ``pg.CpuForwardProcessGroup``; its module docstring maps the package.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup, StagedNativeGroup
from bimetal.comm.striping import CpuForwardOptions, build_stripes
from bimetal.topology.exchange import host_identity
from bimetal.topology.interfaces import candidate_nics, named_nics
from bimetal.topology.reach import choose_and_confirm

__all__ = ["CpuForwardOptions", "CpuForwardProcessGroup", "StagedNativeGroup", "create_process_group"]


def create_process_group(dist_backend_opts: Any, pg_options: Any) -> CpuForwardProcessGroup:
    """The creator torch calls (extended API) for every group on ``bimetal_cpu_forward``.

    Before any Gloo context connects, the members agree on their interfaces and prove they reach each other on
    them (``bimetal.topology.reach``): an interface that cannot reach a peer is one sentence within seconds.
    """
    opts = _options(pg_options).resolved()
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    store = dist_backend_opts.store
    if opts.interfaces:  # the stripes' interfaces as named (BIMETAL_CF_IFACES), checked as they are
        exact = list(opts.interfaces)
        chosen = choose_and_confirm(store, rank, size, global_ranks, lambda: named_nics(exact), opts.local_rank or 0,
                                    opts.stripes, REACH_PREFIX, f"cpu-forward group of ranks {global_ranks}", timeout,
                                    exact=True)
    else:
        chosen = choose_and_confirm(store, rank, size, global_ranks,
                                    lambda: candidate_nics(opts.allowed_interfaces, host_identity()),
                                    opts.local_rank or 0, opts.stripes, REACH_PREFIX,
                                    f"cpu-forward group of ranks {global_ranks}", timeout)
    interfaces: list[str | None] = [n.name for n in chosen] if chosen else [None] * opts.stripes
    stripes = build_stripes(store, rank, size, timeout, interfaces)
    pg = CpuForwardProcessGroup(stripes, rank, size, timeout, opts, global_ranks=global_ranks or None,
                                interfaces=interfaces, checksum=bool(opts.checksum))
    pg.store = dist.PrefixStore("bimetal_cf", store)
    return pg


REACH_PREFIX = "bimetal_reach/cf"


def _options(pg_options: Any) -> CpuForwardOptions:
    """``pg_options`` as cpu-forward options: its own, or (a device-direct group falling back) the interfaces a
    ``DeviceDirectOptions`` or dict of its fields allowed."""
    if isinstance(pg_options, CpuForwardOptions):
        return pg_options
    allowed = pg_options.get("allowed_interfaces") if isinstance(pg_options, dict) else \
        getattr(pg_options, "allowed_interfaces", None)
    return CpuForwardOptions(allowed_interfaces=list(allowed or []))
