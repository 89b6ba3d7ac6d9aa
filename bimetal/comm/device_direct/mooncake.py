"""Mooncake Transfer Engine adapter for the device-direct ``Engine`` interface.

Runs in ``P2PHANDSHAKE`` mode: no metadata server; a peer is named by its ``host:rpc_port`` session id,
which we publish through the group store. The CUDA, ROCm and CPU (``-non-cuda``) wheels share this API and
wire protocol. Facts measured on the CPU wheel 0.3.13 over TCP loopback: the blocking calls release the
GIL; a write into memory the peer did not register is refused by the peer (status -1, nothing written);
a write to a dead peer fails at once with -1; ``transfer_check_status`` returns 1 done, 0 pending, <0 failed.

Before it starts, the installed wheel is checked against torch's build (``builds.py``). Over RDMA the engine opens
only the devices named (``initialize``'s fourth argument, a comma-separated filter its topology discovery applies;
Mooncake's own ``MC_TE_FILTERS`` whitelist still applies on top). GPU memory is named ``hip:N`` when the library
was built for ROCm (its ``SUPPORT_HIP`` flag), else ``cuda:N``. The engine's environment (``MC_FORCE_TCP`` and the
rest) is set before it starts (``engine_env.py``); ``library_facts`` tells what the installed library reads.

Return codes of the binding (``transfer_engine_py.cpp``): ``register_memory``/``unregister_memory`` 0 or an error;
``transfer_submit_write`` a batch id, 0 on failure; ``transfer_check_status`` 1 done, 0 pending, -1 failed (the
batch freed), -2 timed out (the batch left allocated: freed here through ``get_batch_transfer_status``, which
counts a timed-out batch as failed and frees it). A peer named by an IPv6 address is ``[addr]:port``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from bimetal.comm.device_direct import engine_env
from bimetal.comm.device_direct.builds import check_installed, install_hint, installed_engines, load_problem
from bimetal.comm.device_direct.engine import (
    Engine,
    EngineUnavailableError,
    PeerFailedError,
    RegistrationError,
    WriteStatus,
)

log = logging.getLogger(__name__)
TIMED_OUT = -2
"""``transfer_check_status``'s code for a batch whose slices timed out (``MC_TRANSFER_TIMEOUT``)."""


def _import_mooncake():
    # glog is chatty at INFO; keep warnings and errors (they explain failed writes)
    os.environ.setdefault("GLOG_minloglevel", "1")
    problem = check_installed()
    if problem:
        raise EngineUnavailableError(problem)
    try:
        from mooncake import engine as mooncake_engine
    except ImportError as exc:
        engines = installed_engines()
        if engines and not isinstance(exc, ModuleNotFoundError):  # installed, but a library it links is missing
            raise EngineUnavailableError(load_problem(str(exc), engines)) from exc
        raise EngineUnavailableError(
            f"Mooncake Transfer Engine is not installed ({exc}); install the build for this torch with {install_hint()}"
        ) from exc
    return mooncake_engine


def library_facts() -> engine_env.LibraryFacts | None:
    """What the installed engine library reads (its own strings), for ``engine_env.plan``."""
    return engine_env.library_facts()


def wheel_label() -> str:
    """The installed engine wheel, in words (``mooncake-transfer-engine-rocm 0.3.13.post1``)."""
    engines = installed_engines()
    return " and ".join(f"{n} {v}" for n, v in engines) if engines else "the installed Mooncake build"


def session_name(host: str, port: int) -> str:
    """How Mooncake names a peer: ``host:port``, ``[addr]:port`` for an IPv6 address (its ``maybeWrapIpV6``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class MooncakeEngine(Engine):
    """One ``mooncake.engine.TransferEngine`` in P2P-handshake mode."""

    name = "mooncake"

    def __init__(self, host: str, protocol: str, devices: tuple[str, ...] = ()) -> None:
        self._mc = _import_mooncake()
        self.protocol = protocol
        self.gpu_prefix = "hip" if getattr(self._mc, "SUPPORT_HIP", False) else "cuda"
        self._engine = self._mc.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ",".join(devices))
        if rc != 0:
            named = f" with RDMA devices {','.join(devices)}" if devices else ""
            raise EngineUnavailableError(
                f"Mooncake Transfer Engine failed to start with protocol {protocol}{named} on host {host} (rc={rc}); "
                "check that the host address is local and, for rdma, that a verbs device is up"
            )
        self.session = session_name(host, self._engine.get_rpc_port())
        self._peers: dict[int, str] = {}
        self._registered: dict[int, int] = {}  # ptr -> references (a tensor may be in two messages at once)

    def endpoint(self) -> dict[str, Any]:
        return {"engine": self.name, "protocol": self.protocol, "session": self.session}

    def connect(self, peer: int, endpoint: dict[str, Any]) -> None:
        session = endpoint.get("session")
        if endpoint.get("engine") != self.name or not isinstance(session, str) or ":" not in session:
            raise ValueError(f"malformed Mooncake endpoint from group rank {peer}: {endpoint!r}")
        if endpoint.get("protocol") != self.protocol:
            raise EngineUnavailableError(
                f"group rank {peer} runs the device-direct engine over {endpoint.get('protocol')} but this rank over "
                f"{self.protocol}; set the same BIMETAL_DD_PROTOCOL on every rank"
            )
        self._peers[peer] = session

    def register(self, ptr: int, nbytes: int, location: str) -> None:
        if ptr in self._registered:
            self._registered[ptr] += 1
            return
        rc = self._engine.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise RegistrationError(registration_failed(self.protocol, nbytes, location, rc))
        self._registered[ptr] = 1

    def unregister(self, ptr: int) -> None:
        if ptr not in self._registered:
            return
        self._registered[ptr] -= 1
        if self._registered[ptr] == 0:
            del self._registered[ptr]
            rc = self._engine.unregister_memory(ptr)
            if rc != 0:
                # the engine still holds it: a later registration at a reused address would meet a stale one
                raise RuntimeError(f"Mooncake could not unregister the memory at {ptr:#x} (rc={rc})")

    def _session(self, peer: int) -> str:
        return self._peers[peer]

    def post_write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> int:
        handle = self._engine.transfer_submit_write(self._session(peer), local_ptr, remote_ptr, nbytes)
        if handle <= 0:
            raise PeerFailedError(f"posting a {nbytes}-byte write to group rank {peer} failed (rc={handle})")
        return handle

    def poll(self, handle: int) -> WriteStatus:
        status = self._engine.transfer_check_status(handle)
        if status == 0:
            return WriteStatus.PENDING
        if status == TIMED_OUT:
            self._engine.get_batch_transfer_status([handle])  # frees the batch (the check left it allocated)
        return WriteStatus.DONE if status == 1 else WriteStatus.FAILED

    def write(self, peer: int, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        rc = self._engine.transfer_sync_write(self._session(peer), local_ptr, remote_ptr, nbytes)
        if rc != 0:
            raise PeerFailedError(f"a {nbytes}-byte write to group rank {peer} failed (rc={rc})")

    def notify(self, peer: int, message: str) -> None:
        # a zero-length write carries the notification; it needs no registered memory on either side
        notice = self._mc.TransferNotify(self.session, message)
        rc = self._engine.transfer_sync(self._session(peer), 0, 0, 0, self._mc.TransferOpcode.Write, notice)
        if rc != 0:
            raise PeerFailedError(f"a notification to group rank {peer} failed (rc={rc})")

    def notifications(self) -> list[str]:
        return [n.msg for n in self._engine.get_notifies()]

    def probe(self, peer: int) -> bool:
        return self._engine.send_probe(self._session(peer)) == 0

    def close(self) -> None:
        for ptr in list(self._registered):
            rc = self._engine.unregister_memory(ptr)
            if rc != 0:  # closing anyway: the engine's own teardown releases it, but say so
                log.warning("device-direct: Mooncake could not unregister the memory at %#x at close (rc=%s)", ptr, rc)
        self._registered.clear()
        # the pybind object frees the engine (and its listening socket) when the last reference goes
        self._engine = None


def registration_failed(protocol: str, nbytes: int, location: str, rc: int) -> str:
    """The sentence for a refused registration: over RDMA, GPU memory needs the peer-memory driver or dma-buf."""
    if protocol != "tcp" and not location.startswith("cpu"):
        why = ("RDMA to GPU memory needs the peer-memory kernel module (nvidia-peermem on NVIDIA, amdgpu's "
               "peer-memory support on AMD) or dma-buf support in the driver and NIC")
    else:
        why = "the engine refused it"
    return (f"Mooncake could not register {nbytes} bytes of {location} memory for {protocol} (rc={rc}): {why}; "
            "load that support, or set BIMETAL_DD_PROTOCOL=tcp")


def open_engine(host: str, protocol: str, devices: tuple[str, ...] = ()) -> Engine:
    """Start a Mooncake engine listening on ``host`` (an address of this machine), over RDMA on ``devices``
    only when some are named."""
    return MooncakeEngine(host, protocol, devices)
