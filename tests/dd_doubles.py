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
(tests add ``"recording": "dd_doubles"``), so whole groups can be built on it through the back-end creator.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any

from bimetal.comm.device_direct.engine import Engine, PeerFailedError, WriteStatus


@dataclass
class Fabric:
    """The engines of one process that can reach each other, and the writes that are made to hang."""

    engines: dict[str, RecordingEngine] = field(default_factory=dict)
    stalled: set[tuple[str, str]] = field(default_factory=set)  # (from session, to session): writes never finish

    def stall_all(self) -> None:
        """Every write from now on stays pending (a fabric that does not carry them)."""
        self.stalled.add(("*", "*"))


FABRIC = Fabric()
"""The fabric of engines made through ``open_engine``."""
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
    return RecordingEngine(FABRIC, protocol, devices)
