"""The device-direct process group between two real processes: the real Mooncake engine over TCP loopback.

Each test starts two ranks against a TCPStore hosted here; every rank checks its own half and writes a JSON
verdict, so a failure names the rank and the check. The ranks are new processes forked from one server process
that imported torch and bimetal once for the whole file (multiprocessing's ``forkserver``, as bimetal's launcher
forks simulated ranks with torch already imported): each rank starts clean of the test process's state without
paying an interpreter start and a torch import (~3 s of CPU) per rank.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import engine_unavailable
from launcher import rank_exit
from torch import nn

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(engine_unavailable() is not None, reason=str(engine_unavailable()))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
SIZES = [1, 3, 4096, 1 << 20, (4 << 20) + 5, 9 << 20]  # bytes: eager, chunk edge, multi-chunk rendezvous
CHUNK = 4 << 20


def _payload(dtype: torch.dtype, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    # random bit patterns (NaNs and infinities included): "bit-identical" is checked on the bytes
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _join_world(rank: int, port: int, timeout_s: float, group: bool = True) -> dist.ProcessGroup:
    torch.set_num_threads(1)
    os.environ.update(BIMETAL_DD_HOST="127.0.0.1", BIMETAL_DD_PROTOCOL="tcp", GLOG_minloglevel="2")
    import bimetal  # noqa: F401  (registers the back-ends)

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if not group:
        return dist.group.WORLD
    return dist.new_group([0, 1], backend="bimetal_device_direct", timeout=timedelta(seconds=timeout_s))


def _rank(rank: int, port: int, scenario: str, out: str) -> None:
    try:
        _scenario(rank, port, scenario, out)
    finally:
        rank_exit()


def _scenario(rank: int, port: int, scenario: str, out: str) -> None:
    verdict: dict = {"ok": False}
    try:
        verdict = SCENARIOS[scenario](rank, port)
        verdict.setdefault("ok", True)
    except BaseException as exc:  # noqa: BLE001 - the verdict carries the traceback back to the test
        verdict = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(out, f"r{rank}.json").write_text(json.dumps(verdict))
    if scenario not in ("killed", "sender_leaves"):
        dist.destroy_process_group()


def _exchange(rank: int, port: int) -> dict:
    pg = _join_world(rank, port, 60)
    peer = 1 - rank
    checked = 0
    # every dtype and size, both directions: rank 0 sends first, then rank 1
    for dtype in DTYPES:
        for i, nbytes in enumerate(SIZES):
            for sender in (0, 1):
                seed = zlib.crc32(f"{dtype}/{nbytes}/{sender}".encode())
                want = _payload(dtype, nbytes, seed)
                if rank == sender:
                    dist.send(want, peer, group=pg, tag=i)
                else:
                    got = torch.empty_like(want)
                    dist.recv(got, peer, group=pg, tag=i)
                    assert _same_bits(got, want), f"{dtype} {nbytes} B from rank {sender} differs"
                    checked += 1
    big = _payload(torch.uint8, 256 << 20, 7)
    if rank == 0:
        dist.send(big, 1, group=pg)
    else:
        got = torch.empty_like(big)
        dist.recv(got, 0, group=pg)
        assert _same_bits(got, big), "256 MiB message differs"
        checked += 1
    # memory registered once: rendezvous messages into one reused buffer (fresh tensors sent) register it once
    inbox, seen = torch.empty((4 << 20) + 5, dtype=torch.uint8), set()
    for k in range(10):
        want = _payload(torch.uint8, inbox.numel(), 500 + k)
        if rank == 0:
            dist.send(want, 1, group=pg, tag=7)
        else:
            dist.recv(inbox, 0, group=pg, tag=7)
            assert _same_bits(inbox, want), f"reused-buffer message {k} differs"
        seen.add(pg.comm_stats()["engine_registrations"])
    assert len(seen) == 1, f"registrations grew with the messages: {sorted(seen)}"
    # the engine was told where the memory is by its own names (cpu:<NUMA node>), not the bare "cpu"
    assert re.fullmatch(r"(cpu:\d+|\*)(,(cpu:\d+|\*))*", pg.device_report()["engine locations"]), pg.device_report()
    # many messages in flight both ways (as 1F1B makes): more than the credits, eager and rendezvous mixed
    sizes = [(k * 977) % (6 << 20) + 1 for k in range(48)]
    ops, recvs = [], []
    for k, n in enumerate(sizes):
        mine = _payload(torch.uint8, n, 1000 * rank + k)
        recvs.append((torch.empty(n, dtype=torch.uint8), _payload(torch.uint8, n, 1000 * peer + k)))
        ops.append(dist.P2POp(dist.isend, mine, peer, pg, tag=k % 3))
        ops.append(dist.P2POp(dist.irecv, recvs[-1][0], peer, pg, tag=k % 3))
    works = dist.batch_isend_irecv(ops)
    assert all(w is not None for w in works)
    for w in works:
        w.wait()
    assert all(_same_bits(got, want) for got, want in recvs), "a message in flight arrived corrupted"
    # the futures resolve to the tensors (what DDP-style callers chain on)
    t = torch.full((3,), float(rank))
    fut = (pg.send([t], peer, 9) if rank == 0 else pg.recv([t], peer, 9)).get_future()
    assert fut.wait()[0] is t and t.tolist() == [0.0, 0.0, 0.0]
    # collectives a pp group sees, built on p2p
    x = torch.tensor([1.0 + rank, 10.0])
    dist.all_reduce(x, group=pg)
    assert x.tolist() == [3.0, 20.0], x
    dist.barrier(group=pg)
    stats = pg.comm_stats()
    assert stats["bytes_staged"] == 0, stats
    # every byte went one of the three ways, none through a host bounce: engine writes (eager, rendezvous) or
    # inside a notification (small host tensors); all three were taken
    assert stats["bytes_direct"] + stats["bytes_inline_sent"] == stats["bytes_sent"], stats
    assert stats["bytes_direct"] > (256 << 20 if rank == 0 else 0), stats
    assert stats["bytes_inline_sent"] > 0 and stats["landing_copy_bytes"] > 0, stats
    proxy = pg.proxy
    dist.destroy_process_group(pg)
    assert not proxy.alive, "the proxy thread outlived destroy_process_group"
    assert not [th for th in threading.enumerate() if th.name.startswith("bimetal-dd-proxy")]
    return {"checked": checked, "stats": stats}


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def _pipeline(rank: int, port: int) -> dict:
    from bimetal.train.pipeline import PipelineRunner

    dd = _join_world(rank, port, 60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    grads = {}
    for name, group in (("gloo", dist.group.WORLD), ("dd", dd)):
        stage = _layers()[2 * rank: 2 * rank + 2]
        ex = torch.zeros(2, 16)
        runner = PipelineRunner(stage, rank, 2, group, 4, "1f1b", lambda o, t: ((o - t) ** 2).mean(),
                                torch.device("cpu"), ex, ex)
        loss = runner.step(x if rank == 0 else None, y if rank == 1 else None)
        grads[name] = [p.grad.clone() for p in stage.parameters()] + [loss]
    assert all(torch.equal(a, b) for a, b in zip(grads["gloo"], grads["dd"])), "1F1B gradients differ from Gloo"
    assert dd.comm_stats()["bytes_staged"] == 0 and dd.comm_stats()["bytes_sent"] > 0
    return {"loss": float(grads["dd"][-1])}


def _killed(rank: int, port: int) -> dict:
    pg = _join_world(rank, port, 8)
    dist.barrier(group=pg)
    if rank == 1:
        os._exit(0)  # dies without a word: no shutdown, no notification
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(16), 1, group=pg)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return {"error": str(exc), "seconds": time.monotonic() - t0, "alive_after": _close(pg)}
    raise AssertionError("recv from a dead peer returned")


def _sender_leaves(rank: int, port: int) -> dict:
    pg = _join_world(rank, port, 20)
    msgs = [_payload(torch.uint8, n, n) for n in (3, 4096, 1 << 20)]  # inline, inline, eager
    dist.barrier(group=pg)
    if rank == 0:  # sends and leaves at once: the messages are out, its connections end right after
        for tag, m in enumerate(msgs):
            dist.send(m, 1, group=pg, tag=tag)
        os._exit(0)
    time.sleep(1.5)  # the sender is gone before any recv is posted
    got = [torch.empty_like(m) for m in msgs]
    for tag, g in enumerate(got):
        dist.recv(g, 0, group=pg, tag=tag)
    assert all(_same_bits(g, m) for g, m in zip(got, msgs)), "a message of the departed sender differs"
    try:
        dist.recv(torch.empty(4), 0, group=pg, tag=9)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return {"after": str(exc)}
    raise AssertionError("a recv from a peer that left returned")


def _close(pg: dist.ProcessGroup) -> bool:
    pg.shutdown()
    return pg.proxy.alive


def _fallback(rank: int, port: int) -> dict:
    from bimetal.comm.device_direct import EngineUnavailableError
    from bimetal.errors import UserError

    _join_world(rank, port, 30, group=False)
    # only rank 1 cannot start its engine (rdma asked, no verbs device): both ranks must take the same decision
    protocol = "rdma" if rank == 1 else "tcp"
    try:
        dist.new_group([0, 1], backend="bimetal_device_direct", pg_options={"protocol": protocol})
    except EngineUnavailableError as exc:
        assert isinstance(exc, UserError)
        refused = str(exc)
    else:
        raise AssertionError("the error policy built a group although rank 1 has no engine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pg = dist.new_group([0, 1], backend="bimetal_device_direct",
                            pg_options={"protocol": protocol, "fallback": "cpu-forward"})
    t = torch.arange(5.0) if rank == 0 else torch.zeros(5)
    (dist.send if rank == 0 else dist.recv)(t, 1 - rank, group=pg)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    return {"refused": refused, "warnings": [str(w.message) for w in caught], "backend": type(pg).__name__}


def _mismatch(rank: int, port: int) -> dict:
    pg = _join_world(rank, port, 20)
    errors = []
    # a rendezvous send into a small recv, then an eager send into a rendezvous recv: every side that waits
    # fails with both sizes named, well before the timeout
    for tag, (sent, posted) in enumerate([(5 << 20, 1 << 20), (1 << 20, 5 << 20)]):
        t0 = time.monotonic()
        try:
            if rank == 0:
                dist.send(torch.zeros(sent, dtype=torch.uint8), 1, group=pg, tag=tag)
            else:
                dist.recv(torch.zeros(posted, dtype=torch.uint8), 0, group=pg, tag=tag)
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            errors.append((tag, str(exc), time.monotonic() - t0))
    dist.barrier()
    return {"errors": errors}


SCENARIOS = {"exchange": _exchange, "mismatch": _mismatch, "pipeline": _pipeline, "killed": _killed,
             "fallback": _fallback, "sender_leaves": _sender_leaves}


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    """The server the ranks fork from: started by the first test with torch and bimetal imported, stopped and
    waited for when the file is done (no process left to the worker's next file, and its ranks' CPU time, which
    it reaped, counts for this file)."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "bimetal"])
    yield
    multiprocessing.forkserver._forkserver._stop()  # no public way to stop it before the interpreter exits


def _spawn(scenario: str, tmp_path: Path) -> list[dict]:
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.start_processes(_rank, args=(store.port, scenario, str(tmp_path)), nprocs=2, start_method="forkserver",
                             join=False)
    while not ctx.join(timeout=100):  # a rank that fails raises here; the test's timeout bounds the wait
        pass
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("r*.json"))]


def test_all_dtypes_sizes_in_flight_and_zero_staged(tmp_path: Path) -> None:
    verdicts = _spawn("exchange", tmp_path)
    assert len(verdicts) == 2
    for r, v in enumerate(verdicts):
        assert v["ok"], f"rank {r}: {v.get('trace') or v}"
    assert verdicts[0]["checked"] + verdicts[1]["checked"] == 2 * len(DTYPES) * len(SIZES) + 1


def test_1f1b_over_device_direct_matches_gloo(tmp_path: Path) -> None:
    verdicts = _spawn("pipeline", tmp_path)
    for r, v in enumerate(verdicts):
        assert v["ok"], f"rank {r}: {v.get('trace') or v}"


def test_killed_peer_fails_the_survivor_naming_it(tmp_path: Path) -> None:
    verdicts = _spawn("killed", tmp_path)
    survivor = verdicts[0]
    assert survivor["ok"], survivor
    assert "peer rank 1" in survivor["error"] and "recv" in survivor["error"], survivor["error"]
    # the dead process's control connection ends, so the survivor knows at once, not at the 8 s timeout
    assert survivor["seconds"] < 3, survivor
    assert survivor["alive_after"] is False


def test_messages_of_a_sender_that_left_are_still_received(tmp_path: Path) -> None:
    verdicts = _spawn("sender_leaves", tmp_path)
    (receiver,) = [v for v in verdicts if "after" in v or "error" in v]
    assert receiver["ok"], receiver
    assert "peer rank 0" in receiver["after"] and "closed its control connection" in receiver["after"], receiver


def test_size_mismatch_fails_with_both_sizes(tmp_path: Path) -> None:
    v0, v1 = _spawn("mismatch", tmp_path)
    assert v0["ok"] and v1["ok"], (v0, v1)
    big, small = str(5 << 20), str(1 << 20)
    (tag0, sender, s0), = v0["errors"]  # the eager send of case 2 completes: it waits for nobody
    assert tag0 == 0 and big in sender and small in sender and s0 < 10, v0
    assert [e[0] for e in v1["errors"]] == [0, 1], v1
    for _, text, seconds in v1["errors"]:
        assert big in text and small in text and seconds < 10, v1


def test_engine_missing_on_one_rank_errors_or_falls_back_on_all(tmp_path: Path) -> None:
    pytest.importorskip("bimetal.comm.cpu_forward")
    v0, v1 = _spawn("fallback", tmp_path)
    assert v0["ok"] and v1["ok"], (v0, v1)
    assert "global rank 1" in v0["refused"] and "verbs device" in v0["refused"], v0["refused"]
    assert "this rank" in v1["refused"] and "BIMETAL_DD_FALLBACK=cpu-forward" in v1["refused"], v1["refused"]
    for v in (v0, v1):
        assert v["backend"] == "CpuForwardProcessGroup", v
        assert any("falls back to cpu-forward" in w for w in v["warnings"]), v["warnings"]
