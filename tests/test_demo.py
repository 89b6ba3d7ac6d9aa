"""The README's main job, unchanged: ``bimetal train --config configs/demo.toml --simulate nvidia:2,amd:2``.

150 steps of the debug LLaMA-3 over pp=2 across vendors x dp=2 (about 45 s on 2 cores). Checks what a
user watching it would: the group table, a falling loss with no spike above the starting loss, a summary
with tokens/s median and spread, the transport, and bytes moved across vendors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import bimetal

pytestmark = pytest.mark.timeout(400)


def test_demo_trains_150_steps_without_a_spike(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    proc = bimetal("train", "--config", "configs/demo.toml", "--simulate", "nvidia:2,amd:2", f"--metrics.run_dir={run}",
                   timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "pp.dp0" in out and "bimetal_cpu_forward" in out, out[:3000]
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 150 and s["pp_transport"] == "bimetal_cpu_forward"
    assert s["loss_max"] <= s["loss_start"], s  # no spike above the starting loss
    assert s["loss_end"] < s["loss_start"] - 2.0, s  # byte-level loss falls by more than 2 nats
    assert 0 < s["tokens_per_s_min"] <= s["tokens_per_s_median"] <= s["tokens_per_s_max"], s
    assert s["xvendor_bytes"] > 0
    assert "summary" in out and "tokens/s" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 151))
    assert all({"step", "loss", "tokens_per_s"} <= set(r) for r in rows)
