"""Single-process checks of atomic checkpoints (damaged ones skipped, pruning) and of the metrics log."""

from __future__ import annotations

import json
import shutil
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


def test_a_fresh_run_keeps_an_earlier_runs_metrics_beside_its_own(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A run from step 0 in a folder whose metrics.jsonl holds an earlier run's records (no checkpoints, so no
    resume) moves them to metrics.1.jsonl, then metrics.2.jsonl, saying so; an empty file is not kept."""
    for n, loss in enumerate((5.0, 4.0, 3.0)):
        m = StepMetrics(tmp_path, 0, flops_per_token=1e6, peak=None)
        m.log(1, loss, 1000, 0.5, 1e-3, 1.0, 0.1, 2048)
        if n:
            assert f"of an earlier run in this folder is kept as metrics.{n}.jsonl" in capsys.readouterr().out
    kept = {p.name: json.loads(p.read_text())["loss"] for p in tmp_path.glob("metrics*.jsonl")}
    assert kept == {"metrics.1.jsonl": 5.0, "metrics.2.jsonl": 4.0, "metrics.jsonl": 3.0}
    (tmp_path / "metrics.jsonl").write_text("")
    StepMetrics(tmp_path, 0, flops_per_token=1e6, peak=None)
    assert "kept as" not in capsys.readouterr().out and not (tmp_path / "metrics.3.jsonl").exists()


def test_mfu_uses_summed_peak_and_refuses_partial_tables(tmp_path: Path) -> None:
    h100 = peak_flops("NVIDIA H100 80GB HBM3")
    assert h100 is not None and cluster_peak_flops(["NVIDIA H100 80GB HBM3"] * 2) == 2 * h100
    # One unknown device makes the whole job's MFU unknown rather than a number over a partial peak.
    assert cluster_peak_flops(["NVIDIA H100 80GB HBM3", "cpu (simulated amd)"]) is None
    m = StepMetrics(tmp_path, 0, flops_per_token=1e9, peak=2 * h100)
    rec = m.log(1, 5.0, 1000, 0.5, 1e-3, 1.0, 0.0, 0)
    assert rec["mfu"] == 2000 * 1e9 / (2 * h100)


def _save(root: Path, step: int, lin: torch.nn.Linear) -> Path:
    return checkpoint.save(root, step, {"model": lin.state_dict()}, {"step": step}, META)


def test_damaged_newest_checkpoint_is_skipped_with_one_sentence(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    for step in (10, 20, 30):
        _save(tmp_path, step, lin)
    data = sorted((tmp_path / "step-000030" / "stage0").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-5])  # cut short, as by a full disk or a copy that stopped
    (tmp_path / "step-000020" / "extra-rank0.json").unlink()
    warnings: list[str] = []
    assert checkpoint.latest(tmp_path, warn=warnings.append) == tmp_path / "step-000010"
    assert len(warnings) == 2 and all(w.count(". ") == 0 and w.endswith("resuming from step-000010 instead.")
                                      for w in warnings)
    assert "step-000030 is damaged (stage0/" in warnings[0] and "bytes, " in warnings[0]
    assert "step-000020 is damaged (extra-rank0.json is missing)" in warnings[1]
    # a checkpoint written before the marker listed its files (marker = the step) is taken as it is
    (tmp_path / "step-000010" / checkpoint.MARKER).write_text("10")
    assert checkpoint.damage(tmp_path / "step-000010") is None
    shutil.rmtree(tmp_path / "step-000010")
    warnings.clear()
    assert checkpoint.latest(tmp_path, warn=warnings.append) is None and "no intact checkpoint is left" in warnings[-1]


def test_damage_that_keeps_sizes_is_one_sentence_at_load(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    path = _save(tmp_path, 10, lin)
    meta = path / "stage0" / ".metadata"
    meta.write_bytes(bytes(len(meta.read_bytes())))
    assert checkpoint.damage(path) is None
    with pytest.raises(UserError, match=r"step-000010 cannot be read \(.*\); move it away and resume again"):
        checkpoint.load(path, {"model": lin.state_dict()}, rank=0)


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, lin)
    assert checkpoint.prune(tmp_path, 0) == []  # 0 keeps all
    (tmp_path / "step-000005").mkdir()  # half-written: newer than every kept one, left alone
    assert [p.name for p in checkpoint.prune(tmp_path, 2)] == ["step-000001", "step-000002"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000004", "step-000005"]
    # a damaged newest one does not count towards keep_last: the two intact ones before it stay
    _save(tmp_path, 1000000, lin)  # 7 digits: ordered by number, not by name
    (tmp_path / "step-1000000" / "meta.json").write_text("{}")
    assert checkpoint.prune(tmp_path, 2) == []
    _save(tmp_path, 1000001, lin)
    assert [p.name for p in checkpoint.prune(tmp_path, 2)] == ["step-000003"]  # kept: 1000001 and 4
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000005", "step-1000000",
                                                               "step-1000001"]


def test_resumed_metrics_replace_replayed_steps_and_keep_the_first_loss(tmp_path: Path) -> None:
    m = StepMetrics(tmp_path, 0, flops_per_token=1e6, peak=None)
    for step in range(1, 7):
        m.log(step, 10.0 - step, 1000, 0.5, 1e-3, 1.0, 0.0, 0)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # the line a killed rank was writing
    again = StepMetrics(tmp_path, 0, flops_per_token=1e6, peak=None, start_step=4)  # resumed at step 4
    for step in range(5, 9):
        again.log(step, 20.0 - step, 1000, 0.25, 1e-3, 1.0, 0.0, 0)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss"] for r in recs] == [9.0, 8.0, 7.0, 6.0, 15.0, 14.0, 13.0, 12.0]
    s = again.summary("none")
    assert (s["first_step"], s["steps"], s["loss_start"], s["loss_end"]) == (1, 8, 9.0, 12.0)
    assert json.loads((tmp_path / "summary.json").read_text())["loss_start"] == 9.0


def test_keep_last_setting() -> None:
    from bimetal.config import load_config

    assert load_config(None, []).checkpoint.keep_last == 3
    assert load_config(None, ["--checkpoint.keep_last=0"]).checkpoint.keep_last == 0
    with pytest.raises(UserError, match=r"checkpoint\.keep_last=-1 must be 0 \(keep all\) or more"):
        load_config(None, ["--checkpoint.keep_last=-1"])
