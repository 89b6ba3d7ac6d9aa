"""Device-direct transport: cross-vendor point-to-point through an RDMA transfer engine, CPU-offloaded control.

``create_process_group`` is what the ``bimetal_device_direct`` back-end calls. Every rank of the group tries
to start its engine and publishes the outcome; if any rank failed, all ranks take the same decision, by the
fallback policy (``fallback`` option or ``BIMETAL_DD_FALLBACK``): ``error`` raises one sentence naming the
rank, the missing piece and the fix; ``cpu-forward`` warns and builds a cpu-forward group instead. The path
never changes silently.

Options (a ``pg_options`` dict, else env): ``host`` / ``BIMETAL_DD_HOST``, ``protocol`` / ``BIMETAL_DD_PROTOCOL``,
``engine`` / ``BIMETAL_DD_ENGINE``, ``chunk_bytes`` / ``BIMETAL_DD_CHUNK_BYTES``, ``slots`` / ``BIMETAL_DD_SLOTS``,
``window`` / ``BIMETAL_DD_WINDOW``, ``inline_bytes`` / ``BIMETAL_DD_INLINE_BYTES``, ``fallback`` /
``BIMETAL_DD_FALLBACK``, ``device`` / ``BIMETAL_DD_DEVICE``. The host defaults to this rank's own NIC: NIC number
``LOCAL_RANK`` of the node (one NIC per GPU), else the first NIC, else loopback.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.device_direct.engine import EngineUnavailableError, choose_protocol, open_engine
from bimetal.comm.device_direct.pg import DeviceDirectOptions, DeviceDirectProcessGroup

__all__ = ["DeviceDirectOptions", "DeviceDirectProcessGroup", "EngineUnavailableError", "create_process_group",
           "default_host", "options_from"]

log = logging.getLogger(__name__)
_FALLBACKS = ("error", "cpu-forward")


_MAX_INLINE = 256 << 10  # the largest payload a control frame may carry


def default_host(local_rank: int | None = None, nics: list[Any] | None = None) -> str:
    """The address of NIC ``local_rank`` of this node (one NIC per GPU); the first NIC when the node has fewer
    NICs than local ranks; loopback when it has none. ``local_rank`` defaults to ``LOCAL_RANK`` (else 0)."""
    if nics is None:
        from bimetal.topology.records import local_nics

        nics = local_nics()
    if local_rank is None:
        try:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError:
            local_rank = 0
    if not nics:
        return "127.0.0.1"
    return nics[local_rank].address if 0 <= local_rank < len(nics) else nics[0].address


def _integer(name: str, value: Any, least: int = 1, most: int | None = None) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = least - 1
    if number < least or (most is not None and number > most):
        bounds = f"between {least} and {most}" if most is not None else f"an integer >= {least}"
        raise EngineUnavailableError(f"device-direct option {name} must be {bounds}, got {value!r} "
                                     f"(BIMETAL_DD_{name.upper()})")
    return number


def options_from(pg_options: Any = None) -> DeviceDirectOptions:
    """Options from a ``pg_options`` mapping (or object with attributes), then ``BIMETAL_DD_*``, then defaults."""

    def get(key: str, default: Any) -> Any:
        if isinstance(pg_options, dict) and key in pg_options:
            return pg_options[key]
        if pg_options is not None and not isinstance(pg_options, dict) and hasattr(pg_options, key):
            return getattr(pg_options, key)
        return os.environ.get(f"BIMETAL_DD_{key.upper()}", default)

    fallback = str(get("fallback", "error")).strip().lower()
    if fallback not in _FALLBACKS:
        raise EngineUnavailableError(f"unknown device-direct fallback {fallback!r}; set BIMETAL_DD_FALLBACK to "
                                     "error or cpu-forward")
    defaults = DeviceDirectOptions(host="")
    return DeviceDirectOptions(host=str(get("host", "") or default_host()), protocol=str(get("protocol", "auto")),
                               engine=str(get("engine", "mooncake")),
                               chunk_bytes=_integer("chunk_bytes", get("chunk_bytes", defaults.chunk_bytes)),
                               slots=_integer("slots", get("slots", defaults.slots)),
                               window=_integer("window", get("window", defaults.window)),
                               inline_bytes=_integer("inline_bytes", get("inline_bytes", defaults.inline_bytes), 0,
                                                     _MAX_INLINE),
                               fallback=fallback)


def _device(pg_options: Any) -> torch.device:
    """Where the receive slots live: the local GPU when there is one (so no byte bounces through the host)."""
    requested = pg_options.get("device") if isinstance(pg_options, dict) else None
    requested = requested or os.environ.get("BIMETAL_DD_DEVICE")
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def create_process_group(dist_backend_opts: Any, pg_options: Any) -> dist.ProcessGroup:
    """The ``bimetal_device_direct`` creator (torch extended_api); see the module docstring for the policy."""
    store, rank = dist_backend_opts.store, dist_backend_opts.group_rank
    size, timeout = dist_backend_opts.group_size, dist_backend_opts.timeout
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    opts = options_from(pg_options)
    store.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout)))
    engine, reason = None, ""
    try:
        engine = open_engine(opts.host, choose_protocol(None if opts.protocol == "auto" else opts.protocol),
                             opts.engine)
    except EngineUnavailableError as exc:
        reason = str(exc)
    # agreement round: every rank says whether its engine started before anyone builds the group
    store.set(f"bimetal_dd_start/{rank}", "ok" if engine is not None else reason or "failed")
    failed = []
    for p in range(size):
        answer = store.get(f"bimetal_dd_start/{p}").decode()
        if answer != "ok":
            failed.append((p, answer))
    if not failed:
        assert engine is not None
        return DeviceDirectProcessGroup(store, rank, size, timeout, global_ranks, engine, opts, _device(pg_options))
    if engine is not None:
        engine.close()
    p, why = failed[0]
    where = f"on global rank {global_ranks[p]}" if p != rank else "on this rank"
    if opts.fallback == "error":
        raise EngineUnavailableError(f"the device-direct engine could not start {where}: {why} "
                                     "(or set BIMETAL_DD_FALLBACK=cpu-forward to use cpu-forward instead)")
    message = (f"device-direct engine could not start {where} ({why}); group falls back to cpu-forward "
               "as BIMETAL_DD_FALLBACK=cpu-forward asks")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log.warning(message)
    try:
        cpu_forward = importlib.import_module("bimetal.comm.cpu_forward")
    except ImportError as exc:
        raise EngineUnavailableError(f"{message}, but cpu-forward is not available in this build ({exc}); "
                                     "install the device-direct engine instead") from exc
    pg = cpu_forward.create_process_group(dist_backend_opts, pg_options)
    pg.fallback_reason = message
    return pg
