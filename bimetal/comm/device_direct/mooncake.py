"""Mooncake Transfer Engine adapter for the device-direct ``Engine`` interface.

Runs in ``P2PHANDSHAKE`` mode: no metadata server; a peer is named by its ``host:rpc_port`` session id,
which we publish through the group store. The CUDA, ROCm and CPU (``-non-cuda``) wheels share this API and
wire protocol. Facts measured on the CPU wheel 0.3.13 over TCP loopback: the blocking calls release the
GIL; a write into memory the peer did not register is refused by the peer (status -1, nothing written);
a write to a dead peer fails at once with -1; ``transfer_check_status`` returns 1 done, 0 pending, <0 failed.

Before it starts, the installed wheel is checked against torch's build (``builds.py``). Over RDMA the engine opens
only the devices named (``initialize``'s fourth argument, a comma-separated filter its topology discovery applies;
Mooncake's own ``MC_TE_FILTERS`` whitelist still applies on top). GPU memory is named ``hip:N`` when the library
was built for ROCm (its ``SUPPORT_HIP`` flag), else ``cuda:N``.
"""

from __future__ import annotations

import os
from typing import Any

from bimetal.comm.device_direct.builds import check_installed, install_hint
from bimetal.comm.device_direct.engine import Engine, EngineUnavailableError, PeerFailedError, WriteStatus


def _import_mooncake():
    # glog is chatty at INFO; keep warnings and errors (they explain failed writes)
    os.environ.setdefault("GLOG_minloglevel", "1")
    problem = check_installed()
    if problem:
        raise EngineUnavailableError(problem)
    try:
        from mooncake import engine as mooncake_engine
    except ImportError as exc:
        missing = str(exc)
        if "libibverbs" in missing:
            raise EngineUnavailableError(
                f"Mooncake Transfer Engine needs libibverbs ({missing}); install it with `apt-get install libibverbs1`"
            ) from exc
        what = "is not installed" if isinstance(exc, ModuleNotFoundError) else "could not load"
        raise EngineUnavailableError(
            f"Mooncake Transfer Engine {what} ({missing}); install the build for this torch with {install_hint()}"
        ) from exc
    return mooncake_engine


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
        self.session = f"{host}:{self._engine.get_rpc_port()}"
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
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes at {ptr:#x} on {location} (rc={rc})")
        self._registered[ptr] = 1

    def unregister(self, ptr: int) -> None:
        if ptr not in self._registered:
            return
        self._registered[ptr] -= 1
        if self._registered[ptr] == 0:
            del self._registered[ptr]
            self._engine.unregister_memory(ptr)

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
            self._engine.unregister_memory(ptr)
        self._registered.clear()
        # the pybind object frees the engine (and its listening socket) when the last reference goes
        self._engine = None


def open_engine(host: str, protocol: str, devices: tuple[str, ...] = ()) -> Engine:
    """Start a Mooncake engine listening on ``host`` (an address of this machine), over RDMA on ``devices``
    only when some are named."""
    return MooncakeEngine(host, protocol, devices)
