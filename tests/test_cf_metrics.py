"""Transport counters in the trainer's metrics (issue 19, item 3), through ``bimetal train``.

Two simulated ranks, pp=2 across vendors on cpu-forward with two stripes: every step of ``metrics.jsonl``
carries the job's transport counters, the summary sums them, the pool stops allocating after the first step,
nothing fails over, and the bytes the stripes carried add up to the bytes the pipeline sent, split about
evenly between the two stripes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import bimetal, clean_env


@pytest.mark.timeout(200)
def test_train_logs_staging_pool_stripe_and_failover_counters(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = bimetal("train", "--config", "configs/demo.toml", "--simulate", "nvidia:1,amd:1", "--parallel.dp=1",
                   "--training.steps=3", f"--metrics.run_dir={run}", env=clean_env(BIMETAL_CF_STRIPES="2"), timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        t = r["transport"]
        assert t["failovers"] == 0 and t["stripes_dead"] == 0 and t["bytes_staged"] == 0, r  # CPU tensors
        assert len(t["bytes_per_stripe"]) == 2 and sum(t["bytes_per_stripe"]) == r["xvendor_bytes"], r
    assert all(r["transport"]["pool_buffers_allocated"] == 0 for r in rows[1:]), rows  # no allocation per step
    s = json.loads((run / "summary.json").read_text())["transport"]
    assert s["pool_buffers_allocated_after_first_step"] == 0 and s["failovers"] == 0, s
    a, b = s["bytes_per_stripe"]
    assert a + b == sum(r["xvendor_bytes"] for r in rows) and abs(a - b) <= 0.05 * (a + b), s
    assert "transport" in proc.stdout and "pool buffers allocated (0 after step 1), 0 failovers" in proc.stdout
