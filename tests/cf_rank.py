# ruff: noqa: B023  (each case function is called at once, inside its loop iteration)
"""Rank program for the cpu-forward tests: runs every case on cpu-forward and on plain Gloo, compares.

Usage (under ``bimetal launch``): ``python cf_rank.py OUT_DIR``. Writes ``OUT_DIR/rank<r>.json`` with one
entry per case: ``{"case": ..., "ok": bool, "detail": str}``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the back-ends)
from bimetal.comm.cpu_forward import CpuForwardOptions

torch.set_num_threads(1)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]
FLOATS = {torch.float32, torch.bfloat16, torch.float16}


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


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.new_group(backend="gloo")
    groups = {k: dist.new_group(backend="bimetal_cpu_forward", group_desc=f"cf{k}",
                                pg_options=CpuForwardOptions(stripes=k, interfaces=["lo"] * k, chunk_bytes=4096))
              for k in (1, 2)}
    results = []

    def case(name: str, fn) -> None:
        try:
            detail = fn()
        except Exception as exc:  # a failing case is a result, not a crash of the whole session
            detail = f"{type(exc).__name__}: {exc} {traceback.format_exc(limit=3)[-400:]}"
        results.append({"case": name, "ok": not detail, "detail": detail or ""})

    n = 3001  # odd, > chunk: several chunks over both stripes, uneven split
    for k, g in groups.items():
        for dt in DTYPES:
            tag = f"k{k}.{str(dt)[6:]}"
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
                case(f"{tag}.all_reduce.{op}", allreduce)

            def broadcast(dt=dt):
                a = data((7, 501), dt, 200 + rank)
                b = a.clone()
                dist.broadcast(a, src=world - 1, group=g)
                dist.broadcast(b, src=world - 1, group=ref)
                return same(a, b, True)
            case(f"{tag}.broadcast", broadcast)

            def all_gather(dt=dt):
                x = data((1001,), dt, 300 + rank)
                a = [torch.empty_like(x) for _ in range(world)]
                b = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(a, x, group=g)
                dist.all_gather(b, x, group=ref)
                return same(torch.stack(a), torch.stack(b), True)
            case(f"{tag}.all_gather", all_gather)

            def all_gather_into_tensor(dt=dt):
                x = data((1001,), dt, 400 + rank)
                a, b = torch.empty(world * 1001, dtype=dt), torch.empty(world * 1001, dtype=dt)
                dist.all_gather_into_tensor(a, x, group=g)
                dist.all_gather_into_tensor(b, x, group=ref)
                return same(a, b, True)
            case(f"{tag}.all_gather_into_tensor", all_gather_into_tensor)

            def reduce_scatter(dt=dt):
                xs = [data((513,), dt, 500 + rank * 10 + i) for i in range(world)]
                a, b = torch.empty(513, dtype=dt), torch.empty(513, dtype=dt)
                dist.reduce_scatter(a, [x.clone() for x in xs], group=g)
                dist.reduce_scatter(b, [x.clone() for x in xs], group=ref)
                return same(a, b, world == 2)
            case(f"{tag}.reduce_scatter", reduce_scatter)

            def reduce_scatter_tensor(dt=dt):
                x = data((world * 513,), dt, 600 + rank)
                a, b = torch.empty(513, dtype=dt), torch.empty(513, dtype=dt)
                dist.reduce_scatter_tensor(a, x.clone(), group=g)
                dist.reduce_scatter_tensor(b, x.clone(), group=ref)
                return same(a, b, world == 2)
            case(f"{tag}.reduce_scatter_tensor", reduce_scatter_tensor)

            def all_to_all_single(dt=dt):
                splits_in = [(rank + j) % 3 + 1 for j in range(world)]  # uneven splits
                splits_out = [(j + rank) % 3 + 1 for j in range(world)]
                x = data((sum(splits_in),), dt, 700 + rank)
                a, b = torch.empty(sum(splits_out), dtype=dt), torch.empty(sum(splits_out), dtype=dt)
                dist.all_to_all_single(a, x, splits_out, splits_in, group=g)
                dist.all_to_all_single(b, x, splits_out, splits_in, group=ref)
                return same(a, b, True)
            case(f"{tag}.all_to_all_single", all_to_all_single)

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
            case(f"{tag}.scatter_gather", scatter_gather)

            def reduce(dt=dt):
                x = data((777,), dt, 900 + rank)
                a, b = x.clone(), x.clone()
                dist.reduce(a, dst=0, group=g)
                dist.reduce(b, dst=0, group=ref)
                return same(a, b, world == 2) if rank == 0 else ""
            case(f"{tag}.reduce", reduce)

            def p2p(dt=dt):
                # a ring with batch_isend_irecv, plus a non-contiguous tensor and an empty one
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                x = data((n,), dt, 1000 + rank)
                y = data((64, 33), dt, 1100 + rank).t()  # non-contiguous
                got_x, got_y, got_e = torch.empty(n, dtype=dt), torch.empty(33, 64, dtype=dt), torch.empty(0, dtype=dt)
                ops = [dist.P2POp(dist.isend, x, nxt, g), dist.P2POp(dist.irecv, got_x, prv, g),
                       dist.P2POp(dist.isend, y, nxt, g), dist.P2POp(dist.irecv, got_y, prv, g),
                       dist.P2POp(dist.isend, torch.empty(0, dtype=dt), nxt, g),
                       dist.P2POp(dist.irecv, got_e, prv, g)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return (same(got_x, data((n,), dt, 1000 + prv), True)
                        or same(got_y, data((64, 33), dt, 1100 + prv).t(), True))
            case(f"{tag}.p2p_ring", p2p)

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
        case(f"k{k}.bool.send_recv", bool_p2p)

        def async_future():
            x = torch.full((2048,), float(rank + 1))
            w = dist.all_reduce(x, group=g, async_op=True)
            value = w.get_future().wait()
            w.wait()
            expect = float(world * (world + 1) / 2)
            ok = torch.equal(x, torch.full((2048,), expect))
            return "" if ok and value is not None else f"future result {value!r}, tensor {x[:3]}"
        case(f"k{k}.async_get_future", async_future)

        def barrier_and_names():
            dist.barrier(group=g)
            name = g.group_name
            return "" if name and g.group_desc == f"cf{k}" else f"name {name!r} desc {g.group_desc!r}"
        case(f"k{k}.barrier_names", barrier_and_names)

        def unsupported_dtype():
            try:
                dist.all_reduce(torch.zeros(2, dtype=torch.float8_e5m2), group=g)
            except Exception as exc:
                return "" if "float8_e5m2 is not supported" in str(exc) and f"'cf{k}'" in str(exc) else str(exc)
            return "float8 all_reduce was accepted"
        case(f"k{k}.unsupported_dtype", unsupported_dtype)

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
