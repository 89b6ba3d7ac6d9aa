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

from typing import Any

import torch.distributed as dist

from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup, StagedNativeGroup
from bimetal.comm.striping import CpuForwardOptions, build_stripes, choose_interfaces

__all__ = ["CpuForwardOptions", "CpuForwardProcessGroup", "StagedNativeGroup", "create_process_group"]


def create_process_group(dist_backend_opts: Any, pg_options: Any) -> CpuForwardProcessGroup:
    """The creator torch calls (extended API) for every group on ``bimetal_cpu_forward``."""
    opts = pg_options if isinstance(pg_options, CpuForwardOptions) else CpuForwardOptions()
    opts = opts.resolved()
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    interfaces = choose_interfaces(opts)
    stripes = build_stripes(dist_backend_opts.store, rank, size, timeout, interfaces)
    pg = CpuForwardProcessGroup(stripes, rank, size, timeout, opts,
                                global_ranks=list(dist_backend_opts.global_ranks_in_group) or None,
                                interfaces=interfaces, checksum=bool(opts.checksum))
    pg.store = dist.PrefixStore("bimetal_cf", dist_backend_opts.store)
    return pg
