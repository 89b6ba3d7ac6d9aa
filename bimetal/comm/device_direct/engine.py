"""The transfer-engine interface the device-direct proxy is written against.

An engine moves bytes from local registered memory into a peer's registered memory (one-sided writes) and
carries short text notifications. The proxy and the process group only use this interface, so a second
engine (e.g. NIXL) is one more adapter module plus one entry in ``ENGINES``; nothing else changes.

Also here: the choice of wire protocol from the topology (RDMA where verbs devices exist, TCP otherwise),
overridable with ``BIMETAL_DD_PROTOCOL`` or the ``protocol`` option, the check of the RDMA devices the user
named (``BIMETAL_DD_DEVICES`` or the ``devices`` option), which the engine is then restricted to, and the start
of an engine in the environment that makes it use that protocol (``engine_env.py``).
"""

from __future__ import annotations

import abc
import enum
import importlib
import logging
from pathlib import Path
from typing import Any

from bimetal.comm.device_direct import engine_env
from bimetal.env import read as read_env
from bimetal.errors import UserError

log = logging.getLogger(__name__)
PROTOCOL_ENV = "BIMETAL_DD_PROTOCOL"
ENGINE_ENV = "BIMETAL_DD_ENGINE"
DEVICES_ENV = "BIMETAL_DD_DEVICES"
VERBS_SYSFS = Path("/sys/class/infiniband")

# engine name -> module with ``open_engine(host, protocol, devices) -> Engine``
ENGINES = {"mooncake": "bimetal.comm.device_direct.mooncake"}


class EngineUnavailableError(UserError, RuntimeError):
    """The engine cannot start here; the message names the missing piece and the fix in one sentence."""


class GroupStartError(EngineUnavailableError):
    """A device-direct group could not start; every rank of the group raises it with the same sentence (agreed
    over the store), so the creator applies the fallback policy to it on every rank alike."""


class RegistrationError(EngineUnavailableError):
    """The engine refused to register memory (over RDMA: no peer-memory driver or dma-buf for GPU memory)."""


class PeerFailedError(RuntimeError):
    """A one-sided write or probe to a peer failed (the peer died or became unreachable)."""


class WriteStatus(enum.Enum):
    PENDING = 0
    DONE = 1
    FAILED = 2


class Engine(abc.ABC):
    """One engine instance per process, owned by the proxy thread (methods are not called concurrently)."""

    name: str
    protocol: str
    gpu_prefix: str = "cuda"
    """How the engine names GPU memory locations (``cuda:N``; ``hip:N`` on Mooncake's ROCm build)."""

    @abc.abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """JSON-serialisable metadata a peer needs to reach this engine (published over the store)."""

    @abc.abstractmethod
    def connect(self, peer: int, endpoint: dict[str, Any]) -> None:
        """Remember how to reach group rank ``peer``; ``endpoint`` is what that peer's ``endpoint()`` gave."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int, location: str) -> None:
        """Register memory for one-sided access (``location``: the engine's name for it, ``locations.py``)."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Undo ``register`` for the region starting at ``ptr``."""

    @property
    def needs_source_registration(self) -> bool:
        """Whether the local side of a write must be registered memory (true for RDMA)."""
        return self.protocol != "tcp"

    @abc.abstractmethod
    def post_write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> int:
        """Start an asynchronous write; returns a handle for ``poll``; raises PeerFailedError."""

    @abc.abstractmethod
    def poll(self, handle: int) -> WriteStatus:
        """Status of a posted write (a DONE or FAILED handle is spent)."""

    @abc.abstractmethod
    def write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Synchronous write (small control records); raises PeerFailedError."""

    @abc.abstractmethod
    def notify(self, peer: int, message: str) -> None:
        """Deliver a short text message to the peer's ``notifications()``; raises PeerFailedError."""

    @abc.abstractmethod
    def notifications(self) -> list[str]:
        """Messages that arrived since the last call, in arrival order."""

    @abc.abstractmethod
    def probe(self, peer: int) -> bool:
        """Whether the peer's engine still answers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (registered memory, listening socket)."""


def verbs_devices() -> list[str]:
    """RDMA verbs devices visible to this process (``/sys/class/infiniband``)."""
    try:
        return sorted(p.name for p in VERBS_SYSFS.iterdir())
    except OSError:
        return []


def choose_protocol(requested: str | None = None, devices: tuple[str, ...] = ()) -> str:
    """``rdma`` or ``tcp``: the request (option, else env), or RDMA where verbs devices exist, else TCP.

    ``devices``: the RDMA devices the user named; each must exist here (one sentence naming the first that
    does not), and they make ``auto`` mean RDMA. With TCP they have no effect, which is logged."""
    choice = (requested or read_env(PROTOCOL_ENV) or "auto").strip().lower()
    if choice not in ("rdma", "tcp", "auto"):
        raise EngineUnavailableError(
            f"unknown device-direct protocol {choice!r}; "
            f"set {PROTOCOL_ENV} (or the protocol option) to rdma, tcp or auto"
        )
    present = verbs_devices()
    if devices and choice != "tcp":
        missing = [d for d in devices if d not in present]
        if missing:
            raise EngineUnavailableError(
                f"{DEVICES_ENV} (or the devices option) names {missing[0]}, which is not an RDMA device of this host "
                f"(its devices under {VERBS_SYSFS}: {', '.join(present) or 'none'})"
            )
    if choice == "auto":
        return "rdma" if present else "tcp"
    if choice == "rdma" and not present:
        raise EngineUnavailableError(
            f"the rdma protocol was requested but no verbs device exists under {VERBS_SYSFS}; "
            f"install the RDMA driver or set {PROTOCOL_ENV}=tcp"
        )
    if devices and choice == "tcp":
        log.warning("device-direct: %s=%s has no effect with the tcp protocol", DEVICES_ENV, ",".join(devices))
    return choice


def open_engine(host: str, protocol: str, name: str | None = None, devices: tuple[str, ...] = (),
                gid_index: int | None = None, remote_peers: bool = False) -> Engine:
    """Start the named engine (option, else ``BIMETAL_DD_ENGINE``, else mooncake) on ``host``; over RDMA it opens
    only ``devices`` when some are named (else every device it finds).

    First the engine's environment is set for ``protocol`` (``engine_env.plan``: ``MC_FORCE_TCP`` for tcp, the
    RoCE GID index ``gid_index``, the ROCm build's HIP transport off where the rank has ``remote_peers``), so
    the engine really runs the protocol bimetal chose; a user's own ``MC_*`` value wins and is logged. An
    adapter module may say what its library reads (``library_facts()``) and which wheel it is
    (``wheel_label()``)."""
    engine_name = (name or read_env(ENGINE_ENV) or "mooncake").strip().lower()
    if engine_name not in ENGINES:
        raise EngineUnavailableError(
            f"unknown device-direct engine {engine_name!r}; set {ENGINE_ENV} to one of {', '.join(ENGINES)}"
        )
    module = importlib.import_module(ENGINES[engine_name])
    facts = module.library_facts() if hasattr(module, "library_facts") else None
    label = module.wheel_label() if hasattr(module, "wheel_label") else f"the {engine_name} engine"
    chosen = engine_env.plan(protocol, facts, remote_peers, gid_index, wheel=label, ipv6=":" in host)
    if chosen.refusal:
        raise EngineUnavailableError(chosen.refusal)
    engine_env.apply(chosen)
    protocol = chosen.protocol
    return module.open_engine(host, protocol, devices if protocol != "tcp" else ())
