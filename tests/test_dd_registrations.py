"""Device-direct memory registration on RDMA rules, through ``RecordingEngine`` (a test double for Mooncake's RDMA
transport, which needs a NIC this machine lacks): names the engine is given, registrations made once, the bound
of the cache. The real engine's half (TCP) is in test_device_direct.py."""

from __future__ import annotations

import gc
import re
import threading

import pytest
import torch
from dd_doubles import Fabric, RecordingEngine

from bimetal.comm.device_direct import locations
from bimetal.comm.device_direct.locations import location_name
from bimetal.comm.device_direct.ops import Counters
from bimetal.comm.device_direct.proxy import Proxy
from bimetal.comm.device_direct.registrations import Registrations

pytestmark = pytest.mark.timeout(60)
KiB = 1 << 10


def _pair(fabric: Fabric, chunk: int, slots: int, window: int, inline: int) -> tuple[Proxy, Proxy]:
    """Two proxies (group ranks 0 and 1) on RecordingEngines of ``fabric``, connected and running."""
    a, b = (Proxy(RecordingEngine(fabric), r, [0, 1], chunk, slots, window, 30.0, torch.device("cpu"), inline)
            for r in (0, 1))
    pool_a, pool_b = a.add_peer(1), b.add_peer(0)
    a.connect(1, b.engine.endpoint(), pool_b)
    b.connect(0, a.engine.endpoint(), pool_a)
    t = threading.Thread(target=b.control.connect, args=({0: a.control.address}, 10))
    t.start()
    a.control.connect({1: b.control.address}, 10)
    t.join()
    a.start()
    b.start()
    return a, b


def test_registrations_flat_after_warm_up_over_100_mixed_messages() -> None:
    """100 messages both ways, inline, eager and rendezvous sizes mixed: the receiver posts into the same buffers
    every round (as torch's pipeline schedules do), the sender sends fresh tensors (as a stage's outputs are).
    After the first round nothing more is registered; every byte arrives; every name is the engine's."""
    chunk = 64 * KiB
    a, b = _pair(Fabric(), chunk=chunk, slots=4, window=3, inline=KiB)
    proxies = (a, b)
    sizes = [100, 5 * KiB, chunk, 3 * chunk + 7, 10 * chunk]  # inline, eager, eager edge, rendezvous x2
    inboxes = {(r, n): torch.empty(n, dtype=torch.uint8) for r in (0, 1) for n in sizes}
    after_warm_up = None
    try:
        for i in range(100):
            src, n = i % 2, sizes[(i // 2) % len(sizes)]
            msg = torch.randint(0, 256, (n,), dtype=torch.uint8)
            into = inboxes[(1 - src, n)]
            got = proxies[1 - src].recv(into, src, 0, f"recv {i}")
            sent = proxies[src].send(msg, 1 - src, 0, f"send {i}")
            sent.wait()
            got.wait()
            assert torch.equal(into, msg), f"message {i} ({n} bytes) differs"
            if i == 2 * len(sizes) - 1:  # every size once each way
                after_warm_up = [len(p.engine.registrations) for p in proxies]
        for p in proxies:
            engine = p.engine
            assert not engine.violations, engine.violations
            stats = p.counters.stats()
            assert stats["engine_registrations"] == len(engine.registrations), stats
            names = {loc for _, _, loc in engine.registrations}
            assert all(re.fullmatch(r"cpu:\d+|\*", x) for x in names), names
            assert p.transfers.registrations.locations == names
            # what locations.py says for memory of this machine, not the old "cpu"
            assert names == {location_name(torch.device("cpu"), p.transfers.pools[1 - p.rank].data_ptr())}
            assert stats["bytes_send_copied"] > 0  # fresh send tensors went through the registered send pool
        assert [len(p.engine.registrations) for p in proxies] == after_warm_up, "registrations grew after warm-up"
        # the slots, the send pool and the two rendezvous receive buffers: nothing per message
        assert after_warm_up == [4, 4], [p.engine.registrations for p in proxies]
        devices = a.transfers.registrations.buffers
        assert devices == {"receive slots for group rank 1": "cpu", "send pool": "cpu"}, devices
    finally:
        for p in proxies:
            p.close()
    for p in proxies:  # closing releases all of it
        assert not p.engine.regions and p.counters.registered_bytes == 0, p.engine.regions


def test_the_cache_is_bounded_by_bytes_and_follows_its_storages() -> None:
    engine, counters = RecordingEngine(Fabric()), Counters()
    regs = Registrations(engine, counters, bound=3 << 20)
    ts = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(4)]
    for t in ts[:3]:
        regs.release(regs.acquire(t))
    first = ts[0].data_ptr()
    regs.release(regs.acquire(ts[0][10:]))  # a view of a cached storage: a hit, and ts[0] is now the newest
    assert len(engine.registrations) == 3
    regs.release(regs.acquire(ts[3]))  # over the bound: the least recently used (ts[1]) goes
    assert engine.unregistrations == [ts[1].data_ptr()] and first in engine.regions
    pinned = regs.acquire(ts[0])  # in use: never evicted, even over the bound
    big = torch.zeros(5 << 20, dtype=torch.uint8)  # larger than the whole cache: for this op alone
    region = regs.acquire(big)
    assert big.data_ptr() in engine.regions and first in engine.regions
    regs.release(region)
    assert big.data_ptr() not in engine.regions
    regs.release(pinned)
    # a freed storage is unregistered before anything else is registered (its address may come back)
    gone = ts[3].data_ptr()
    del ts[3]
    gc.collect()
    assert regs.lookup(ts[2]) is not None
    assert gone not in engine.regions and not engine.violations
    # a storage resized away from its registered memory gets its new memory registered, not the old range
    old = ts[2].data_ptr()
    ts[2].untyped_storage().resize_(8 << 20)
    fresh = regs.acquire(ts[2])
    assert fresh.start == ts[2].data_ptr() != old and not engine.violations  # (bigger than the bound: one-off)
    regs.release(fresh)
    assert counters.registrations == len(engine.registrations) and counters.unregistrations == len(
        engine.unregistrations)
    regs.close()
    assert not engine.regions and counters.registered_bytes == 0


def test_location_names_are_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU memory by device index and the engine build's prefix; host memory by its NUMA node, else the only
    node, else ``*`` (the engine finds it); never the bare ``cpu`` the engine does not know."""
    assert location_name(torch.device("cuda", 3), 0x1000, "hip") == "hip:3"
    assert location_name(torch.device("cuda", 5), 0x1000, "cuda") == "cuda:5"
    t = torch.ones(4096)
    node = locations.numa_node_of(t.data_ptr())
    assert location_name(t.device, t.data_ptr()) == f"cpu:{node if node is not None else locations.numa_nodes()[0]}"
    monkeypatch.setattr(locations, "numa_node_of", lambda ptr: None)
    monkeypatch.setattr(locations, "numa_nodes", lambda: (0,))
    assert location_name(t.device, t.data_ptr()) == "cpu:0"
    monkeypatch.setattr(locations, "numa_nodes", lambda: (0, 1))
    assert location_name(t.device, t.data_ptr()) == "*"


def test_engine_only_ceiling_writes_from_registered_send_buffers_registered_once() -> None:
    """``bench comm``'s ``dd-engine`` variant on RDMA rules: its writes read registered memory (they used to read
    the caller's unregistered tensor, which RDMA refuses), each send buffer registered once, not per message."""
    from bimetal.bench.engine import EngineOnly

    fabric, store = Fabric(), torch.distributed.HashStore()
    engines = [RecordingEngine(fabric) for _ in (0, 1)]
    sides: dict[int, EngineOnly] = {}

    def make(rank: int) -> None:
        sides[rank] = EngineOnly(store, rank, "127.0.0.1", 64 * KiB, chunk=16 * KiB, window=2, timeout=10,
                                 engine=engines[rank])

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    small, large = torch.arange(1024, dtype=torch.int32), torch.arange(16 * 1024, dtype=torch.int32)
    for tag, message in enumerate([small, large, small, large, large]):
        sides[0].send([message], 1, tag)
        sides[1].recv([torch.empty_like(message)], 0, tag)
        landed = sides[1].landing[:message.numel() * 4].view(torch.int32)
        assert torch.equal(landed, message), tag
    sender = engines[0]
    assert sender.violations == [] and engines[1].violations == []
    assert sorted(n for ptr, n, _ in sender.registrations if ptr != sides[0].landing.data_ptr()) == [4 * KiB, 64 * KiB]
    for side in sides.values():
        side.close()
    assert not sender.regions and not engines[1].regions
