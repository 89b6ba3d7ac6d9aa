"""Test doubles for device-direct where real hardware is needed: ``RecordingEngine`` stands in for Mooncake's RDMA
transport, which this machine (no RDMA NIC) cannot run.

It keeps RDMA's rules, more strictly than the real engine: a write reads only memory registered on the writing
side and lands only in memory registered on the other (else it fails, as an RDMA write with no key does), a
region is never registered twice or over another live one, and only registered regions can be unregistered;
every breach is also kept in ``violations``. It records what the real engine would be told: every registration
with its location name, every unregistration, the RDMA devices it was restricted to. Engines of one ``Fabric``
(one process) reach each other; the bytes move with ``memmove``. A fabric can stall the writes between two
engines (they stay pending forever), for the start-up probe's deadline.

``open_engine(host, protocol, devices)`` makes it an engine of ``bimetal.comm.device_direct.engine.ENGINES``
(tests add ``"recording": "dd_doubles"``), so whole groups can be built on it through the back-end creator. Each
engine keeps the engine variables of the environment it started in (``environment``: what Mooncake's ``init``
would read), and the module says what its library reads (``FACTS``: set it to a wheel's facts), as the Mooncake
adapter does. A fabric can make the engines started on some threads refuse every registration, as Mooncake does
where GPU memory cannot be registered for RDMA.

``start_group_pair`` builds one two-rank device-direct group the way a job would (the back-end creator, one thread
per rank, a store between them), for the tests of a group's start-up decisions.

``BindingDouble`` stands in for the ``mooncake.engine`` module itself (the pybind binding, which needs
libibverbs and a real engine): it keeps the binding's return codes (``transfer_engine_py.cpp``) and its batch
ids, so the adapter's handling of a timed-out batch, a refused unregistration and an IPv6 session can be checked.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from bimetal.comm.device_direct import engine_env
from bimetal.comm.device_direct.engine import Engine, PeerFailedError, RegistrationError, WriteStatus
from bimetal.comm.device_direct.mooncake import registration_failed


@dataclass
class Fabric:
    """The engines of one process that can reach each other, and the writes that are made to hang."""

    engines: dict[str, RecordingEngine] = field(default_factory=dict)
    stalled: set[tuple[str, str]] = field(default_factory=set)  # (from session, to session): writes never finish
    refusing_threads: set[str] = field(default_factory=set)
    """Engines started on threads of these names refuse every registration."""

    def stall_all(self) -> None:
        """Every write from now on stays pending (a fabric that does not carry them)."""
        self.stalled.add(("*", "*"))


FABRIC = Fabric()
"""The fabric of engines made through ``open_engine``."""
FACTS: engine_env.LibraryFacts | None = None
"""What the library of engines made through ``open_engine`` reads (None: nothing known)."""
WHEEL = "the recording engine"
STARTED: list[RecordingEngine] = []
"""Every engine made through ``open_engine``, in order."""

ROCM_0_3_13_POST1 = engine_env.LibraryFacts(frozenset({
    "MC_FORCE_TCP", "MC_GID_INDEX", "MC_TE_FILTERS", "MC_USE_IPV6", "MC_USE_HIP_IPC", "MC_HIP_NUM_STREAMS",
    "MC_HIP_NUM_EVENTS", "MOONCAKE_DISABLE_HIP_DMABUF", "MC_TCP_LANES_PER_PEER", "MC_TRANSFER_TIMEOUT"}), True,
    "mooncake/engine.so")
"""Part of what ``strings`` finds in the ROCm wheel 0.3.13.post1's ``mooncake/engine.so`` (the names bimetal cares
about; no ``MC_DISABLE_HIP_TRANSPORT`` and no ``MC_DISABLE_HIP``), and its HIP transport."""
_sessions = itertools.count()


class RecordingEngine(Engine):
    """Test double for Mooncake's RDMA transport: records location names and registrations (module docstring)."""

    name = "recording"

    def __init__(self, fabric: Fabric | None = None, protocol: str = "rdma", devices: tuple[str, ...] = (),
                 gpu_prefix: str = "cuda") -> None:
        self.fabric = fabric if fabric is not None else FABRIC
        self.protocol, self.devices, self.gpu_prefix = protocol, devices, gpu_prefix
        self.session = f"recording-{next(_sessions)}"
        self.fabric.engines[self.session] = self
        self.environment = engine_env.engine_variables()  # what the real engine's start would read
        self.refuses = threading.current_thread().name in self.fabric.refusing_threads
        self.registrations: list[tuple[int, int, str]] = []  # (address, bytes, location) of every register call
        self.unregistrations: list[int] = []
        self.regions: dict[int, int] = {}  # live: address -> bytes
        self.violations: list[str] = []
        self.writes = 0
        self._peers: dict[int, RecordingEngine] = {}
        self._status: dict[int, WriteStatus] = {}
        self._handles = itertools.count(1)
        self._inbox: list[str] = []

    def endpoint(self) -> dict[str, Any]:
        return {"engine": self.name, "protocol": self.protocol, "session": self.session}

    def connect(self, peer: int, endpoint: dict[str, Any]) -> None:
        self._peers[peer] = self.fabric.engines[endpoint["session"]]

    def covered(self, ptr: int, nbytes: int) -> bool:
        return any(start <= ptr and ptr + nbytes <= start + size for start, size in self.regions.items())

    def register(self, ptr: int, nbytes: int, location: str) -> None:
        if self.refuses:
            raise RegistrationError(registration_failed(self.protocol, nbytes, location, -1))
        if any(ptr < start + size and start < ptr + nbytes for start, size in self.regions.items()):
            self.violations.append(f"registered {nbytes} bytes at {ptr:#x} over a live region")
            raise RuntimeError(self.violations[-1])
        self.registrations.append((ptr, nbytes, location))
        self.regions[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if self.regions.pop(ptr, None) is None:
            self.violations.append(f"unregistered {ptr:#x}, which is not registered")
            return
        self.unregistrations.append(ptr)

    def post_write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> int:
        handle = next(self._handles)
        target = self._peers.get(peer)
        if target is None or target.session not in self.fabric.engines:
            raise PeerFailedError(f"group rank {peer} is not reachable")
        if ("*", "*") in self.fabric.stalled or (self.session, target.session) in self.fabric.stalled:
            self._status[handle] = WriteStatus.PENDING
            return handle
        if self.protocol != "tcp" and not self.covered(local_ptr, nbytes):
            self.violations.append(f"wrote {nbytes} bytes from unregistered memory at {local_ptr:#x}")
            self._status[handle] = WriteStatus.FAILED
            return handle
        if not target.covered(remote_ptr, nbytes):
            self.violations.append(f"wrote {nbytes} bytes into memory the peer did not register ({remote_ptr:#x})")
            self._status[handle] = WriteStatus.FAILED
            return handle
        ctypes.memmove(remote_ptr, local_ptr, nbytes)
        self.writes += 1
        self._status[handle] = WriteStatus.DONE
        return handle

    def poll(self, handle: int) -> WriteStatus:
        return self._status[handle]

    def write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        if self.poll(self.post_write(peer, local_ptr, remote_ptr, nbytes)) is not WriteStatus.DONE:
            raise PeerFailedError(f"a {nbytes}-byte write to group rank {peer} failed")

    def notify(self, peer: int, message: str) -> None:
        self._peers[peer]._inbox.append(message)

    def notifications(self) -> list[str]:
        out, self._inbox = self._inbox, []
        return out

    def probe(self, peer: int) -> bool:
        return self._peers[peer].session in self.fabric.engines

    def close(self) -> None:
        self.fabric.engines.pop(self.session, None)


def open_engine(host: str, protocol: str, devices: tuple[str, ...] = ()) -> Engine:
    """An engine on ``FABRIC`` (the ``ENGINES`` entry point)."""
    engine = RecordingEngine(FABRIC, protocol, devices)
    STARTED.append(engine)
    return engine


def library_facts() -> engine_env.LibraryFacts | None:
    """``FACTS`` (the adapter entry point ``engine.open_engine`` asks)."""
    return FACTS


def wheel_label() -> str:
    return WHEEL


def start_group_pair(options: dict[str, Any], store_timeout_s: float, join_s: float,
                     thread_names: tuple[str, str] = ("rank-0", "rank-1")) -> tuple[dict[int, Any], list[str]]:
    """Global ranks 4 and 9 create one device-direct group with ``options`` on two threads named ``thread_names``
    (a ``Fabric`` can single one out); returns each group rank's group or the exception it raised, and the
    "falls back to cpu-forward" warnings said. Fails the test if either thread is still creating after ``join_s``."""
    import torch.distributed as dist

    from bimetal.comm.device_direct.creator import create_process_group

    store, out = dist.HashStore(), {}

    def create(rank: int) -> None:
        backend_opts = SimpleNamespace(store=store, group_rank=rank, group_size=2,
                                       timeout=timedelta(seconds=store_timeout_s), global_ranks_in_group=[4, 9])
        try:
            out[rank] = create_process_group(backend_opts, options)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out[rank] = exc

    threads = [threading.Thread(target=create, args=(r,), name=thread_names[r]) for r in (0, 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_s)
    assert not any(t.is_alive() for t in threads), "group creation hung"
    return out, [str(w.message) for w in caught if "falls back to cpu-forward" in str(w.message)]


class BindingDouble:
    """Test double for the ``mooncake.engine`` binding module: ``TransferEngine`` with the binding's return codes.

    ``check_codes``: what ``transfer_check_status`` answers for each submitted write, in order (then 1);
    ``unregister_rc``/``register_rc``: what those calls return. ``batches`` holds the batch ids not yet freed."""

    SUPPORT_HIP = False

    def __init__(self, check_codes: list[int] | None = None, register_rc: int = 0, unregister_rc: int = 0) -> None:
        self.check_codes = list(check_codes or [])
        self.register_rc, self.unregister_rc = register_rc, unregister_rc
        self.batches: set[int] = set()
        self.initialized: list[tuple[str, ...]] = []
        self.submitted: list[str] = []
        double = self

        class TransferEngine:
            def initialize(self, *args: str) -> int:
                double.initialized.append(args)
                return 0

            def get_rpc_port(self) -> int:
                return 15001

            def register_memory(self, ptr: int, nbytes: int, location: str) -> int:
                return double.register_rc

            def unregister_memory(self, ptr: int) -> int:
                return double.unregister_rc

            def transfer_submit_write(self, session: str, local: int, remote: int, nbytes: int) -> int:
                double.submitted.append(session)
                batch = 1000 + len(double.submitted)
                double.batches.add(batch)
                return batch

            def transfer_check_status(self, batch: int) -> int:
                code = double.check_codes.pop(0) if double.check_codes else 1
                if code in (1, -1):  # done or failed: the binding frees the batch; a timeout (-2) does not
                    double.batches.discard(batch)
                return code

            def get_batch_transfer_status(self, batches: list[int]) -> int:
                for batch in batches:  # a timed-out batch counts as failed here, and is freed
                    double.batches.discard(batch)
                return -1

        self.TransferEngine = TransferEngine
