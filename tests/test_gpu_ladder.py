"""``bimetal bench gpu-ladder --cpu``: the GPU ladder's code end to end on the CPU (tiny model, every
configuration, one round, a profiled run of (c) and (d)), so that it cannot rot before a GPU runs it. Ratios
are printed, not judged here; what is checked is what must hold anywhere: every configuration trained, the
pipelines over cpu-forward, device-direct and the host copy reach the one-process loss (float32: to 1e-5), the
ideal boundary put no activation bytes on the wire while the others carried all of them, and the report has
its parts. Bad options end in one sentence and exit status 2 before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import engine_unavailable

from bimetal.bench import gpu_ladder
from bimetal.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "bimetal")
pytestmark = pytest.mark.timeout(200)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith("BIMETAL_")}


def test_gpu_ladder_runs_every_configuration_in_cpu_mode(tmp_path: Path) -> None:
    configs = "abcde" if engine_unavailable() is None else "abce"  # (d) needs the Mooncake engine
    proc = subprocess.run([EXE, "bench", "gpu-ladder", "--cpu", "--out", str(tmp_path), "--configs", configs,
                           "--profile"], env=_env(), capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_ladder.json").read_text())
    cfg = rep["configs"]
    assert list(cfg) == list(configs) and all(c["ok"] for c in cfg.values()), cfg
    assert rep["mode"] == "cpu" and rep["memory"] == []  # no device memory on the CPU
    boundary = cfg["c"]["boundary_bytes"]
    assert boundary == 4 * 2 * 64 * 128 * 4 * 2  # 4 microbatches of 2 x 64 x 128 float32, each way
    for key in configs:
        if key == "a":
            continue
        assert cfg[key]["boundary_bytes"] == boundary, key  # what the schedule handed the group
        if key == "b":  # tokens only: 24 bytes per message, 8 messages per step
            assert cfg[key]["wire_bytes"] < boundary / 100, cfg[key]
        else:  # the payload crossed (plus the loss broadcast and gradient-norm all-reduce)
            assert cfg[key]["wire_bytes"] >= boundary / 2, (key, cfg[key])  # each rank sends its half
            assert cfg[key]["loss"] == pytest.approx(cfg["a"]["loss"], rel=1e-5), key
            assert cfg[key]["loss_rel_diff"] < 1e-5 and cfg[key]["loss_within"] is None  # not judged on CPU
    assert cfg["b"]["exposed_s"] == 0.0 and cfg["a"]["exposed_s"] is None
    assert {"b/a", "c/b", "e/b", "c/e"} <= set(rep["ratios"]) and all(
        r["meets"] is None for r in rep["ratios"].values())
    pred = rep["prediction"]
    assert pred["message_bytes"] == 2 * 64 * 128 * 4 and 0 < pred["c_over_b"] <= 1.0
    profiled = {(p["config"], p["rank"]): p["profile"] for p in rep["profiles"]}
    assert ("c", 0) in profiled and ("c", 1) in profiled
    groups = {t["group"] for t in profiled[("c", 0)]["threads"]}
    assert {"training", "transport"} <= groups and profiled[("c", 0)]["samples"] > 0
    md = (tmp_path / "gpu_ladder.md").read_text()
    assert "| (c) pp=2, cpu-forward |" in md and "(c)/(b)" in md and "planner:" in md
    assert md.splitlines()[0] in proc.stdout  # the table is printed too


def test_gpu_ladder_refuses_bad_options(tmp_path: Path) -> None:
    """One through the command (exit status 2, one sentence), the rest through the same function in-process."""
    proc = subprocess.run([EXE, "bench", "gpu-ladder", "--cpu", "--out", str(tmp_path), "--configs", "abx"],
                          env=_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--configs 'abx'" in proc.stderr, proc.stderr
    for args, words in [(["--steps", "0"], "--steps must be at least 1"), (["--profile", "a"], "--profile 'a'"),
                        (["--flavour", "nope"], "--flavour 'nope' is not a LLaMA-3 flavour"),
                        (["--timeout", "-1"], "--timeout must be positive")]:
        with pytest.raises(UserError, match=re.escape(words)):
            gpu_ladder.main(["--cpu", "--out", str(tmp_path), *args])
    assert not (tmp_path / "settings.json").exists()  # refused before any rank started


def _records(step: dict[str, float], loss: dict[str, float]) -> list[dict]:
    """Two ranks' records as ``gpu_ladder_rank`` writes them on a GPU, with chosen step times and losses."""
    cal = {"fwd_s": 0.010, "bwd_s": 0.020, "boundary_bytes": 2 * 64 * 128 * 4, "d2h_s": 1e-5, "h2d_s": 1e-5,
           "wire_s": 2e-5, "latency_s": 3e-5, "cf_message_s": 5e-5}
    ranks = []
    for rank in (0, 1):
        runs = []
        for rnd in range(2):
            for key in "abcde":
                if key == "a" and rank == 1:
                    runs.append({"config": key, "round": rnd, "rank": rank, "idle": True})
                    continue
                t = step[key] * (1.0 + 0.01 * rnd)
                runs.append({"config": key, "round": rnd, "rank": rank, "step_s": [9.9, t, t],
                             "losses": [5.0, loss[key]], "sent_bytes": [0, 1000, 1000] if key != "a" else [],
                             "wire_bytes": 2000, "peak_bytes": int(40e6 if key == "a" else 25e6), "error": None})
        ranks.append({"rank": rank, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "calibration": cal,
                      "runs": runs, "profiles": []})
    return ranks


def test_report_judges_the_gpu_figures() -> None:
    """The GPU path of the report, on records with known numbers: medians, exposed time, ratios against their
    targets, losses against (a), memory rows against the dry-run, the prediction; nothing here runs a GPU."""
    from bimetal.bench.gpu_ladder_report import build, markdown

    s = dict(gpu_ladder.CPU, device="cuda", dtype="bfloat16", rounds=2, split=[2, 2], configs="abcde", profile="",
             seed=1)
    step = {"a": 1.00, "b": 1.02, "c": 1.10, "d": 1.30, "e": 1.50}
    loss = {"a": 4.00, "b": 9.0, "c": 4.01, "d": 4.02, "e": 4.20}
    rep = build(s, _records(step, loss), None, 12.0)
    cfg, ratios = rep["configs"], rep["ratios"]
    assert rep["ok"] and rep["mode"] == "gpu"
    assert cfg["c"]["step_s"] == pytest.approx(1.10 * 1.005)  # the median of the two rounds' figures
    assert cfg["c"]["exposed_s"] == pytest.approx((1.10 - 1.02) * 1.005) and cfg["b"]["exposed_s"] == 0.0
    assert cfg["c"]["boundary_bytes"] == 2000 and cfg["c"]["wire_bytes"] == 2000  # both ranks, per timed step
    assert ratios["c/b"]["value"] == pytest.approx(1.02 / 1.10) and ratios["c/b"]["meets"] is False  # < 0.95
    assert ratios["c/e"]["value"] == pytest.approx(1.50 / 1.10) and ratios["c/e"]["meets"] is True  # >= 1.05
    assert ratios["b/a"]["meets"] is None  # reported, no target
    assert cfg["c"]["loss_within"] is True and cfg["d"]["loss_within"] is True and cfg["e"]["loss_within"] is False
    mem = {(m["config"], m["rank"]): m for m in rep["memory"]}
    assert set(mem) == {("a", 0)} | {(k, r) for k in "bcde" for r in (0, 1)}
    assert mem[("c", 1)]["peak"] == 25e6 and mem[("c", 1)]["dry_run_total"] > 0
    assert mem[("c", 1)]["within"] == (abs(25e6 / mem[("c", 1)]["dry_run_total"] - 1) <= 0.10)
    pred = rep["prediction"]
    base = 1.02 * 1.005
    assert pred["exposed_s"] >= 0 and pred["c_over_b"] == pytest.approx(base / (base + pred["exposed_s"]))
    md = markdown(rep)
    assert "| (c)/(b) | 0.927 |" in md and "(SHORT)" in md and "(met)" in md and " OFF |" in md
