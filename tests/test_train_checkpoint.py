"""Single-process checks of atomic checkpoints and of the metrics log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bimetal.errors import UserError
from bimetal.train import checkpoint
from bimetal.train.metrics import StepMetrics, cluster_peak_flops, peak_flops

pytestmark = pytest.mark.timeout(60)
META = {"family": "llama3", "flavour": "debug", "layers_per_stage": [3, 1], "dp": 2}


def test_save_load_roundtrip_and_half_written_ignored(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    checkpoint.save(tmp_path, 10, {"model": lin.state_dict()}, {"data": {"consumed": 7}, "rng": checkpoint.rng_state()},
                    META)
    # A crash mid-save leaves a folder without the marker; it must not be picked.
    (tmp_path / "step-000020").mkdir()
    (tmp_path / ".tmp-step-000030").mkdir()
    path = checkpoint.latest(tmp_path)
    assert path is not None and path.name == "step-000010"
    want = {k: v.clone() for k, v in lin.state_dict().items()}
    other = torch.nn.Linear(4, 3)
    sd = other.state_dict()
    extra = checkpoint.load(path, {"model": sd}, rank=0)
    other.load_state_dict(sd)
    assert all(torch.equal(other.state_dict()[k], want[k]) for k in want)
    assert extra["data"]["consumed"] == 7
    checkpoint.check_meta(path, META)
    with pytest.raises(UserError, match="flavour"):
        checkpoint.check_meta(path, {**META, "flavour": "llama3-8b"})


def test_metrics_jsonl_and_unknown_mfu(tmp_path: Path) -> None:
    assert peak_flops(None) is None and peak_flops("cpu") is None
    m = StepMetrics(tmp_path, 0, flops_per_token=1e6, peak=None)
    m.log(1, 5.0, 1000, 0.5, 1e-3, 1.0, 0.1, 2048)
    m.log(2, 4.0, 1000, 0.25, 1e-3, 1.0, 0.1, 2048)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["tokens_per_s"] == 4000 and recs[0]["mfu"] is None
    s = m.summary("cpu-forward")
    assert s["loss_start"] == 5.0 and s["loss_end"] == 4.0 and s["xvendor_bytes"] == 4096


def test_mfu_uses_summed_peak_and_refuses_partial_tables(tmp_path: Path) -> None:
    h100 = peak_flops("NVIDIA H100 80GB HBM3")
    assert h100 is not None and cluster_peak_flops(["NVIDIA H100 80GB HBM3"] * 2) == 2 * h100
    # One unknown device makes the whole job's MFU unknown rather than a number over a partial peak.
    assert cluster_peak_flops(["NVIDIA H100 80GB HBM3", "cpu (simulated amd)"]) is None
    m = StepMetrics(tmp_path, 0, flops_per_token=1e9, peak=2 * h100)
    rec = m.log(1, 5.0, 1000, 0.5, 1e-3, 1.0, 0.0, 0)
    assert rec["mfu"] == 2000 * 1e9 / (2 * h100)
