# ruff: noqa: B023  (each case function is called at once, inside its loop iteration)
"""Rank program of the operation table: every op x dtype on every transport, compared with plain Gloo.

Usage (under ``bimetal launch``): ``python op_table_rank.py OUT_DIR``. Writes ``OUT_DIR/rank<r>.json`` with
one entry per case: ``{"transport": ..., "case": ..., "ok": bool, "detail": str, "seconds": float}``.
Not collected by pytest (no ``test_`` prefix); ``test_op_table.py`` drives it.

One table, one row per operation, run on each group under test and on a reference Gloo group; a row passes
when both give the same result. The groups under test (``TRANSPORTS``):

* ``gloo`` (2 ranks): a second Gloo group; checks the table itself against the reference (a row that Gloo
  cannot run, or whose two runs differ, is a bad row).
* ``cpu-forward/k1``, ``cpu-forward/k2``: one and two stripes (small chunks: several per message, uneven
  split). At more than 2 ranks only ``k2`` runs (``k1`` is its degenerate case, already run at 2 ranks).
* ``device-direct`` (2 ranks): the point-to-point rows and the collectives it builds on them (broadcast,
  all_reduce, barrier), over the Mooncake engine on TCP loopback.

Each transport declares the kinds of rows it runs (``p2p``, ``basic`` = broadcast/all_reduce/barrier, ``all``
= every other collective, ``bimetal`` = bimetal's own error messages, ``strided`` = non-contiguous tensors in
point-to-point, which cpu-forward takes and Gloo and device-direct refuse, ``unsupported`` = a collective the
transport does not do, refused with the sentence of ``bimetal.comm.base``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the back-ends)
from bimetal.comm.cpu_forward import CpuForwardOptions

torch.set_num_threads(1)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]
FLOATS = {torch.float32, torch.bfloat16, torch.float16}
EVERY_KIND = {"p2p", "basic", "all", "bimetal", "strided"}
DESCS = {"gloo": "gloo", "cpu-forward/k1": "cf1", "cpu-forward/k2": "cf2", "device-direct": "dd"}  # group_desc


def data(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 7, shape, generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if exact or a.dtype not in FLOATS:
        return "" if torch.equal(a, b) else f"not bit-identical (max diff {(a.double() - b.double()).abs().max()})"
    try:
        torch.testing.assert_close(a, b)
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    return ""


def groups_under_test(world: int) -> dict[str, tuple[dist.ProcessGroup, set[str]]]:
    """transport name -> (its group over every rank, the kinds of rows it runs); ``DESCS`` names the groups."""
    out: dict[str, tuple[dist.ProcessGroup, set[str]]] = {}
    if world == 2:
        out["gloo"] = (dist.new_group(backend="gloo", group_desc=DESCS["gloo"]), {"p2p", "basic", "all"})
    for k in (1, 2) if world == 2 else (2,):
        opts = CpuForwardOptions(stripes=k, interfaces=["lo"] * k, chunk_bytes=4096)
        out[f"cpu-forward/k{k}"] = (dist.new_group(backend="bimetal_cpu_forward", group_desc=DESCS[f"cpu-forward/k{k}"],
                                                   pg_options=opts), EVERY_KIND)
    if world == 2:
        dd = dist.new_group(backend="bimetal_device_direct", group_desc=DESCS["device-direct"],
                            pg_options={"host": "127.0.0.1", "protocol": "tcp"})
        out["device-direct"] = (dd, {"p2p", "basic", "bimetal", "unsupported"})  # refuses non-contiguous tensors
    return out


def main() -> None:
    out_dir = sys.argv[1]
    os.environ.setdefault("GLOG_minloglevel", "2")  # the Mooncake engine's start-up lines
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.new_group(backend="gloo")
    results = []
    for transport, (g, kinds) in groups_under_test(world).items():
        run_table(transport, g, kinds, ref, rank, world, results)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_table(transport: str, g: dist.ProcessGroup, kinds: set[str], ref: dist.ProcessGroup, rank: int,
              world: int, results: list[dict]) -> None:
    """Every row of the table whose kind ``transport`` runs, on ``g`` and on ``ref``; appends to ``results``."""
    desc = DESCS[transport]  # the description the group was created with

    def case(name: str, kind: str, fn) -> None:
        if kind not in kinds:
            return
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as exc:  # a failing case is a result, not a crash of the whole session
            detail = f"{type(exc).__name__}: {exc} {traceback.format_exc(limit=3)[-400:]}"
        results.append({"transport": transport, "case": name, "ok": not detail, "detail": detail or "",
                        "seconds": round(time.perf_counter() - t0, 3)})

    n = 3001  # odd, > chunk: several chunks over both stripes, uneven split
    for dt in DTYPES:
        tag = str(dt)[6:]
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
        if dt in FLOATS:
            ops.append(dist.ReduceOp.AVG)
        for op in ops:
            def allreduce(op=op, dt=dt):
                x = data((n,), dt, 100 + rank)
                if op == dist.ReduceOp.PRODUCT and dt in FLOATS:
                    x = (x.float().abs() * 0.1 + 0.95).to(dt)
                a, b = x.clone(), x.clone()
                dist.all_reduce(a, op=op, group=g)
                dist.all_reduce(b, op=op, group=ref)
                return same(a, b, exact=world == 2 and op != dist.ReduceOp.AVG)
            case(f"{tag}.all_reduce.{op}", "basic", allreduce)

        def broadcast(dt=dt):
            a = data((7, 501), dt, 200 + rank)
            b = a.clone()
            dist.broadcast(a, src=world - 1, group=g)
            dist.broadcast(b, src=world - 1, group=ref)
            return same(a, b, True)
        case(f"{tag}.broadcast", "basic", broadcast)

        def all_gather(dt=dt):
            x = data((1001,), dt, 300 + rank)
            a = [torch.empty_like(x) for _ in range(world)]
            b = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(a, x, group=g)
            dist.all_gather(b, x, group=ref)
            return same(torch.stack(a), torch.stack(b), True)
        case(f"{tag}.all_gather", "all", all_gather)

        def all_gather_into_tensor(dt=dt):
            x = data((1001,), dt, 400 + rank)
            a, b = torch.empty(world * 1001, dtype=dt), torch.empty(world * 1001, dtype=dt)
            dist.all_gather_into_tensor(a, x, group=g)
            dist.all_gather_into_tensor(b, x, group=ref)
            return same(a, b, True)
        case(f"{tag}.all_gather_into_tensor", "all", all_gather_into_tensor)

        def reduce_scatter(dt=dt):
            xs = [data((513,), dt, 500 + rank * 10 + i) for i in range(world)]
            a, b = torch.empty(513, dtype=dt), torch.empty(513, dtype=dt)
            dist.reduce_scatter(a, [x.clone() for x in xs], group=g)
            dist.reduce_scatter(b, [x.clone() for x in xs], group=ref)
            return same(a, b, world == 2)
        case(f"{tag}.reduce_scatter", "all", reduce_scatter)

        def reduce_scatter_tensor(dt=dt):
            x = data((world * 513,), dt, 600 + rank)
            a, b = torch.empty(513, dtype=dt), torch.empty(513, dtype=dt)
            dist.reduce_scatter_tensor(a, x.clone(), group=g)
            dist.reduce_scatter_tensor(b, x.clone(), group=ref)
            return same(a, b, world == 2)
        case(f"{tag}.reduce_scatter_tensor", "all", reduce_scatter_tensor)

        def all_to_all_single(dt=dt):
            splits_in = [(rank + j) % 3 + 1 for j in range(world)]  # uneven splits
            splits_out = [(j + rank) % 3 + 1 for j in range(world)]
            x = data((sum(splits_in),), dt, 700 + rank)
            a, b = torch.empty(sum(splits_out), dtype=dt), torch.empty(sum(splits_out), dtype=dt)
            dist.all_to_all_single(a, x, splits_out, splits_in, group=g)
            dist.all_to_all_single(b, x, splits_out, splits_in, group=ref)
            return same(a, b, True)
        case(f"{tag}.all_to_all_single", "all", all_to_all_single)

        def scatter_gather(dt=dt):
            src = [data((99,), dt, 800 + i) for i in range(world)] if rank == 0 else None
            a, b = torch.empty(99, dtype=dt), torch.empty(99, dtype=dt)
            dist.scatter(a, src, src=0, group=g)
            dist.scatter(b, src, src=0, group=ref)
            err = same(a, b, True)
            ga = [torch.empty(99, dtype=dt) for _ in range(world)] if rank == 1 else None
            gb = [torch.empty(99, dtype=dt) for _ in range(world)] if rank == 1 else None
            dist.gather(a, ga, dst=1, group=g)
            dist.gather(b, gb, dst=1, group=ref)
            if rank == 1:
                err = err or same(torch.stack(ga), torch.stack(gb), True)
            return err
        case(f"{tag}.scatter_gather", "all", scatter_gather)

        def reduce(dt=dt):
            x = data((777,), dt, 900 + rank)
            a, b = x.clone(), x.clone()
            dist.reduce(a, dst=0, group=g)
            dist.reduce(b, dst=0, group=ref)
            return same(a, b, world == 2) if rank == 0 else ""
        case(f"{tag}.reduce", "all", reduce)

        def p2p(dt=dt):
            # a ring with batch_isend_irecv and an empty tensor, plus a non-contiguous one where the transport
            # takes it (kind "strided")
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            x = data((n,), dt, 1000 + rank)
            y = data((64, 33), dt, 1100 + rank).t()  # non-contiguous
            got_x, got_y, got_e = torch.empty(n, dtype=dt), torch.empty(33, 64, dtype=dt), torch.empty(0, dtype=dt)
            ops = [dist.P2POp(dist.isend, x, nxt, g), dist.P2POp(dist.irecv, got_x, prv, g),
                   dist.P2POp(dist.isend, torch.empty(0, dtype=dt), nxt, g),
                   dist.P2POp(dist.irecv, got_e, prv, g)]
            strided = "strided" in kinds
            if strided:
                ops += [dist.P2POp(dist.isend, y, nxt, g), dist.P2POp(dist.irecv, got_y, prv, g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return (same(got_x, data((n,), dt, 1000 + prv), True)
                    or (strided and same(got_y, data((64, 33), dt, 1100 + prv).t(), True)) or "")
        case(f"{tag}.p2p_ring", "p2p", p2p)

    def bool_p2p():
        if world != 2:
            return ""
        x = torch.arange(5000) % 3 == 0
        if rank == 0:
            dist.send(x, 1, group=g)
            return ""
        got = torch.zeros(5000, dtype=torch.bool)
        dist.recv(got, 0, group=g)
        return same(got, x, True)
    case("bool.send_recv", "p2p", bool_p2p)

    def async_future():
        x = torch.full((2048,), float(rank + 1))
        w = dist.all_reduce(x, group=g, async_op=True)
        value = w.get_future().wait()
        w.wait()
        expect = float(world * (world + 1) / 2)
        ok = torch.equal(x, torch.full((2048,), expect))
        return "" if ok and value is not None else f"future result {value!r}, tensor {x[:3]}"
    case("async_get_future", "basic", async_future)

    def barrier_and_names():
        dist.barrier(group=g)
        name = g.group_name
        return "" if name and g.group_desc == desc else f"name {name!r} desc {g.group_desc!r}"
    case("barrier_names", "basic", barrier_and_names)

    def unsupported_dtype():
        try:
            dist.all_reduce(torch.zeros(2, dtype=torch.float8_e5m2), group=g)
        except Exception as exc:
            return "" if "float8_e5m2 is not supported" in str(exc) and f"'{desc}'" in str(exc) else str(exc)
        return "float8 all_reduce was accepted"
    case("unsupported_dtype", "bimetal", unsupported_dtype)

    def unsupported_op():
        x = torch.ones(4)
        try:
            dist.all_gather_into_tensor(torch.empty(4 * world), x, group=g)
        except Exception as exc:
            want = (f"group '{desc}': all_gather_into_tensor is not supported by bimetal_device_direct; "
                    "bimetal_cpu_forward does it")
            return "" if type(exc).__name__ == "UnsupportedOperation" and want in str(exc) else repr(exc)
        return "all_gather_into_tensor was accepted"
    case("unsupported_op", "unsupported", unsupported_op)


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
