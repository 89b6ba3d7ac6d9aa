"""Rank program of ``scripts/gpu_check.py``: the transport rows of the GPU check, on one rank of two.

Usage (under ``bimetal launch --simulate nvidia:1,amd:1``): ``python gpu_check_rank.py OUT_DIR DEVICE BW_MIB
OVERLAP_MIB DD_MIB BOTH_MIB`` (``DD_MIB``: device-direct's large message, above its 4 MiB eager limit;
``BOTH_MIB``: each message of the traffic both ways at once). Both ranks use ``DEVICE`` (``cuda``: the one GPU,
shared; ``cpu``: CPU tensors, with ``BIMETAL_CF_FORCE_STAGING=1`` set by the caller so the staged code runs).
Writes ``OUT_DIR/rank<r>.json``: a list of rows ``{"check", "pass", "value"}``; ``pass`` is None where a row is
measured but not judged.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the back-ends)
from bimetal.comm.cpu_forward import CpuForwardOptions

MiB = 1 << 20


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def op_cases(rank: int, world: int, ref: Any) -> dict[str, Callable[[Any, Callable, torch.dtype], list[torch.Tensor]]]:
    """name -> fn(group, put, dtype) returning result tensors; ``put`` moves a tensor where the group wants it;
    ``ref``: the plain Gloo group the cpu-forward results are compared with."""
    n = 40_001  # odd; 160 KB of float32: several rounds with 64 KiB chunks

    def p2p(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x, got = put(data(n, dt, rank)), put(torch.empty(n, dtype=dt))
        works = [dist.isend(x, (rank + 1) % world, group=g), dist.irecv(got, (rank - 1) % world, group=g)]
        for w in works:
            assert w is not None
            w.wait()
        return [got]

    def all_reduce(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        out = []
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            x = put(data(n, dt, 10 + rank))
            dist.all_reduce(x, op=op, group=g)
            out.append(x)
        return out

    def broadcast(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(n, dt, 20 + rank))
        dist.broadcast(x, src=world - 1, group=g)
        return [x]

    def reduce(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(n, dt, 30 + rank))
        dist.reduce(x, dst=0, group=g)
        return [x] if rank == 0 else []

    def all_gather(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(n, dt, 40 + rank))
        outs = [put(torch.empty(n, dtype=dt)) for _ in range(world)]
        dist.all_gather(outs, x, group=g)
        flat = put(torch.empty(world * n, dtype=dt))
        dist.all_gather_into_tensor(flat, x, group=g)
        return [*outs, flat]

    def reduce_scatter(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(world * n, dt, 50 + rank))
        out = put(torch.empty(n, dtype=dt))
        dist.reduce_scatter_tensor(out, x, group=g)
        out2 = put(torch.empty(n, dtype=dt))
        dist.reduce_scatter(out2, list(x.chunk(world)), group=g)
        return [out, out2]

    def all_to_all(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(world * n, dt, 60 + rank))
        out = put(torch.empty(world * n, dtype=dt))
        dist.all_to_all_single(out, x, group=g)
        outs = [put(torch.empty(n, dtype=dt)) for _ in range(world)]
        if g is ref:  # plain Gloo lacks the list all-to-all in some torch releases (2.11): the same
            flat = torch.empty(world * n, dtype=dt)  # exchange through all_to_all_single is its reference
            dist.all_to_all_single(flat, x, group=g)
            outs = list(flat.chunk(world))
        else:
            dist.all_to_all(outs, list(x.chunk(world)), group=g)
        return [out, *outs]

    def gather_scatter(g: Any, put: Callable, dt: torch.dtype) -> list[torch.Tensor]:
        x = put(data(n, dt, 70 + rank))
        outs = [put(torch.empty(n, dtype=dt)) for _ in range(world)] if rank == 0 else None
        dist.gather(x, outs, dst=0, group=g)
        y = put(torch.empty(n, dtype=dt))
        ins = [put(data(n, dt, 80 + r)) for r in range(world)] if rank == 0 else None
        dist.scatter(y, ins, src=0, group=g)
        dist.barrier(group=g)
        return [*(outs or []), y]

    return {"p2p": p2p, "all_reduce": all_reduce, "broadcast": broadcast, "reduce": reduce,
            "all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all,
            "gather/scatter/barrier": gather_scatter}


def timed(fn: Callable[[], object], dev: torch.device, repeat: int = 3) -> float:
    """Median seconds of ``fn`` after one warm-up, both ranks starting together."""
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def error_row(check: str, exc: BaseException) -> dict:
    return {"check": check, "pass": False, "value": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def send_recv(g: Any, t: torch.Tensor, rank: int) -> Callable[[], None]:
    def run() -> None:
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank, group=g)
    return run


DD_CHECKS = ("device-direct tcp on device memory", "device-direct buffers on the rank's device",
             "device-direct registrations after warm-up")


def device_direct_rows(dev: torch.device, rank: int) -> tuple[list[dict], Any]:
    """The device-direct rows (``DD_CHECKS``), each rank's half, and the group (None when it could not be made or
    failed); a failure is a failing row on all three."""
    try:
        dd = dist.new_group(backend="bimetal_device_direct", pg_options={"host": "127.0.0.1", "protocol": "tcp"})
        msg = data(4 * MiB // 4, torch.float32, 90).to(dev)
        into = torch.empty_like(msg)
        send_recv(dd, msg if rank == 0 else into, rank)()
        st = dd.comm_stats()  # type: ignore[attr-defined]
        # Mooncake's TCP transport has no GPU path: it copies device memory through host buffers inside the
        # engine, which the group counts as staged (bytes_engine_bounced). Judged: the data, and that bimetal
        # itself staged nothing on top of the engine's bounce.
        own = st["bytes_staged"] - st["bytes_engine_bounced"]
        same = rank == 0 or torch.equal(into.cpu(), msg.cpu())
        rows = [{"check": DD_CHECKS[0], "pass": same and own == 0,
                 "value": ("sent" if rank == 0 else f"data {'bit-identical' if same else 'DIFFERENT'}")
                          + f", {own} bytes staged by bimetal, {st['bytes_engine_bounced'] / MiB:.1f} MiB "
                            "through host inside Mooncake's TCP engine"}]
        # every buffer and stream of the group on this rank's device, and the engine told so in its own names
        # (cuda:N, hip:N on the ROCm build, cpu:<NUMA node> for host memory)
        report = dd.device_report()  # type: ignore[attr-defined]
        names = [n for n in report.pop("engine locations").split(",") if n]
        if dev.type == "cuda":
            want = re.compile(rf"{'hip' if torch.version.hip else 'cuda'}:{dev.index or 0}")
        else:
            want = re.compile(r"cpu:\d+|\*")
        places = sorted(set(report.values()))
        ok = places == [str(dev)] and bool(names) and all(want.fullmatch(n) for n in names)
        rows.append({"check": DD_CHECKS[1], "pass": ok,
                     "value": f"{len(report)} buffers/streams on {', '.join(places)}; engine told {', '.join(names)}"})
        # memory registered once: rendezvous messages into one reused buffer, fresh tensors sent
        inbox = torch.empty(5 * MiB // 4, device=dev)
        counts = []
        for k in range(11):
            out = data(5 * MiB // 4, torch.float32, 100 + k).to(dev) if rank == 0 else inbox
            send_recv(dd, out, rank)()
            counts.append(dd.comm_stats()["engine_registrations"])  # type: ignore[attr-defined]
        rows.append({"check": DD_CHECKS[2], "pass": counts[0] == counts[-1],
                     "value": f"{counts[0]} after the first 5 MiB message, {counts[-1]} after 10 more"})
        return rows, dd
    except Exception as exc:  # rows, not a crash: the table still prints
        return [error_row(check, exc) for check in DD_CHECKS], None


def both_ways(g: Any, n: int, rounds: int, dev: torch.device, rank: int) -> tuple[bool, float]:
    """Each rank sends and receives at once (as the two stages do in steady 1F1B: activations one way, gradients
    the other), ``rounds`` times; (every message bit-identical, seconds)."""
    ok = True
    dist.barrier()
    sync(dev)
    t0 = time.perf_counter()
    for i in range(rounds):
        x = data(n, torch.float32, 100 + 10 * i + rank).to(dev)
        y = torch.empty(n, device=dev)
        works = [dist.isend(x, 1 - rank, group=g), dist.irecv(y, 1 - rank, group=g)]
        for w in works:
            assert w is not None
            w.wait()
        ok = ok and torch.equal(y.cpu(), data(n, torch.float32, 100 + 10 * i + 1 - rank))
    sync(dev)
    return ok, time.perf_counter() - t0


BOTH_ROUNDS = 4


def both_name(transport: str, mib: int) -> str:
    return f"{transport} both ways at once, {BOTH_ROUNDS} x {mib} MiB each way"


def both_ways_row(name: str, g: Any, mib: int, dev: torch.device, rank: int) -> dict:
    rounds = BOTH_ROUNDS
    ok, took = both_ways(g, mib * MiB // 4, rounds, dev, rank)
    return {"check": both_name(name, mib), "pass": ok,
            "value": f"{'bit-identical' if ok else 'DIFFERENT'}, {2 * rounds * mib / 1024 / took:.2f} GiB/s both "
                     f"directions together (not judged)"}


def main() -> None:
    out_dir, device, bw_mib, ov_mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dd_mib, both_mib = int(sys.argv[5]), int(sys.argv[6])
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.new_group(backend="gloo")
    small = dist.new_group(backend="bimetal_cpu_forward", pg_options=CpuForwardOptions(stripes=1, chunk_bytes=64 << 10))
    cf = dist.new_group(backend="bimetal_cpu_forward", pg_options=CpuForwardOptions(stripes=1))
    rows: list[dict] = []

    # 1. every op on device tensors, bit-identical to Gloo on the same data (host copies)
    for name, fn in op_cases(rank, world, ref).items():
        bad = []
        try:
            for dt in (torch.float32, torch.bfloat16, torch.int64):
                got = [t.cpu() for t in fn(small, lambda t: t.to(dev), dt)]
                want = fn(ref, lambda t: t, dt)
                if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                    bad.append(str(dt)[6:])
        except Exception as exc:  # a failing row, not a crash: the other ops still run and the table prints
            rows.append(error_row(f"cf {name} == gloo", exc))
            dist.barrier()
            continue
        rows.append({"check": f"cf {name} == gloo", "pass": not bad,
                     "value": "bit-identical (f32, bf16, i64)" if not bad else f"differs: {', '.join(bad)}"})
    staged = small.comm_stats()["bytes_staged"]  # type: ignore[attr-defined]
    rows.append({"check": "cf staged through the pool", "pass": staged > 0, "value": f"{staged / MiB:.1f} MiB"})

    # 2. bandwidth of a BW_MIB send: cpu-forward on device tensors vs plain Gloo on host tensors
    n = bw_mib * MiB // 4
    t_cf = timed(send_recv(cf, torch.ones(n, device=dev), rank), dev)
    t_gloo = timed(send_recv(ref, torch.ones(n), rank), dev)
    rows.append({"check": f"bandwidth {bw_mib} MiB staged vs gloo", "pass": None,
                 "value": f"{bw_mib / 1024 / t_cf:.2f} vs {bw_mib / 1024 / t_gloo:.2f} GiB/s "
                          f"(ratio {t_gloo / t_cf:.2f})"})

    # 3. overlap: one chunked send vs the sum of its copies and its wire time
    n = ov_mib * MiB // 4
    src = torch.ones(n, device=dev)
    host = torch.empty(n, pin_memory=dev.type == "cuda")
    t_send = timed(send_recv(cf, src, rank), dev, 2)
    t_wire = timed(send_recv(ref, host, rank), dev, 2)
    t_copy = timed(lambda: host.copy_(src, non_blocking=True), dev, 2)  # one way on this rank
    ratio = t_send / (t_wire + t_copy * 2)  # device -> host at the sender, host -> device at the receiver
    rows.append({"check": f"overlap {ov_mib} MiB send / (copies + wire)",
                 "pass": ratio < 1.0 if dev.type == "cuda" else None,
                 "value": f"{t_send:.3f} s / ({2 * t_copy:.3f} + {t_wire:.3f} s) = {ratio:.2f}"
                          + ("" if dev.type == "cuda" else " (CPU copy double is synchronous: not judged)")})

    # 4. pool allocations flat after warm-up
    x, y = torch.ones(300_000, device=dev), torch.empty(300_000, device=dev)
    outs = [torch.empty(300_000, device=dev) for _ in range(world)]

    def mixed() -> None:
        works = [dist.isend(x, 1 - rank, group=cf), dist.irecv(y, 1 - rank, group=cf)]
        for w in works:
            assert w is not None
            w.wait()
        dist.all_reduce(x, group=cf)
        dist.all_gather(outs, x, group=cf)
    mixed()
    before = cf.comm_stats()["pool_buffers_allocated"]  # type: ignore[attr-defined]
    for _ in range(20):
        mixed()
    after = cf.comm_stats()["pool_buffers_allocated"]  # type: ignore[attr-defined]
    rows.append({"check": "pool allocations after warm-up", "pass": after == before,
                 "value": f"{before} slabs after warm-up, {after} after 20 more rounds"})

    # 5. traffic both ways at once on cpu-forward (device tensors, staged), as in steady 1F1B
    try:
        rows.append(both_ways_row("cf", cf, both_mib, dev, rank))
    except Exception as exc:
        rows.append(error_row(both_name("cf", both_mib), exc))
        dist.barrier()

    # 6. device-direct on device memory over Mooncake's TCP protocol: nothing staged, every buffer on this
    # rank's device, memory registered once
    dd_rows, dd = device_direct_rows(dev, rank)
    rows += dd_rows
    if dd is not None:
        # 7. its large-message path: above the eager limit the receiver's tensor is registered and written into
        # (rendezvous), so nothing is copied out of a landing slot
        try:
            msg = data(dd_mib * MiB // 4, torch.float32, 91).to(dev)
            into = torch.zeros_like(msg)
            landed = dd.comm_stats()["landing_copy_bytes"]  # type: ignore[attr-defined]
            send_recv(dd, msg if rank == 0 else into, rank)()
            landed = dd.comm_stats()["landing_copy_bytes"] - landed  # type: ignore[attr-defined]
            same = rank == 0 or torch.equal(into.cpu(), msg.cpu())
            rows.append({"check": f"device-direct {dd_mib} MiB (rendezvous path)", "pass": same and landed == 0,
                         "value": ("sent" if rank == 0 else f"data {'bit-identical' if same else 'DIFFERENT'}")
                                  + f", {landed} bytes copied from landing slots"})
        except Exception as exc:
            rows.append(error_row(f"device-direct {dd_mib} MiB (rendezvous path)", exc))
            dist.barrier()
        # 8. both ways at once on device-direct
        try:
            rows.append(both_ways_row("device-direct", dd, both_mib, dev, rank))
        except Exception as exc:
            rows.append(error_row(both_name("device-direct", both_mib), exc))
            dist.barrier()
    else:
        rows += [{"check": f"device-direct {dd_mib} MiB (rendezvous path)", "pass": False,
                  "value": "no device-direct group (see the row above)"},
                 {"check": both_name("device-direct", both_mib), "pass": False,
                  "value": "no device-direct group (see the row above)"}]

    # 9. every buffer, stream and pool of both transports on this rank's device (bimetal.topology.local_device):
    # the receive slots and copy stream of device-direct, the pinned pool of cpu-forward (the one GPU is shared)
    try:
        if dd is None:
            raise RuntimeError("no device-direct group (see the rows above)")
        stream = dd.proxy.transfers._stream  # type: ignore[attr-defined]
        where = {"cf pool": cf.state.pool.device,  # type: ignore[attr-defined]
                 "dd slots": next(iter(dd.proxy.transfers.pools.values())).device,  # type: ignore[attr-defined]
                 "dd stream": stream.device if stream is not None else torch.device("cpu")}
        rows.append({"check": "transport buffers on the rank's device", "pass": all(d == dev for d in where.values()),
                     "value": ", ".join(f"{k} {v}" for k, v in where.items())})
    except Exception as exc:
        rows.append(error_row("transport buffers on the rank's device", exc))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from bimetal.entry import run_command

    sys.exit(run_command("gpu-check", lambda argv: main(), sys.argv[1:]))
