"""``scripts/gpu_check.sh --cpu``: the GPU check end to end on CPU (same code, CPU tensors, staging forced), so
that it cannot rot before a GPU is lent. Nothing here needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(200)


def test_gpu_check_runs_end_to_end_in_cpu_mode(tmp_path: Path) -> None:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        env.pop(key, None)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    for op in ("p2p", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather/scatter/barrier"):
        assert rows[f"cf {op} == gloo"]["pass"] is True, rows[f"cf {op} == gloo"]
    assert rows["cf staged through the pool"]["pass"] is True
    assert rows["pool allocations after warm-up"]["pass"] is True
    assert rows["device-direct tcp, nothing staged"]["pass"] is True
    train = next(r for name, r in rows.items() if name.startswith("demo trainer"))
    assert train["pass"] is True and "loss" in train["value"]
    assert any(name.startswith("bandwidth") for name in rows) and any(name.startswith("overlap") for name in rows)
    assert report["mode"] == "cpu" and "cf p2p == gloo" in proc.stdout  # the table is printed too
