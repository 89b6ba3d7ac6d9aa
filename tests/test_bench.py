"""The benchmarks of ``bimetal/bench`` through the commands users type: ``bimetal bench comm`` starts its two
simulated ranks (``python -m bimetal.bench.comm``) and writes its report; the old module names say where
the benchmarks went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import bimetal

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


def test_bench_comm_retired_cpp_ceiling_is_an_unknown_transport_in_one_sentence(tmp_path: Path) -> None:
    proc = bimetal("bench", "comm", "--sizes", "4K", "--transports", "gloo,cpp-ceiling", "--out",
                   str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "bad benchmark arguments (transports ['cpp-ceiling']" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists(), proc.stderr
