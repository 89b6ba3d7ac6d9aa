"""The ``bimetal_device_direct`` back-end creator (what ``torch.distributed.Backend.register_backend`` calls).

Every rank of the group tries to start its engine and publishes the outcome; if any rank failed, all ranks
take the same decision, by the fallback policy (``fallback`` option or ``BIMETAL_DD_FALLBACK``): ``error``
raises one sentence naming the rank, the missing piece and the fix; ``cpu-forward`` warns and builds a
cpu-forward group instead. The path never changes silently.

Before the engine starts, the ranks exchange their hosts, so each knows whether its group has peers on other
nodes (which decides the engine's environment, ``engine_env.py``: the ROCm build's HIP transport off).

The start-up probe (``probe.py``: one engine write between every pair, with a deadline) follows the same policy:
the ranks agree on its outcome, so a pair whose fabrics do not meet is, on every rank, either the one sentence
naming both ranks, their hosts and fabrics (``error``) or a cpu-forward group that carries that sentence as its
``fallback_reason`` (``cpu-forward``), as an engine that cannot start is. So does memory the engine refuses to
register while the group is set up (``GroupStartError``, agreed by every rank through its published record).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal.comm.device_direct.engine import (
    Engine,
    EngineUnavailableError,
    GroupStartError,
    choose_protocol,
    open_engine,
)
from bimetal.comm.device_direct.options import DeviceDirectSettings, options_from
from bimetal.comm.device_direct.pg import DeviceDirectProcessGroup
from bimetal.topology import local_device, store_exchange, versions
from bimetal.topology.exchange import host_identity
from bimetal.topology.interfaces import NicInfo, by_name, candidate_nics
from bimetal.topology.pci import paired_rdma
from bimetal.topology.reach import choose_and_confirm

log = logging.getLogger(__name__)


def create_process_group(dist_backend_opts: Any, pg_options: Any) -> dist.ProcessGroup:
    """The ``bimetal_device_direct`` creator (torch extended_api); see the module docstring for the policy."""
    store, rank = dist_backend_opts.store, dist_backend_opts.group_rank
    size, timeout = dist_backend_opts.group_size, dist_backend_opts.timeout
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    opts = options_from(pg_options)
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    store.set_timeout(timeout)
    opts = _choose_host(store, rank, size, global_ranks, opts, timeout)
    hosts: list[str] = store_exchange.exchange(store, "bimetal_dd_hosts", rank, host_identity(), range(size))
    engine: Engine | None = None
    reason = ""
    try:
        protocol = choose_protocol(None if opts.protocol == "auto" else opts.protocol, opts.devices)
        # devices named win; else the one paired with this rank's GPU by the PCI topology (pci.rank_rdma)
        devices = opts.devices or paired_rdma(local_device.local_rank())
        engine = open_engine(opts.host, protocol, opts.engine, devices, opts.gid_index,
                             remote_peers=any(h != hosts[rank] for h in hosts))
    except EngineUnavailableError as exc:
        reason = str(exc)
    # agreement round: every rank says whether its engine started before anyone builds the group
    answers: list[str] = store_exchange.exchange(store, "bimetal_dd_start", rank,
                                                 "ok" if engine is not None else reason or "failed", range(size))
    failed = [(p, answer) for p, answer in enumerate(answers) if answer != "ok"]
    if not failed:
        assert engine is not None
        _same_engine_release(store, rank, size, global_ranks, engine)
        try:
            return DeviceDirectProcessGroup(store, rank, size, timeout, global_ranks, engine, opts,
                                            opts.torch_device())
        except GroupStartError as exc:  # every rank has the same sentence (the group closed its engine)
            if opts.fallback == "error":
                raise type(exc)(f"{exc} (or set BIMETAL_DD_FALLBACK=cpu-forward to use cpu-forward "
                                "instead)") from None
            return _fall_back(dist_backend_opts, pg_options, str(exc))
    if engine is not None:
        engine.close()
    p, why = failed[0]
    where = f"on global rank {global_ranks[p]}" if p != rank else "on this rank"
    if opts.fallback == "error":
        raise EngineUnavailableError(f"the device-direct engine could not start {where}: {why} "
                                     "(or set BIMETAL_DD_FALLBACK=cpu-forward to use cpu-forward instead)")
    return _fall_back(dist_backend_opts, pg_options, f"device-direct engine could not start {where} ({why})")


def _choose_host(store: dist.Store, rank: int, size: int, global_ranks: list[int], opts: DeviceDirectSettings,
                 timeout: timedelta) -> DeviceDirectSettings:
    """The host address the engine and control channel bind to: the one named (``BIMETAL_DD_HOST``), else this
    rank's interface among those the members agree on; either way proven to reach every member
    (``bimetal.topology.reach``), so an address a peer cannot reach is one sentence, not a hang."""
    what = f"device-direct group of ranks {global_ranks}"
    if opts.host_named:
        named = by_name(opts.host) or NicInfo("(address)", opts.host)
        choose_and_confirm(store, rank, size, global_ranks, lambda: [named], 0, 1, REACH_PREFIX, what, timeout,
                           exact=True)
        return opts
    chosen = choose_and_confirm(store, rank, size, global_ranks,
                                lambda: candidate_nics(list(opts.allowed_interfaces), host_identity()),
                                local_device.local_rank(), 1, REACH_PREFIX, what, timeout)
    return dataclasses.replace(opts, host=chosen[0].address if chosen else "127.0.0.1")


def _same_engine_release(store: dist.Store, rank: int, size: int, global_ranks: list[int], engine: Engine) -> None:
    """Every member runs one release of the transfer engine (its wire), else every member stops in one sentence."""
    mine = versions.local_versions(global_ranks[rank])["engine"]
    seen: list[str] = store_exchange.exchange(store, "bimetal_dd_engine_release", rank, mine, range(size))
    why = versions.engine_mismatch(global_ranks, seen)
    if why:
        engine.close()
        raise EngineUnavailableError(why)


REACH_PREFIX = "bimetal_reach/dd"


def _fall_back(dist_backend_opts: Any, pg_options: Any, what: str) -> dist.ProcessGroup:
    """A cpu-forward group in place of the device-direct one, with a warning and the reason on the group."""
    message = f"{what}; group falls back to cpu-forward as BIMETAL_DD_FALLBACK=cpu-forward asks"
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)
    try:
        cpu_forward = importlib.import_module("bimetal.comm.cpu_forward")
    except ImportError as exc:
        raise EngineUnavailableError(f"{message}, but cpu-forward is not available in this build ({exc}); "
                                     "install the device-direct engine instead") from exc
    pg = cpu_forward.create_process_group(dist_backend_opts, pg_options)
    pg.fallback_reason = message
    return pg
