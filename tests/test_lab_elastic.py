"""Losing an island (issue 40): a two-node job (one NVIDIA and one AMD namespace) under torchrun's elastic launch
(``--nnodes 1:2``, c10d rendezvous, ``--max-restarts``) with ``parallel.layout = "auto"``. The AMD node dies (its
agent and its rank SIGKILLed) after step 6; the NVIDIA node's agent restarts its rank on the world that is left,
which picks a new layout, resumes from the checkpoint of step 4 by itself (the command line has no ``--resume``)
and finishes. Its losses equal a reference run from that checkpoint on that layout, and the restart line names
the lost node and island, the checkpoint and the 2 steps redone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from launcher import bimetal, clean_env

from bimetal.lab import faults
from bimetal.lab.cluster import Elastic

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
ARGS = ["--config", str(ROOT / "configs" / "demo.toml"), "--parallel.layout=auto", f"--training.steps={STEPS}",
        "--data.seq_len=32", "--checkpoint.every=4", "--metrics.log_every=1", "--parallel.timeout_s=20",
        "--training.dtype=float32"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _wait_for(log: Path, text: str, procs: list[subprocess.Popen[Any]], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {log.name} within {seconds:g} s:\n"
                         + log.read_text(errors="replace")[-3000:])


@pytest.mark.lab
@pytest.mark.timeout(240)
def test_losing_the_amd_island_goes_on_on_nvidia_from_the_last_checkpoint(make_lab: Any, tmp_path: Path) -> None:
    lab = make_lab(nics=1, rate_mbit=1000)
    run = tmp_path / "run"
    elastic = Elastic(min_nodes=1, max_restarts=1, run_id=lab.spec.lab_id)
    rank_argv = ["-m", "bimetal.train", *ARGS, f"--metrics.run_dir={run}"]
    logs = {n: tmp_path / f"{n}.log" for n in ("nv", "amd")}
    procs: dict[str, subprocess.Popen[Any]] = {}
    try:
        for node in ("nv", "amd"):  # nv sorts first by address: rank 0, stage 0; amd rank 1, the last stage
            # the AMD rank stalls after step 6 (it has logged it): the node dies there, not a step later
            extra = {"BIMETAL_FAULT_STALL": "1:6:120"} if node == "amd" else {}
            with open(logs[node], "w") as out:
                procs[node] = lab.popen(node, lab.torchrun_argv(node, rank_argv, 29431, elastic),
                                        env=lab.node_env(node, extra), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _wait_for(logs["amd"], f"step     6/{STEPS}", list(procs.values()), 120)
        assert (run / "checkpoints" / "step-000004" / "COMPLETE").exists()
        assert faults.kill_node(lab, "amd")
        assert procs["nv"].wait(timeout=150) == 0, logs["nv"].read_text(errors="replace")[-4000:]
    finally:
        for node in ("nv", "amd"):
            faults.kill_node(lab, node)
            if node in procs:
                procs[node].wait(timeout=10)
    nv = logs["nv"].read_text(errors="replace")
    assert "parallel.layout='auto' on nvidia:1,amd:1 on 2 nodes: pp=2 x dp=1" in nv, nv[-4000:]
    assert "parallel.layout='auto' on nvidia:1 on 1 node: pp=1 x dp=1" in nv, nv[-4000:]
    (line,) = [ln for ln in nv.splitlines() if ln.startswith("bimetal restart:")]
    assert line == ("bimetal restart: lost node amd (amd, rank 1 of 2); the whole amd island; world nvidia:1,amd:1 -> "
                    "nvidia:1 on nv, layout pp=2 x dp=1 x tp=1 = 2 -> pp=1 x dp=1 x tp=1 = 1; going on from the "
                    f"checkpoint of step 4 ({run / 'checkpoints' / 'step-000004'}), 2 steps redone (the job had "
                    "finished step 6)."), line

    # The reference: that checkpoint, resumed on the layout the restart picked (one NVIDIA rank), by hand.
    ref = tmp_path / "ref"
    shutil.copytree(run / "checkpoints" / "step-000004", ref / "checkpoints" / "step-000004")
    done = bimetal("train", *ARGS, f"--metrics.run_dir={ref}", "--simulate", "nvidia:1", "--resume",
                   env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(want) == list(range(5, STEPS + 1)), (got, want)
    for step in range(5, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
