"""Unit tests of the transport pieces that need no process group: chunk plan, staging pool, options."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from bimetal.comm.cpu_forward.staging import PinnedPool, PoolExhausted
from bimetal.comm.striping import CpuForwardOptions, chunk_plan
from bimetal.errors import UserError


def _check_cover(plan: list[tuple[int, int, int]], numel: int) -> None:
    spans = sorted((a, b) for a, b, _ in plan)
    assert spans[0][0] == 0 and spans[-1][1] == numel and all(a <= b for a, b in spans)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:])), "gaps or overlaps"


def test_chunk_plan_one_stripe_and_small_messages() -> None:
    plan = chunk_plan(numel=10_000, element_size=4, chunk_bytes=4096, stripes=1)
    assert plan[0] == (0, 1024, 0) and plan[-1] == (9216, 10_000, 0) and len(plan) == 10
    assert chunk_plan(0, 4, 4096, 2, first=1) == [(0, 0, 1)]
    assert chunk_plan(1000, 4, 4096, 3, first=4) == [(0, 1000, 1)]  # up to 64 KiB: one chunk, rotating stripe
    assert chunk_plan(1000, 4, 4096, 3, first=1, weights=[5, 0, 5]) == [(0, 1000, 2)]  # a dead stripe is skipped
    with pytest.raises(ValueError, match="weights"):
        chunk_plan(10**6, 4, 4096, 3, weights=[1, 1])


@pytest.mark.parametrize("k", range(1, 9))
def test_chunk_plan_balances_bytes_over_stripes(k: int) -> None:
    """Issue 19: for K = 1..8 and 1 byte .. 256 MiB the busiest stripe carries at most one chunk, or 1/K of
    the bytes (rounded), more than the least busy; chunks never exceed the chunk size."""
    chunk = 4 * 2**20
    sizes = [1, 3, 4096, 65_536, 65_537, 2**20 + 7, 4 * 2**20, 16 * 2**20 + 3, 64 * 2**20, 100_000_007, 256 * 2**20]
    for nbytes in sizes:
        plan = chunk_plan(nbytes, 1, chunk, k, first=nbytes % 7)
        _check_cover(plan, nbytes)
        assert all(b - a <= chunk for a, b, _ in plan)
        load = [sum(b - a for a, b, s in plan if s == st) for st in range(k)]
        biggest = max(b - a for a, b, _ in plan)
        assert max(load) - min(load) <= max(biggest, -(-nbytes // k)), (nbytes, load)
        if nbytes > 2**20:  # large messages: every stripe within one element of an equal share
            assert max(load) - min(load) <= 1, (nbytes, load)
            ends = {s: i for i, (_, _, s) in enumerate(plan)}  # posting order interleaves the stripes
            assert max(ends.values()) - min(ends.values()) < k, (nbytes, ends)
    # weighted (a slower stripe): shares follow the weights, to within one element
    plan = chunk_plan(64 * 2**20, 4, chunk, 2, weights=[3, 1]) if k == 2 else []
    if plan:
        load = [sum(b - a for a, b, s in plan if s == st) for st in range(2)]
        assert abs(load[0] - 3 * load[1]) <= 3


def test_pool_reuses_buffers_and_bounds_them() -> None:
    pool = PinnedPool(max_bytes=2 * 1024, slab_bytes=1024, pin=False)
    a = pool.take(torch.float32, 256, timedelta(seconds=1))
    b = pool.take(torch.int64, 100, timedelta(seconds=1))  # any dtype and count up to one slab
    with pytest.raises(PoolExhausted, match="no staging slab came free"):
        pool.take(torch.float32, 256, timedelta(seconds=0.05))
    pool.give(a)
    again = pool.take(torch.bfloat16, 512, timedelta(seconds=1))
    assert again.data_ptr() == a.data_ptr() and again.dtype == torch.bfloat16
    pool.give(again)
    pool.give(b)
    for _ in range(20):  # steady state: no new allocation per call
        pool.give(pool.take(torch.float32, 256, timedelta(seconds=1)))
    assert pool.allocations == 2 and pool.held_bytes == 2 * 1024
    with pytest.raises(ValueError, match="does not fit one staging slab"):
        pool.take(torch.float32, 257, timedelta(seconds=1))


def test_pool_take_waits_for_a_buffer_given_back() -> None:
    pool = PinnedPool(max_bytes=64, slab_bytes=64, pin=False)
    held = pool.take(torch.uint8, 64, timedelta(seconds=1))
    threading.Timer(0.1, pool.give, args=(held,)).start()
    # a take that timed out would raise: getting the buffer back is the proof that it waited for the give
    assert pool.take(torch.uint8, 64, timedelta(seconds=5)).data_ptr() == held.data_ptr()


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
    monkeypatch.delenv("BIMETAL_CF_STRIPES")
    monkeypatch.setenv("BIMETAL_CF_CHUNK_BYTES", "1M")  # the size syntax of bimetal bench comm
    assert CpuForwardOptions().resolved().chunk_bytes == 2**20
    monkeypatch.setenv("BIMETAL_CF_CHUNK_BYTES", "lots")
    with pytest.raises(UserError, match="BIMETAL_CF_CHUNK_BYTES='lots' is not a size"):
        CpuForwardOptions().resolved()


def test_stripe_shares_follow_measured_rates_and_drop_dead_stripes() -> None:
    """Shares converge to equal finish times on links of unequal speed (with a common start-up delay in the
    measurement), keep a floor, and give a dead stripe nothing."""
    from bimetal.comm.cpu_forward.balance import WEIGHT_SCALE, rebalance

    rates = [400.0, 100.0, 400.0]  # bytes per second, arbitrary unit
    nbytes, delay = 64 * 2**20, 0.05
    weights = None
    for _ in range(8):
        plan = chunk_plan(nbytes, 1, 4 * 2**20, 3, weights=weights)
        moved = {s: sum(b - a for a, b, st in plan if st == s) for s in range(3)}
        seconds = {s: delay + moved[s] / (rates[s] * 2**20) for s in range(3)}
        weights = rebalance(weights, 3, 0, moved, seconds)
    assert weights is not None and abs(sum(weights) - WEIGHT_SCALE) <= 3
    finish = [w / rates[s] for s, w in enumerate(weights)]
    assert max(finish) / min(finish) < 1.1, weights  # the slow stripe carries about a ninth, all finish together
    assert rebalance(weights, 3, 0b010, {}, {}) is not None
    assert rebalance(weights, 3, 0b010, {}, {})[1] == 0  # type: ignore[index]
    floor = rebalance([WEIGHT_SCALE, 1, 1], 3, 0, {}, {})
    assert floor is not None and min(floor) >= WEIGHT_SCALE // 30  # about an eighth of an equal share
    assert rebalance(None, 2, 0, {0: 2**20, 1: 2**20}, {0: 1.0, 1: 1.0}) is None  # equal: the plain split


def test_each_cpu_forward_module_imports_alone() -> None:
    """No import circle in cpu-forward (failover never reaches back into ``pg``): each module imports first in a
    process whose bimetal modules are forgotten before each one (torch stays loaded: one process, seconds)."""
    import pkgutil
    import subprocess
    import sys

    import bimetal.comm.cpu_forward as cf

    names = sorted(m.name for m in pkgutil.iter_modules(cf.__path__))
    assert {"pg", "p2p", "collectives", "failover", "links", "status", "chunks", "pipeline", "work",
            "faults"} <= set(names), names
    script = ("import importlib, sys, torch.distributed\n"
              f"for name in {names!r}:\n"
              "    for m in [m for m in sys.modules if m.startswith('bimetal')]:\n"
              "        del sys.modules[m]\n"
              "    importlib.import_module('bimetal.comm.cpu_forward.' + name)\n"
              "    print('ok', name)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split().count("ok") == len(names), proc.stdout


def test_failover_does_not_reach_back_into_the_group() -> None:
    """failover and the pieces below it import neither ``pg`` nor the parts of ``pg`` (not even for types)."""
    import ast
    from pathlib import Path

    import bimetal.comm.cpu_forward as cf

    root = Path(cf.__file__).parent
    for name in ("failover", "links", "status", "chunks", "work", "balance", "stats"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        upward = {m for m in imported if m.rsplit(".", 1)[-1] in ("pg", "p2p", "collectives", "faults")}
        assert not upward, f"cpu_forward/{name}.py imports {sorted(upward)}"


class _FakeGlooWork:
    def __init__(self, fail: str = ""):
        self.fail = fail

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.fail:
            raise RuntimeError(self.fail)
        return True

    def is_completed(self) -> bool:
        return True


class _FakeStripe:
    """Records what cpu-forward posts to its one Gloo stripe; ``fail`` makes the next works fail on wait."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, int, int]] = []
        self.fail = ""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _FakeGlooWork:
        self.posted.append(("send", tensors[0].numel(), dst))
        return _FakeGlooWork(self.fail)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _FakeGlooWork:
        self.posted.append(("recv", tensors[0].numel(), src))
        return _FakeGlooWork(self.fail)


def test_one_message_fast_path_counts_and_words_errors(monkeypatch) -> None:
    """Issue 19: a small contiguous CPU message on one stripe is one Gloo op posted by the group's send/recv
    (no worker, no chunking), its op number and bytes are counted, a Gloo failure names group, op and number,
    and a closed group refuses it; messages the fast path must not take still go the common way."""
    from bimetal.comm.base import TransportError
    from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup
    from bimetal.comm.cpu_forward.work import LeanWork

    monkeypatch.delenv("BIMETAL_CF_CHECKSUM", raising=False)
    stripe = _FakeStripe()
    pg = CpuForwardProcessGroup([stripe], 0, 2, timedelta(seconds=30), CpuForwardOptions(stripes=1).resolved())
    pg.setGroupDesc("unit")
    sent, received = pg.send([torch.ones(1024)], 1, 0), pg.recv([torch.zeros(16, dtype=torch.int64)], 1, 0)
    assert type(sent) is LeanWork and type(received) is LeanWork and sent.wait() and received.wait()
    assert stripe.posted == [("send", 1024, 1), ("recv", 16, 1)]
    stats = pg.comm_stats()
    assert (stats["ops"], stats["bytes_sent"], stats["bytes_received"], stats["bytes_direct"]) == (2, 4096, 128, 4224)

    common = [pg.send([torch.ones(8, 8).t()], 1, 0),  # not contiguous: the common path (a contiguous copy)
              pg.send([torch.ones(4, dtype=torch.bool)], 1, 0),  # bool goes as uint8 bytes: the common path
              pg.send([torch.ones(2 * pg.state.options.chunk_bytes // 4)], 1, 0)]  # over one chunk: chunked
    assert all(type(w) is not LeanWork and w.wait() for w in common)
    assert stripe.posted[2:] == [("send", 64, 1), ("send", 4, 1)] + [("send", pg.state.options.chunk_bytes // 4, 1)] * 2
    assert pg.comm_stats()["ops"] == 5

    stripe.fail = "Connection closed by peer [127.0.0.1]:1234"
    with pytest.raises(TransportError, match=r"group 'unit' send #6 with peer 1 failed: Connection closed by peer"):
        pg.send([torch.ones(3)], 1, 0).wait()
    pg.shutdown()
    with pytest.raises(TransportError, match="shut down"):
        pg.send([torch.ones(3)], 1, 0)


def test_fast_path_work_waits_for_gloo_once_and_words_a_timeout() -> None:
    """The fast path's work (``LeanWork``) waits for its Gloo work exactly once, whoever waits (the caller and
    ``get_future``'s thread at the same time: a second Gloo wait would block on a completion already taken),
    and a Gloo timeout or failure comes out in the op's words."""
    import threading

    from bimetal.comm.base import OpRecord, TransportError, TransportTimeout
    from bimetal.comm.cpu_forward.work import CLOSED_REPORT_WAIT_S, LeanWork

    class Pg:
        timeout = timedelta(seconds=30)
        timeout_s = 30.0
        description = "unit"
        global_ranks = [0, 3]  # the words name the peer's global rank

        waits: list[float | None] = []

        def diagnose(self, op: OpRecord, wait_s: float | None = None) -> str:
            self.waits.append(wait_s)
            return "peer 3 is in send #4"

    class Blocking:
        def __init__(self) -> None:
            self.go, self.waits = threading.Event(), 0

        def wait(self, timeout: timedelta | None = None) -> bool:
            self.waits += 1
            assert self.go.wait(10)
            return True

        def is_completed(self) -> bool:
            return self.go.is_set()

    gloo = Blocking()
    work = LeanWork(Pg(), ("recv", 3, 1), gloo)
    fut = work.get_future()
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    assert not work.is_completed() and not fut.done()
    gloo.go.set()
    waiter.join(10)
    assert work.wait() and fut.wait() is None and work.is_success() and gloo.waits == 1

    class Failing:
        def __init__(self, text: str) -> None:
            self.text = text

        def wait(self, timeout: timedelta | None = None) -> bool:
            raise RuntimeError(self.text)

    late = LeanWork(Pg(), ("recv", 5, 1),
                    Failing("[gloo/transport/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation"))
    with pytest.raises(TransportTimeout, match=r"'unit' recv #5 with peer 3 did not complete within 30 s .*send #4"):
        late.wait()
    assert isinstance(late.exception(), TransportTimeout) and not late.is_success()
    assert Pg.waits == [None]  # a timeout waits the group's default for the peers' reports
    # a closed connection may be the peer's own timeout (it publishes where it is): asked for, with a short wait;
    # Gloo's guess that the peer crashed is left out
    closed = LeanWork(Pg(), ("send", 6, 1), Failing(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically caused by a "
        "remote worker crashing. GLHF!"))
    with pytest.raises(TransportError, match=r"^group 'unit' send #6 with peer 3 failed: Connection closed by peer "
                                             r"\[127.0.0.1\]:1234; peer 3 is in send #4$"):
        closed.wait()
    assert Pg.waits == [None, CLOSED_REPORT_WAIT_S]
    other = LeanWork(Pg(), ("send", 7, 1), Failing("[gloo/transport/tcp/pair.cc:400] Connection refused\nmore"))
    with pytest.raises(TransportError, match=r"^group 'unit' send #7 with peer 3 failed: \[gloo.*refused$"):
        other.wait()
    assert Pg.waits == [None, CLOSED_REPORT_WAIT_S]  # other errors ask no one
