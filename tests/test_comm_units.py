"""Unit tests of the transport pieces that need no process group: chunk plan, staging pool, options."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from bimetal.comm.staging import PinnedPool, PoolExhausted
from bimetal.comm.striping import CpuForwardOptions, chunk_plan
from bimetal.errors import UserError


def test_chunk_plan_covers_the_message_and_rotates_stripes() -> None:
    plan = chunk_plan(numel=10_000, element_size=4, chunk_bytes=4096, stripes=3, first=1)
    assert plan[0] == (0, 1024, 1) and plan[1] == (1024, 2048, 2) and plan[2] == (2048, 3072, 0)
    assert plan[-1][1] == 10_000 and all(a < b for a, b, _ in plan)
    assert [b for _, b, _ in plan[:-1]] == [a for a, _, _ in plan[1:]]  # contiguous, no gaps
    assert chunk_plan(0, 4, 4096, 2, first=1) == [(0, 0, 1)]


def test_pool_reuses_buffers_and_bounds_them() -> None:
    pool = PinnedPool(max_buffers=2, pin=False)
    a = pool.take(torch.float32, 256, timedelta(seconds=1))
    b = pool.take(torch.float32, 256, timedelta(seconds=1))
    with pytest.raises(PoolExhausted, match="no staging buffer of 256"):
        pool.take(torch.float32, 256, timedelta(seconds=0.05))
    pool.give(a)
    assert pool.take(torch.float32, 256, timedelta(seconds=1)) is a
    pool.give(a)
    pool.give(b)
    for _ in range(20):  # steady state: no new allocation per call
        pool.give(pool.take(torch.float32, 256, timedelta(seconds=1)))
    assert pool.allocations == 2


def test_pool_take_waits_for_a_buffer_given_back() -> None:
    pool = PinnedPool(max_buffers=1, pin=False)
    held = pool.take(torch.uint8, 64, timedelta(seconds=1))
    threading.Timer(0.1, pool.give, args=(held,)).start()
    start = time.monotonic()
    assert pool.take(torch.uint8, 64, timedelta(seconds=5)) is held
    assert time.monotonic() - start < 4


def test_options_from_env_and_their_errors(monkeypatch) -> None:
    monkeypatch.setenv("BIMETAL_CF_IFACES", "eth0,eth1")
    monkeypatch.setenv("BIMETAL_CF_CHUNK_BYTES", "65536")
    opts = CpuForwardOptions().resolved()
    assert opts.stripes == 2 and opts.interfaces == ["eth0", "eth1"] and opts.chunk_bytes == 65536
    assert CpuForwardOptions(stripes=4, interfaces=["lo"]).resolved().interfaces == ["lo"] * 4
    monkeypatch.setenv("BIMETAL_CF_STRIPES", "two")
    with pytest.raises(UserError, match="BIMETAL_CF_STRIPES='two' is not an integer"):
        CpuForwardOptions().resolved()
    with pytest.raises(UserError, match="pool_buffers=1"):
        CpuForwardOptions(stripes=1, pool_buffers=1).resolved()
