"""The engine alone, with no proxy and no process group: the ceiling device-direct can reach on a link.

``EngineOnly`` is the ``dd-engine`` variant of ``bimetal bench comm``: rank 0 writes the message straight into
a buffer rank 1 registered once (in ``chunk``-sized writes, ``window`` in flight, exactly as the proxy's
rendezvous path posts them) and sends one notification; the 1-element acknowledgement goes back the same way.
No matching, no credits, no per-message registration, no thread hand-off. Side by side with ``gloo`` and
``device-direct`` in one run it separates what the engine costs from what our control plane adds, e.g. to
show that a bandwidth gap to Gloo on loopback is the CPU TCP engine's, not the proxy's.

``bimetal bench engine [bench comm options]`` is ``bimetal bench comm`` with the device-direct rows (gloo,
cpu-forward x1, device-direct, dd-engine at 4 KiB and 64 MiB unless told otherwise).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from bimetal.comm.device_direct.engine import Engine, WriteStatus, choose_protocol, open_engine
from bimetal.comm.device_direct.locations import location_name

_SPIN_S = 300e-6
_NAP_S = 200e-6


class _Done:
    """A completed Work stand-in (``bench comm`` only calls ``wait()``)."""

    def wait(self) -> bool:
        return True


class EngineOnly:
    """Raw one-sided writes plus one notification per message between group ranks 0 and 1."""

    def __init__(self, store: Any, rank: int, host: str, capacity: int, chunk: int = 4 << 20, window: int = 16,
                 timeout: float = 60.0, engine: Engine | None = None) -> None:
        self.rank, self.peer, self.chunk, self.window, self.timeout = rank, 1 - rank, chunk, window, timeout
        self.engine: Engine = engine if engine is not None else open_engine(host, choose_protocol())
        self._sources: dict[int, int] = {}  # send buffers registered (RDMA): address -> bytes, once per buffer
        self.landing = torch.empty(max(capacity, 1), dtype=torch.uint8)
        self.engine.register(self.landing.data_ptr(), self.landing.numel(),
                             location_name(self.landing.device, self.landing.data_ptr(), self.engine.gpu_prefix))
        store.set(f"bimetal_dd_engine_only/{rank}", json.dumps({"endpoint": self.engine.endpoint(),
                                                                "landing": self.landing.data_ptr()}))
        record = json.loads(store.get(f"bimetal_dd_engine_only/{self.peer}"))
        self.engine.connect(self.peer, record["endpoint"])
        self.remote = int(record["landing"])
        self._notes: list[str] = []

    def _register_source(self, flat: torch.Tensor) -> None:
        """Over RDMA a write reads only registered memory: each send buffer is registered at its first send, as the
        transport's send pool is once (a ceiling without per-message registration). A buffer at an address where
        an earlier, freed one was registered replaces that registration."""
        ptr, n = flat.data_ptr(), flat.numel()
        if not self.engine.needs_source_registration or self._sources.get(ptr) == n:
            return
        for start, size in list(self._sources.items()):
            if start < ptr + n and ptr < start + size:
                self.engine.unregister(start)
                del self._sources[start]
        self.engine.register(ptr, n, location_name(flat.device, ptr, self.engine.gpu_prefix))
        self._sources[ptr] = n

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Done:
        flat = tensors[0].reshape(-1).view(torch.uint8)
        self._register_source(flat)
        n, off = flat.numel(), 0
        pending: list[int] = []
        while off < n or pending:
            while off < n and len(pending) < self.window:
                size = min(self.chunk, n - off)
                pending.append(self.engine.post_write(self.peer, flat.data_ptr() + off, self.remote + off, size))
                off += size
            status = self.engine.poll(pending[0])
            if status is WriteStatus.FAILED:
                raise RuntimeError(f"engine-only write of {n} bytes failed")
            if status is WriteStatus.DONE:
                pending.pop(0)
            else:
                time.sleep(_NAP_S)
        self.engine.notify(self.peer, str(tag))
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Done:
        # the data lands in the registered buffer; the ceiling includes no copy into the caller's tensor
        start = time.monotonic()
        while str(tag) not in self._notes:
            self._notes += self.engine.notifications()
            waited = time.monotonic() - start
            if waited > self.timeout:
                raise TimeoutError(f"engine-only recv waited {self.timeout:.0f} s for group rank {src}")
            time.sleep(0 if waited < _SPIN_S else _NAP_S)
        self._notes.remove(str(tag))
        return _Done()

    def close(self) -> None:
        for ptr in [*self._sources, self.landing.data_ptr()]:
            self.engine.unregister(ptr)
        self._sources.clear()
        self.engine.close()
