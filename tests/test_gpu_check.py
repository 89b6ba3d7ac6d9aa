"""``scripts/gpu_check.sh --cpu``: the GPU check end to end on CPU (same code, CPU tensors, staging forced), so
that it cannot rot before a GPU is lent. Nothing here needs a GPU.

The parity rows train FSDP (with activation checkpointing), HSDP, tensor parallelism and the hierarchical
all-reduce on simulated ranks whose native groups take cpu-forward's staged path (on a GPU
``BIMETAL_SIMULATE_DEVICE=cuda``, here ``cpu-staged`` with staging forced: the GPU run's code on CPU tensors),
each step's loss against one process to 1e-4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(400)


def test_gpu_check_runs_end_to_end_in_cpu_mode(tmp_path: Path) -> None:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        env.pop(key, None)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    for op in ("p2p", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather/scatter/barrier"):
        assert rows[f"cf {op} == gloo"]["pass"] is True, rows[f"cf {op} == gloo"]
    assert rows["cf staged through the pool"]["pass"] is True
    assert rows["pool allocations after warm-up"]["pass"] is True
    assert rows["device-direct tcp on device memory"]["pass"] is True
    # where every device-direct buffer is and what the engine was told, and registrations made once
    where = rows["device-direct buffers on the rank's device"]
    assert where["pass"] is True and "on cpu;" in where["value"] and "engine told cpu:" in where["value"], where
    assert rows["device-direct registrations after warm-up"]["pass"] is True
    assert rows["device-direct 8 MiB (rendezvous path)"]["pass"] is True  # above the 4 MiB eager limit
    for transport in ("cf", "device-direct"):
        both = rows[f"{transport} both ways at once, 4 x 2 MiB each way"]
        assert both["pass"] is True and both["value"].count("bit-identical") == 2, both
    parity = [r for name, r in rows.items() if name.startswith("parity: ")]
    assert [r["check"].split(" (")[0] for r in parity] == [
        "parity: FSDP dp_shard=2 + full activation checkpointing", "parity: HSDP replicate 2 x shard 2",
        "parity: tensor parallel tp=2", "parity: hierarchical all-reduce dp=4 over 2 vendors"]
    for r in parity:
        assert r["pass"] is True and "native groups on the staged path" in r["value"], r
    assert "bimetal_sim_native (staged: device tensors)" in (tmp_path / "parity-1.log").read_text()
    placed = rows["transport buffers on the rank's device"]
    assert placed["pass"] is True and "cf pool cpu" in placed["value"], placed
    train = next(r for name, r in rows.items() if name.startswith("demo trainer"))
    assert train["pass"] is True and "loss" in train["value"]
    assert any(name.startswith("bandwidth") for name in rows) and any(name.startswith("overlap") for name in rows)
    assert report["mode"] == "cpu" and "cf p2p == gloo" in proc.stdout  # the table is printed too


def test_gpu_check_reports_a_step_that_outlives_its_timeout(tmp_path: Path) -> None:
    """A hung step is killed with its ranks and becomes a failing row (the table still prints, exit 1); steps
    past the whole budget are rows that say so; a bad --timeout is refused with exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # steps as new interpreters, as on a GPU (the other tests run them forked, the CPU default): the path a GPU run
    # takes is timed out here too, and no step lives long enough to gain from the check's one import of the trainer
    env["BIMETAL_LAUNCH_FORK"] = "0"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path), "--timeout", "1",
                           "--budget", "2.5"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["pass"] for r in rows] == [False] * 6, rows  # transport, demo trainer, the four parity rows
    assert "timed out after 1 s" in rows[0]["value"], rows
    assert all("timed out after" in r["value"] or "budget was spent" in r["value"] for r in rows), rows
    assert "budget was spent" in rows[-1]["value"], rows
    assert (tmp_path / "transport.log").exists()
    bad = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--timeout", "0"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--timeout must be positive" in bad.stderr, bad.stderr


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (dead, holding nothing, its parent not yet reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _hung_pids(out: Path) -> list[int]:
    return [int(p) for f in sorted(out.glob("hang-*.pids")) for p in f.read_text().split()]


def test_a_hung_step_is_ended_whole_and_the_other_rows_are_written(tmp_path: Path) -> None:
    """``scripts/gpu_run.sh check`` rehearsed on the CPU with ``--test-hang transport`` (test only): the transport
    step's two ranks hang, each with a child in a session of its own, ignoring SIGTERM. The step is ended at its
    limit with all four processes, the trainer's row is still measured, both rows are in ``$OUT/gpu_check.md`` as
    they finished, and the run ends within its budget."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, BUDGET="150",
               GPU_CHECK_ARGS="--cpu --only transport,trainer --test-hang transport --limits transport=10 "
                              "--timeout 150")
    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_run.sh"), "check"], env=env, capture_output=True, text=True,
                          timeout=200, cwd=ROOT)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a failing row: the hung step
    table = (tmp_path / "out/gpu_check.md").read_text()
    assert "| transport checks ran | FAIL | timed out after 10 s" in table, table
    assert "| demo trainer 8 steps f32 on CPU | pass | loss" in table, table
    assert took < 150 + 15, took
    with tarfile.open(tmp_path / "out/logs.tar.gz") as logs:
        logs.extractall(tmp_path / "logs", filter="data")
    pids = _hung_pids(tmp_path / "logs/check")
    assert len(pids) == 4 and all(_gone(p) for p in pids), pids
    assert "processes on the GPU after the check: none" in (tmp_path / "out/gpu_run.txt").read_text()


def test_a_check_told_to_stop_ends_the_step_and_keeps_its_rows(tmp_path: Path) -> None:
    """SIGTERM to the check (``timeout`` around the GPU run) while a step hangs: the step's processes end with it
    and the table says why, within seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                             "--only", "trainer", "--test-hang", "trainer", "--timeout", "300"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 90
        while len(_hung_pids(tmp_path)) < 4 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.2)
        assert len(_hung_pids(tmp_path)) == 4, proc.stdout.read() if proc.poll() is not None else "no pids"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 20 and proc.returncode == 1, out
    assert all(_gone(p) for p in _hung_pids(tmp_path))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] is False and "stopped by SIGTERM" in report["rows"][-1]["value"], report
    assert "Stopped (stopped by SIGTERM)" in (tmp_path / "gpu_check.md").read_text()
