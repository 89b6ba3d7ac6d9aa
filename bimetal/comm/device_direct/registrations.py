"""Memory registered with the engine: once for the group's own buffers, cached for the users', never per message.

Registering memory for RDMA pins it and builds a translation in every NIC it may use: milliseconds for large
buffers, far more than a pipeline message may spend. So every registration of a group goes through
``Registrations``, which names the location (``locations.py``), counts it (``Counters``) and keeps it:

* the group's own buffers (the receive slots, the send pool) are registered once, when they are made, and
  released when the group closes (``fixed``);
* a user tensor the peer writes into (a rendezvous receive) is registered as its whole storage and kept in a
  cache bounded by bytes, least recently used out first (``acquire``/``release``): torch's pipeline schedules
  receive into the same buffers every step, so after the first step nothing is registered. An entry lives only
  as long as its storage: the cache holds a weak reference, and a storage that is freed is unregistered before
  anything else is registered (its address may come back for other memory, and a stale registration there
  would let the peer write into pages that are no longer the tensor's). An entry in use is never evicted.
* what we send from memory nobody registered goes through ``SendPool``, chunk-sized buffers registered once:
  the proxy copies (device to device) into one and writes from it. Fresh tensors (a stage's outputs, its input
  gradients) would otherwise each cost a registration. Only engines that need registered sources (RDMA) get a
  pool; Mooncake's TCP transport reads any memory.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bimetal.comm.device_direct.engine import Engine
from bimetal.comm.device_direct.locations import location_name
from bimetal.comm.device_direct.ops import Counters


@dataclass(eq=False)
class Region:
    """One registered range of memory."""

    start: int
    nbytes: int
    location: str
    storage: weakref.ref | None = None  # cached user memory: valid while this storage lives
    pins: int = 0  # ops using it now (never evicted while > 0)
    cached: bool = True

    def covers(self, ptr: int, nbytes: int) -> bool:
        return self.start <= ptr and ptr + nbytes <= self.start + self.nbytes


@dataclass
class Registrations:
    """Every registration of one group (the proxy thread's, except ``fixed`` at set-up); see the module docstring."""

    engine: Engine
    counters: Counters
    bound: int = 4 << 30
    """Bytes of user memory the cache may keep registered (entries in use may exceed it for a while)."""
    buffers: dict[str, str] = field(default_factory=dict)
    """Name of each buffer the group owns -> its device (for the GPU check)."""
    locations: set[str] = field(default_factory=set)
    """Every location name given to the engine."""
    _fixed: list[Region] = field(default_factory=list)
    _cache: collections.OrderedDict[int, Region] = field(default_factory=collections.OrderedDict)
    _cached_bytes: int = 0
    _dead: list[int] = field(default_factory=list)  # keys whose storage was freed (appended by weakref callbacks)

    def _register(self, ptr: int, nbytes: int, device: torch.device) -> str:
        name = location_name(device, ptr, self.engine.gpu_prefix)
        self.engine.register(ptr, nbytes, name)
        self.counters.registrations += 1
        self.counters.registered_bytes += nbytes
        self.locations.add(name)
        return name

    def _unregister(self, region: Region) -> None:
        self.engine.unregister(region.start)
        self.counters.unregistrations += 1
        self.counters.registered_bytes -= region.nbytes

    def fixed(self, name: str, t: torch.Tensor) -> None:
        """Register a buffer the group owns for its whole life (receive slots, send pool)."""
        self._fixed.append(Region(t.data_ptr(), t.numel() * t.element_size(),
                                  self._register(t.data_ptr(), t.numel() * t.element_size(), t.device)))
        self.buffers[name] = str(t.device)

    def lookup(self, flat: torch.Tensor) -> Region | None:
        """The cached registration covering ``flat``, pinned (``release`` it), or None: registers nothing."""
        self._purge()
        region = self._valid(flat)
        if region is not None:
            region.pins += 1
            self._cache.move_to_end(region.start)
        return region

    def acquire(self, flat: torch.Tensor) -> Region:
        """A registration covering ``flat`` (cached, or made now), pinned until ``release``."""
        region = self.lookup(flat)
        if region is not None:
            return region
        storage = flat.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes > self.bound or start in self._cache:
            # bigger than the whole cache, or an alias of a cached storage that does not cover it: registered for
            # this op alone, as every op was before
            region = Region(flat.data_ptr(), flat.numel(), "", cached=False)
            region.location = self._register(region.start, region.nbytes, flat.device)
            region.pins = 1
            return region
        region = Region(start, nbytes, self._register(start, nbytes, flat.device),
                        weakref.ref(storage, self._on_freed(start)), pins=1)
        self._cache[start] = region
        self._cached_bytes += nbytes
        self._evict()
        return region

    def _on_freed(self, key: int) -> Callable[[weakref.ref], None]:
        # runs on whichever thread freed the storage: only note it (a list append is atomic); the proxy acts
        def note(_: weakref.ref) -> None:
            self._dead.append(key)
        return note

    def release(self, region: Region) -> None:
        """One op is done with ``region``."""
        region.pins -= 1
        if not region.cached and region.pins == 0:
            self._unregister(region)
        else:
            self._evict()

    def _valid(self, flat: torch.Tensor) -> Region | None:
        key = flat.untyped_storage().data_ptr()
        region = self._cache.get(key)
        if region is None:
            return None
        held = region.storage() if region.storage is not None else None
        if held is None or held.data_ptr() != region.start or held.nbytes() < region.nbytes:
            # its storage was freed (or resized away) and the address handed out again: the registration is stale
            if region.pins == 0:
                self._drop(key)
            return None
        # (a live storage at the same address is the same memory, e.g. two storages aliasing one allocation)
        return region if region.covers(flat.data_ptr(), flat.numel()) else None

    def _drop(self, key: int) -> None:
        region = self._cache.pop(key)
        self._cached_bytes -= region.nbytes
        self._unregister(region)

    def _purge(self) -> None:
        """Unregister the entries whose storage was freed (before anything new can be registered there)."""
        while self._dead:
            key = self._dead.pop()
            region = self._cache.get(key)
            if region is not None and region.storage is not None and region.storage() is None:
                self._drop(key)

    def _evict(self) -> None:
        for key in list(self._cache):
            if self._cached_bytes <= self.bound:
                return
            if self._cache[key].pins == 0:
                self._drop(key)

    def close(self) -> None:
        """Unregister everything (the group is closing)."""
        for key in list(self._cache):
            self._drop(key)
        for region in self._fixed:
            self._unregister(region)
        self._fixed.clear()


class SendPool:
    """``count`` registered buffers of ``chunk`` bytes that sends from unregistered memory are copied into."""

    def __init__(self, count: int, chunk: int, device: torch.device, registrations: Registrations) -> None:
        self.chunk = chunk
        # zeros, not empty: the pages are touched here, so the NUMA node of a host pool is known when it is named
        self.buffer = torch.zeros(count * chunk, dtype=torch.uint8, device=device)
        registrations.fixed("send pool", self.buffer)
        self._free = collections.deque(range(count))

    def take(self) -> int | None:
        """A free buffer's number, or None while all are in flight."""
        return self._free.popleft() if self._free else None

    def give(self, index: int) -> None:
        self._free.append(index)

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        return self.buffer[index * self.chunk: index * self.chunk + nbytes]
