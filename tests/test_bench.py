"""The benchmarks of ``bimetal/bench`` through the commands users type: ``bimetal bench comm`` starts its two
simulated ranks (``python -m bimetal.bench.comm``) and writes its report; the old module names say where
the benchmarks went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compiler_unavailable
from launcher import bimetal, clean_env

pytestmark = pytest.mark.timeout(120)


def test_bench_comm_runs_its_ranks_and_writes_the_report(tmp_path: Path) -> None:
    proc = bimetal("bench", "comm", "--sizes", "4K", "--iters", "2", "--stripes", "1", "--transports",
                   "gloo,cpu-forward,py-ceiling", "--out", str(tmp_path), timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_comm.json").read_text())
    assert "gloo" in proc.stdout and "cpu-forward x1" in proc.stdout and report, proc.stdout
    # the Python ceiling beside both: what the fast path's bookkeeping costs, and what only leaving Python would win
    assert {"cpu-forward x1 / gloo latency @ 4KiB", "py-ceiling / gloo latency @ 4KiB",
            "cpu-forward x1 / py-ceiling latency @ 4KiB"} <= set(report["ratios"]), report["ratios"]
    # --iters 2 is raised for a 4 KiB message, and the output says so (not a silent change of what was written)
    assert "200 samples (not --iters 2) for sizes up to 64 KiB" in proc.stdout, proc.stdout
    assert all(len(r["samples_s"]) == 200 for r in report["rows"]), [len(r["samples_s"]) for r in report["rows"]]


@pytest.mark.timeout(300)
def test_bench_comm_cpp_ceiling_builds_its_group_and_reports_it_beside_gloo_and_py_ceiling(tmp_path: Path) -> None:
    why = compiler_unavailable()
    if why:
        pytest.skip(why)
    # built on first use (about 25 s on 2 cores; torch's extension cache keeps it for later runs)
    proc = bimetal("bench", "comm", "--sizes", "4K,64K", "--iters", "2", "--stripes", "1", "--transports",
                   "gloo,cpu-forward,py-ceiling,cpp-ceiling", "--out", str(tmp_path), timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_comm.json").read_text())
    assert {"cpp-ceiling / gloo latency @ 4KiB", "cpp-ceiling / gloo bandwidth @ 64KiB",
            "cpu-forward x1 / cpp-ceiling bandwidth @ 64KiB", "py-ceiling / cpp-ceiling bandwidth @ 64KiB",
            } <= set(report["ratios"]), report["ratios"]
    # the compiled group delivered every sample (a delivery returns only once the peer's acknowledgement is in)
    rows = [r for r in report["rows"] if r["variant"] == "cpp-ceiling"]
    assert [r["bytes"] for r in rows] == [4096, 65536] and all(
        len(r["samples_s"]) == 200 and min(r["samples_s"]) > 0 for r in rows), rows


def test_bench_comm_cpp_ceiling_without_a_compiler_says_what_to_install(tmp_path: Path) -> None:
    env = clean_env(PATH=str(tmp_path))  # no c++ and no ninja on PATH
    proc = bimetal("bench", "comm", "--sizes", "4K", "--transports", "gloo,cpp-ceiling", "--out",
                   str(tmp_path / "out"), env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "needs c++ and ninja on PATH (Debian: apt-get install g++ ninja-build)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists(), proc.stderr
