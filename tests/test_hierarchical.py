"""Hierarchical all-reduce (native reduce-scatter, cross-vendor all-reduce of shards, native all-gather)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import launch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(150)


def test_hierarchical_equals_flat_all_reduce(tmp_path: Path) -> None:
    proc = launch("nvidia:2,amd:2", HERE / "hier_rank.py", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(4):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["has_groups"], res
        assert res["island_backend"] == "bimetal_sim_native" and res["cross_backend"] == "bimetal_cpu_forward"
        assert res["errors"] == [], res
