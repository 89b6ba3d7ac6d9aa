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
