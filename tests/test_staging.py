# ruff: noqa: B023  (each check function is called at once, inside its loop iteration)
"""The staged (device-tensor) paths of cpu-forward, run on CPU with staging forced: the pool bounded by bytes,
rounds for a collective that needs more than the bound, allocations flat after warm-up.

CPU tensors have no copy engine: ``staging.HostCopyDouble`` (a test double for the device copy streams)
copies synchronously; everything above it (pool, round planner, pipelining, Gloo ops) is the code device
tensors run. The 16-rank world is 16 threads of this process, each with a real ``CpuForwardProcessGroup``
over real Gloo (loopback TCP): one rank's list all-gather needs 17 buffers of one shape, more than the old
per-shape cap (``pool_buffers`` = 2), and here has only two slabs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launcher import clean_env, launch, run_threads
from test_op_table import ROWS

from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup
from bimetal.comm.cpu_forward.staging import ALIGN, CALLER_DOUBLE, DoubleEvent, HostCopyDouble, PinnedPool, plan_rounds
from bimetal.comm.striping import CpuForwardOptions, build_stripes

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.timeout(120)
TIMEOUT = timedelta(seconds=60)


def test_rounds_of_a_16_rank_all_gather_fit_one_slab_each() -> None:
    slab, unit = 64 * 1024, 1 << 18  # 1 MiB of float32 per rank: 17 MiB of staging in one piece
    ranges = plan_rounds(unit, 17, 4, slab)
    assert ranges[0][0] == 0 and ranges[-1][1] == unit
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))  # contiguous, in order
    for a, b in ranges:
        assert 17 * (-(-(b - a) * 4 // ALIGN) * ALIGN) <= slab
    assert len(ranges) == -(-unit // ranges[0][1]) > 17 * 4 * unit // slab - 1
    with pytest.raises(ValueError, match="cannot hold 2000 pieces"):
        plan_rounds(10, 2000, 8, 64 * 1024)


def _world(size: int, body: Callable[[CpuForwardProcessGroup, dist.ProcessGroup, int], None],
           opts: CpuForwardOptions) -> None:
    """Run ``body(cf_group, gloo_reference, rank)`` on ``size`` threads, each rank with forced staging."""
    store = dist.HashStore()

    def rank(r: int) -> None:
        stripes = build_stripes(dist.PrefixStore("cf", store), r, size, TIMEOUT, [None] * opts.stripes)
        (ref,) = build_stripes(dist.PrefixStore("ref", store), r, size, TIMEOUT, [None])
        pg = CpuForwardProcessGroup(stripes, r, size, TIMEOUT, opts)
        pg.state.stage_all = True  # what BIMETAL_CF_FORCE_STAGING=1 sets at creation
        try:
            body(pg, ref, r)
        finally:
            pg.shutdown()

    run_threads(rank, size, join_s=100)


def test_16_rank_all_gather_runs_in_rounds_in_two_slabs_and_allocations_stay_flat() -> None:
    opts = CpuForwardOptions(stripes=1, chunk_bytes=16 * 1024, pool_buffers=2).resolved()
    seen: dict[int, tuple[int, int, int]] = {}

    def body(pg: CpuForwardProcessGroup, ref: dist.ProcessGroup, r: int) -> None:
        assert isinstance(pg.state.streams.pair(torch.device("cpu"))[0], HostCopyDouble)
        g = torch.Generator().manual_seed(r)
        x = torch.randn(10_000, generator=g)  # 40 KB per rank, 17 pieces: 680 KB of staging vs 32 KB of pool
        outs = [torch.empty_like(x) for _ in range(16)]
        pg.allgather([outs], [x]).wait()
        want = [torch.empty_like(x) for _ in range(16)]
        ref.allgather([want], [x]).wait()
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        warm = pg.state.pool.allocations
        y = torch.arange(300, dtype=torch.int64) * (r + 1)
        flat = torch.empty(16 * 300, dtype=torch.int64)
        for _ in range(20):  # a pool that grew per call, or per round, shows within a few calls
            pg._allgather_base(flat, y).wait()
        assert torch.equal(flat.view(16, 300), torch.arange(300) * torch.arange(1, 17).view(16, 1))
        seen[r] = (warm, pg.state.pool.allocations, pg.state.pool.held_bytes)

    _world(16, body, opts)
    assert len(seen) == 16
    for warm, end, held in seen.values():
        assert 1 <= warm <= 2 and end == warm and held <= 2 * 16 * 1024


def test_staged_collectives_and_p2p_match_gloo_bit_for_bit() -> None:
    """Every staged collective formulation (several rounds each, two stripes) against plain Gloo, 3 ranks."""
    opts = CpuForwardOptions(stripes=2, chunk_bytes=1024, pool_buffers=4).resolved()  # send + recv: 2 slabs each
    size = 3

    def body(pg: CpuForwardProcessGroup, ref: dist.ProcessGroup, r: int) -> None:
        g = torch.Generator().manual_seed(10 + r)
        n = 9000  # 36 KB of float32 per rank; 3 or 6 pieces in 64 KiB slabs (two stripes): several rounds
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            x = (torch.randn(n, generator=g) * 100).to(dtype)
            checks: list[tuple[str, Callable[[Callable], torch.Tensor]]] = []

            def ar(group: Callable) -> torch.Tensor:
                t = x.clone()
                group("allreduce", [t]).wait()
                return t
            checks.append(("allreduce", ar))

            def agt(group: Callable) -> torch.Tensor:
                out = torch.empty(size * n, dtype=dtype)
                group("_allgather_base", out, x).wait()
                return out
            checks.append(("all_gather_into_tensor", agt))

            def rst(group: Callable) -> torch.Tensor:
                inp = torch.cat([x] * size) * 1
                out = torch.empty(n, dtype=dtype)
                group("_reduce_scatter_base", out, inp).wait()
                return out
            checks.append(("reduce_scatter_tensor", rst))

            def a2a(group: Callable) -> torch.Tensor:
                inp = torch.cat([x[:999]] * size)
                out = torch.empty_like(inp)
                group("alltoall_base", out, inp, [], []).wait()
                return out
            checks.append(("all_to_all_single", a2a))

            def bc(group: Callable) -> torch.Tensor:
                t = x.clone()
                o = dist.BroadcastOptions()
                o.rootRank = 1
                group("broadcast", [t], o).wait()
                return t
            checks.append(("broadcast", bc))
            for name, check in checks:
                got = check(lambda m, *a: getattr(pg, m)(*a))
                want = check(lambda m, *a: getattr(ref, m)(*a))
                assert torch.equal(got, want), (name, dtype, r)
            strided = x.clone().view(90, 100).t()  # non-contiguous: staged from a contiguous copy, copied back
            pg.allreduce([strided]).wait()
            want_s = x.clone()
            ref.allreduce([want_s]).wait()
            # (3 ranks: Gloo's ring sums an element in an order that depends on its position, so floats are close)
            want_t = want_s.view(90, 100).t()
            atol = 4.0 if dtype == torch.bfloat16 else 1e-3  # bf16: one ulp at the sums' magnitude
            assert torch.equal(strided, want_t) if dtype == torch.int32 else \
                torch.allclose(strided.float(), want_t.float(), rtol=1e-2, atol=atol), ("strided allreduce", dtype, r)
        # point to point over the staged paths (a ring)
        t = torch.arange(50_000, dtype=torch.float32) + r
        got = torch.empty_like(t)
        works = [pg.send([t], (r + 1) % size, 0), pg.recv([got], (r - 1) % size, 0)]
        for w in works:
            w.wait()
        assert torch.equal(got, torch.arange(50_000, dtype=torch.float32) + (r - 1) % size)
        assert pg.comm_stats()["bytes_staged"] > 0

    _world(size, body, opts)


def test_uneven_all_to_all_runs_in_rounds_under_the_pool_bound_and_matches_gloo() -> None:
    """All-to-all with uneven splits (single tensor, rows of a 2-D tensor, and lists), each call needing far more
    staging than the pool's two slabs: it proceeds in rounds (parts that end early move nothing in later rounds)
    and is bit-identical to plain Gloo; the pool never holds more than its bound."""
    opts = CpuForwardOptions(stripes=1, chunk_bytes=4096, pool_buffers=2).resolved()
    size = 3
    held: list[tuple[int, int, int]] = []

    def body(pg: CpuForwardProcessGroup, ref: dist.ProcessGroup, r: int) -> None:
        g = torch.Generator().manual_seed(40 + r)
        rows = [[700, 0, 2100], [5, 1300, 64], [999, 1, 0]]  # rows[src][dst]: peer r sends rows[r][p] to p
        split_in = rows[r]
        split_out = [rows[p][r] for p in range(size)]
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = (torch.randn(sum(split_in), 3, generator=g) * 100).to(dtype)  # 3 elements a row
            got = torch.empty(sum(split_out), 3, dtype=dtype)
            want = torch.empty_like(got)
            pg.alltoall_base(got, x, split_out, split_in).wait()
            ref.alltoall_base(want, x, split_out, split_in).wait()
            assert torch.equal(got, want), ("all_to_all_single", dtype, r)
            ins = [(torch.arange(rows[r][p] * 2, dtype=torch.float32) * (r + 1) + p).to(dtype) for p in range(size)]
            outs = [torch.empty(rows[p][r] * 2, dtype=dtype) for p in range(size)]
            pg.alltoall(outs, ins).wait()
            # (Gloo's list all-to-all refuses parts of different lengths: its single-tensor one is the reference)
            ref_flat = torch.empty(sum(t.numel() for t in outs), dtype=dtype)
            ref.alltoall_base(ref_flat, torch.cat(ins), [t.numel() for t in outs], [t.numel() for t in ins]).wait()
            assert torch.equal(torch.cat(outs), ref_flat), ("all_to_all", dtype, r)
        held.append((pg.state.pool.held_bytes, pg.state.pool.max_bytes, pg.comm_stats()["bytes_staged"]))

    _world(size, body, opts)
    assert len(held) == size
    for nbytes, bound, staged in held:
        assert 0 < nbytes <= bound == 2 * 4096 and staged > 4 * bound  # rounds, not one slab for the whole call


@pytest.mark.parametrize("stripes", [1, 2])
def test_wait_on_a_staged_op_orders_the_callers_stream_instead_of_synchronizing(stripes: int) -> None:
    """``Work.wait()`` of a staged all-reduce and a staged receive: the op's end event (recorded on the
    host-to-device stream double after its last copies) is what the caller's current stream double was made
    to wait for, by ``wait()`` and not before, and nobody called ``synchronize`` on it. (``HostCopyDouble``
    stands in for the copy and current streams; on a GPU the same calls go to ``torch.cuda``.)"""
    opts = CpuForwardOptions(stripes=stripes, chunk_bytes=4096, pool_buffers=8).resolved()
    checked: list[int] = []

    def ordered(pg: CpuForwardProcessGroup, work: dist.Work) -> None:
        end = work.end  # type: ignore[attr-defined]
        assert end is not None and end.device == torch.device("cpu")
        work.get_future().wait()  # completed: the end event is set, the caller's stream not yet ordered on it
        event = end.event
        assert isinstance(event, DoubleEvent) and event.stream is pg.state.streams.pair(torch.device("cpu"))[1]
        assert not any(e is event for e in CALLER_DOUBLE.waited)
        work.wait()
        assert any(e is event for e in CALLER_DOUBLE.waited) and event.synchronized == 0

    def body(pg: CpuForwardProcessGroup, ref: dist.ProcessGroup, r: int) -> None:
        x = torch.arange(20_000, dtype=torch.float32) * (r + 1)
        work = pg.allreduce([x])
        ordered(pg, work)
        assert work.get_future().value() == [x] and torch.equal(x, torch.arange(20_000, dtype=torch.float32) * 3)
        t = torch.arange(30_000, dtype=torch.int32) + r
        if r == 0:
            pg.send([t], 1, 0).wait()
        else:
            got = torch.empty_like(t)
            work = pg.recv([got], 0, 0)
            ordered(pg, work)
            assert torch.equal(got, t - 1)
        checked.append(r)

    _world(2, body, opts)
    assert sorted(checked) == [0, 1]


def test_pool_bound_is_bytes_not_a_shape() -> None:
    pool = PinnedPool(max_bytes=3 * 4096, slab_bytes=4096, pin=False)
    held = [pool.take(dt, 4096 // torch.empty((), dtype=dt).element_size(), TIMEOUT)
            for dt in (torch.float32, torch.float16, torch.int64)]
    assert pool.try_take(torch.uint8, 1) is None and pool.held_bytes == 3 * 4096
    for h in held:
        pool.give(h)
    assert pool.try_take(torch.int8, 4096) is not None and pool.allocations == 3
    # a slab announced as returning (an op completed for its caller, its last copies still running) is waited
    # for rather than a new one allocated
    pool = PinnedPool(max_bytes=2 * 4096, slab_bytes=4096, pin=False)
    first = pool.take(torch.uint8, 4096, TIMEOUT)
    pool.returning(1)
    assert pool.try_take(torch.uint8, 1) is None
    timer = threading.Timer(0.2, lambda: pool.give(first, expected=True))
    timer.start()
    again = pool.take(torch.float32, 1024, TIMEOUT)
    timer.join()
    assert again.data_ptr() == first.data_ptr() and pool.allocations == 1
    assert pool.try_take(torch.uint8, 1) is not None and pool.allocations == 2  # nothing returning: allocates


def test_op_table_with_staging_forced_matches_gloo(tmp_path) -> None:
    """``op_table_rank``'s every row on cpu-forward (1 and 2 stripes) with ``BIMETAL_CF_FORCE_STAGING=1``, through
    the user's entry point (``bimetal launch --simulate``)."""
    proc = launch("nvidia:1,amd:1", HERE / "staged_table_rank.py", str(tmp_path),
                  env=clean_env(BIMETAL_CF_FORCE_STAGING="1"), timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for f in sorted(tmp_path.glob("rank*.json")):
        rows = json.loads(f.read_text())
        for transport in ("cpu-forward/k1", "cpu-forward/k2"):
            mine = [r for r in rows if r["transport"] == transport]
            assert len(mine) == ROWS[transport] + 2, (f.name, transport, len(mine))  # + the two staging.* rows
            bad = [f"{r['case']}: {r['detail']}" for r in mine if not r["ok"]]
            assert not bad, f"{f.name} {transport}: " + "\n".join(bad[:10])
    assert len(list(tmp_path.glob("rank*.json"))) == 2


def test_staged_async_ops_do_not_block_the_calling_thread() -> None:
    """A staged send returns its Work at once, before the peer has even posted the receive."""
    opts = CpuForwardOptions(stripes=1, chunk_bytes=4096, pool_buffers=4).resolved()
    posted = threading.Event()
    returned: list[bool] = []

    def body(pg: CpuForwardProcessGroup, ref: dist.ProcessGroup, r: int) -> None:
        t = torch.arange(100_000, dtype=torch.float32)
        if r == 0:
            work = pg.send([t], 1, 0)
            returned.append(not work.is_completed())  # the receiver has not posted yet: cannot be done
            posted.set()
            work.wait()
        else:
            assert posted.wait(30)
            got = torch.empty_like(t)
            pg.recv([got], 0, 0).wait()
            assert torch.equal(got, t)

    _world(2, body, opts)
    assert returned == [True]
