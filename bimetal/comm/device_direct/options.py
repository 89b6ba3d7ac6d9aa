"""Options of a device-direct group: what the user asked (``DeviceDirectOptions``) and what the group runs with.

Pass a ``DeviceDirectOptions`` (or a dict of its fields) as ``pg_options`` to ``dist.new_group``; a field left
unset (``None``) comes from its ``BIMETAL_DD_*`` variable, else its default. Precedence: pg_options > env >
default. ``resolved()`` checks every value and gives the ``DeviceDirectSettings`` the group is built from;
a bad value or an unknown option is refused with one sentence that names it (``EngineUnavailableError``, a
``UserError``). The protocol and engine names are checked where they are used (``engine.py``), so an
unusable one is an engine that cannot start and follows the fallback policy, as it always did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bimetal.comm.device_direct.engine import EngineUnavailableError
from bimetal.env import read as read_env
from bimetal.errors import UserError
from bimetal.topology import local_device

FALLBACKS = ("error", "cpu-forward")
MAX_INLINE = 256 << 10  # the largest payload a control frame may carry


def default_host(local_rank: int | None = None, nics: list[Any] | None = None) -> str:
    """The address of this local rank's NIC among the candidates (``bimetal.topology.interfaces``, which leave out
    bridges and container networks): the one paired with its GPU in the PCI topology, as cpu-forward and the
    topology exchange choose (``interfaces.preference``), else by position from NIC ``local_rank`` (wrapping where
    the node has fewer NICs than local ranks); loopback when it has none. ``local_rank`` defaults to
    ``LOCAL_RANK``. This is the choice without the peers; a group's creator narrows it by their subnets
    (``reach``)."""
    from bimetal.topology import interfaces

    if nics is None:
        nics = interfaces.candidate_nics()
    if local_rank is None:
        try:
            local_rank = local_device.local_rank()
        except UserError:
            local_rank = 0
    if not nics:
        return "127.0.0.1"
    return str(interfaces.pick(nics, local_rank, 1, interfaces.preference(nics, local_rank))[0].address)


@dataclass(frozen=True)
class DeviceDirectSettings:
    """The resolved knobs one device-direct group runs with (every field set and checked)."""

    host: str
    """Address this rank's engine and control listener bind to; empty (with ``host_named`` False): chosen by the
    group's creator from the interfaces the members agree on."""
    protocol: str = "auto"
    """``rdma``, ``tcp`` or ``auto`` (RDMA where verbs devices exist)."""
    engine: str = "mooncake"
    """Which transfer engine adapter (``engine.ENGINES``)."""
    chunk_bytes: int = 4 << 20
    """Receive-slot size = the eager limit = the rendezvous write size."""
    slots: int = 8
    """Receive slots (credits) per peer."""
    window: int = 16
    """Rendezvous writes in flight per message (Mooncake's TCP transport spreads them over its connection
    lanes to the peer, ``MC_TCP_LANES_PER_PEER``, 4 by default)."""
    inline_bytes: int = 16 << 10
    """Host-tensor messages up to this size ride inside the control note (0: never)."""
    fallback: str = "error"
    """When the engine cannot start: ``error`` (fail with the reason) or ``cpu-forward`` (warn and use it)."""
    device: str = ""
    """Where the receive slots live; empty: this rank's GPU (``local_device.rank_device``), else the CPU."""
    devices: tuple[str, ...] = ()
    """The RDMA devices the engine may open (empty: every one it finds)."""
    reg_cache_bytes: int = 4 << 30
    """Bytes of user memory (rendezvous receive tensors) kept registered, least recently used out first."""
    gid_index: int | None = None
    """The RoCE GID index the engine uses (``MC_GID_INDEX``); None: the engine's own choice."""
    host_named: bool = True
    """Whether ``host`` was given (option or ``BIMETAL_DD_HOST``); False: the group's creator chooses it."""
    allowed_interfaces: tuple[str, ...] = ()
    """The node's interfaces the host address may come from (``parallel.interfaces``); empty: ``BIMETAL_IFACES``,
    else the default candidates."""

    def torch_device(self) -> torch.device:
        """The receive-slot device: the rank's own GPU as the launcher assigned it (so no byte bounces through the
        host), never "the current device" of whichever thread creates the group."""
        if self.device:
            return torch.device(self.device)
        return local_device.rank_device()


@dataclass(frozen=True)
class DeviceDirectOptions:
    """Options of a device-direct group (``pg_options`` of ``dist.new_group``); ``None``: env var, else default."""

    host: str | None = None
    """``BIMETAL_DD_HOST``; default: this rank's interface among those the members agree on at group creation."""
    protocol: str | None = None
    """``BIMETAL_DD_PROTOCOL``: ``rdma``, ``tcp`` or ``auto`` (default)."""
    engine: str | None = None
    """``BIMETAL_DD_ENGINE``: the transfer engine adapter (default ``mooncake``)."""
    chunk_bytes: int | None = None
    """``BIMETAL_DD_CHUNK_BYTES``: receive-slot size, eager limit and rendezvous write size (default 4 MiB)."""
    slots: int | None = None
    """``BIMETAL_DD_SLOTS``: receive slots (credits) per peer (default 8)."""
    window: int | None = None
    """``BIMETAL_DD_WINDOW``: rendezvous writes in flight per message (default 16)."""
    inline_bytes: int | None = None
    """``BIMETAL_DD_INLINE_BYTES``: host-tensor messages up to this size ride in the control note (default
    16 KiB; 0: never; at most 256 KiB)."""
    fallback: str | None = None
    """``BIMETAL_DD_FALLBACK``: ``error`` (default) or ``cpu-forward`` when an engine cannot start."""
    device: str | None = None
    """``BIMETAL_DD_DEVICE``: where the receive slots live (default: this rank's GPU, else the CPU)."""
    devices: str | list[str] | None = None
    """``BIMETAL_DD_DEVICES``: the RDMA devices the engine may open, e.g. ``mlx5_0,mlx5_1`` (default: every one
    it finds); each must exist on the host."""
    reg_cache_bytes: int | None = None
    """``BIMETAL_DD_REG_CACHE_BYTES``: bytes of user tensors (rendezvous receives) kept registered with the
    engine, least recently used out first (default 4 GiB)."""
    gid_index: int | None = None
    """``BIMETAL_DD_GID_INDEX``: the RoCE GID index the engine uses, set as ``MC_GID_INDEX`` unless the user set
    that (default: the engine picks one)."""
    allowed_interfaces: list[str] | None = None
    """The node's interfaces (names or patterns) the default host may come from (``parallel.interfaces``);
    None: ``BIMETAL_IFACES``, else the default candidates."""

    @classmethod
    def from_pg_options(cls, pg_options: Any) -> DeviceDirectOptions:
        """``pg_options`` as given to ``dist.new_group``: None, a ``DeviceDirectOptions`` or a dict of its fields."""
        if pg_options is None:
            return cls()
        if isinstance(pg_options, cls):
            return pg_options
        if not isinstance(pg_options, Mapping):
            raise EngineUnavailableError(f"device-direct pg_options must be a DeviceDirectOptions or a dict of its "
                                         f"fields, got a {type(pg_options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [str(k) for k in pg_options if k not in names]
        if unknown:
            raise EngineUnavailableError(f"unknown device-direct option {unknown[0]!r} in pg_options; the options "
                                         f"are {', '.join(names)}")
        return cls(**{str(k): v for k, v in pg_options.items()})

    def resolved(self) -> DeviceDirectSettings:
        """Every field from this object, else ``BIMETAL_DD_<FIELD>``, else the default; checked."""

        def get(key: str, default: Any) -> Any:
            value = getattr(self, key)
            if value is not None:
                return value
            try:
                raw = read_env(f"BIMETAL_DD_{key.upper()}")  # the table's check: one sentence naming the variable
            except UserError as exc:
                raise EngineUnavailableError(str(exc)) from None
            return default if raw is None else raw

        fallback = str(get("fallback", "error")).strip().lower()
        if fallback not in FALLBACKS:
            raise EngineUnavailableError(f"unknown device-direct fallback {fallback!r}; set BIMETAL_DD_FALLBACK to "
                                         "error or cpu-forward")
        defaults = DeviceDirectSettings(host="")
        host = str(get("host", "") or "")
        gid = get("gid_index", None)
        allowed = tuple(self.allowed_interfaces or ())
        return DeviceDirectSettings(
            host=host, host_named=bool(host), allowed_interfaces=allowed,
            protocol=str(get("protocol", "auto")),
            engine=str(get("engine", "mooncake")),
            chunk_bytes=_integer("chunk_bytes", get("chunk_bytes", defaults.chunk_bytes)),
            slots=_integer("slots", get("slots", defaults.slots)),
            window=_integer("window", get("window", defaults.window)),
            inline_bytes=_integer("inline_bytes", get("inline_bytes", defaults.inline_bytes), 0, MAX_INLINE),
            fallback=fallback, device=str(get("device", "") or ""), devices=_names(get("devices", "")),
            reg_cache_bytes=_integer("reg_cache_bytes", get("reg_cache_bytes", defaults.reg_cache_bytes)),
            gid_index=None if gid is None else _integer("gid_index", gid, 0, 255))


def options_from(pg_options: Any = None) -> DeviceDirectSettings:
    """The settings of a group: ``pg_options`` (see ``DeviceDirectOptions.from_pg_options``), env, defaults."""
    return DeviceDirectOptions.from_pg_options(pg_options).resolved()


def _names(value: Any) -> tuple[str, ...]:
    """RDMA device names from ``a,b`` or a list of names; an empty name is refused."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise EngineUnavailableError(f"device-direct option devices must be device names like mlx5_0,mlx5_1, got "
                                     f"{value!r} (BIMETAL_DD_DEVICES)")
    cleaned = tuple(n.strip() for n in names)
    if cleaned in ((), ("",)):
        return ()
    if not all(cleaned):
        raise EngineUnavailableError(f"device-direct option devices has an empty name in {value!r}; write names "
                                     "separated by commas, like mlx5_0,mlx5_1 (BIMETAL_DD_DEVICES)")
    return cleaned


def _integer(name: str, value: Any, least: int = 1, most: int | None = None) -> int:
    try:
        # a bool or a fraction is no count of bytes or slots: refused, not rounded
        whole = not isinstance(value, bool) and not (isinstance(value, float) and not value.is_integer())
        number = int(value) if whole else least - 1
    except (TypeError, ValueError):
        number = least - 1
    if number < least or (most is not None and number > most):
        bounds = f"between {least} and {most}" if most is not None else f"an integer >= {least}"
        raise EngineUnavailableError(f"device-direct option {name} must be {bounds}, got {value!r} "
                                     f"(BIMETAL_DD_{name.upper()})")
    return number
