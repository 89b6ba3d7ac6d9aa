"""Losing an island and growing back (issue 40): a two-node job (one NVIDIA and one AMD namespace) under torchrun's
elastic launch (``--nnodes 1:2``, c10d rendezvous, ``--max-restarts``, and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
without which a returning agent never joins: docs/moving-a-run.md) with ``parallel.layout = "auto"``, that goes
2 nodes -> 1 -> 2. The AMD node dies (its agent and its rank SIGKILLed) after step 6; the NVIDIA node's agent
restarts its rank on the world that is left, which picks a new layout and resumes from the checkpoint of step 4
by itself (the command line has no ``--resume``). Once it has written the checkpoint of step 8 (and waits there),
the AMD node's torchrun is started again, the same command: the next round takes it in, picks the two-node layout
again and resumes from that checkpoint, and the job finishes on both. The losses of each round equal a reference
run resumed by hand from its checkpoint on its layout, and each restart line names the lost or returned node, the
layouts, the checkpoint and the steps redone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launcher import clean_env

from bimetal.lab import faults
from bimetal.lab.cluster import Elastic

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
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


def _wait_until(path: Path, proc: subprocess.Popen[Any], log: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        if path.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {seconds:g} s:\n" + log.read_text(errors="replace")[-3000:])


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_losing_the_amd_island_goes_on_on_nvidia_and_grows_back_when_it_returns(make_lab: Any, tmp_path: Path) -> None:
    lab = make_lab(nics=1, rate_mbit=1000)
    run = tmp_path / "run"
    elastic = Elastic(min_nodes=1, max_restarts=1, run_id=lab.spec.lab_id)
    rank_argv = ["-m", "bimetal.train", *ARGS, f"--metrics.run_dir={run}"]
    # every agent makes a store per round: a returning agent finds the round's store address (docs/moving-a-run.md)
    share = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # the AMD rank stalls after step 6 (it has logged it): the node dies there, not a step later. The NVIDIA rank
    # of the round on its own (its agent's attempt 1) waits after the checkpoint of step 8, until the AMD node is back
    stall = {"nv": "0:8:120:1", "amd": "1:6:120"}
    logs = {n: tmp_path / f"{n}.log" for n in ("nv", "amd", "amd-back")}
    procs: dict[str, subprocess.Popen[Any]] = {}

    def start(node: str, log: str, extra: dict[str, str]) -> None:
        with open(logs[log], "w") as out:
            procs[log] = lab.popen(node, lab.torchrun_argv(node, rank_argv, 29431, elastic),
                                   env=lab.node_env(node, {**share, **extra}), stdout=out, stderr=subprocess.STDOUT,
                                   cwd=ROOT)

    refs: dict[int, subprocess.Popen[str]] = {}
    try:
        for node in ("nv", "amd"):  # nv sorts first by address: rank 0, stage 0; amd rank 1, the last stage
            start(node, node, {"BIMETAL_FAULT_STALL": stall[node]})
        _wait_for(logs["amd"], f"step     6/{STEPS}", list(procs.values()), 120)
        assert (run / "checkpoints" / "step-000004" / "COMPLETE").exists()
        assert faults.kill_node(lab, "amd")
        refs[4] = _reference(run, tmp_path, 4, "nvidia:1")  # trains while the job restarts and waits for amd
        _wait_for(logs["nv"], "bimetal restart: lost node amd", [procs["nv"]], 90)
        _wait_until(run / "checkpoints" / "step-000008" / "COMPLETE", procs["nv"], logs["nv"], 90)
        start("amd", "amd-back", {})  # the same command, as a node that was repaired would run it
        assert procs["nv"].wait(timeout=150) == 0, logs["nv"].read_text(errors="replace")[-4000:]
        assert procs["amd-back"].wait(timeout=30) == 0, logs["amd-back"].read_text(errors="replace")[-4000:]
        refs[8] = _reference(run, tmp_path, 8, "nvidia:1,amd:1")
        done = {step: ref.communicate(timeout=120) for step, ref in refs.items()}
    finally:
        for node in ("nv", "amd"):
            faults.kill_node(lab, node)
        for proc in procs.values():
            proc.wait(timeout=10)
        for ref in refs.values():
            if ref.poll() is None:
                ref.kill()
                ref.wait()
    nv = logs["nv"].read_text(errors="replace")
    picks = [ln for ln in nv.splitlines() if "parallel.layout='auto' on" in ln]
    assert len(picks) == 3, nv[-4000:]
    assert "parallel.layout='auto' on nvidia:1,amd:1 on 2 nodes: pp=2 x dp=1" in picks[0], picks
    assert "parallel.layout='auto' on nvidia:1 on 1 node: pp=1 x dp=1" in picks[1], picks
    assert "parallel.layout='auto' on nvidia:1,amd:1 on 2 nodes: pp=2 x dp=1" in picks[2], picks
    lost, back = [ln for ln in nv.splitlines() if ln.startswith("bimetal restart:")]
    assert lost == ("bimetal restart: lost node amd (amd, rank 1 of 2); the whole amd island; world nvidia:1,amd:1 -> "
                    "nvidia:1 on nv, layout pp=2 x dp=1 x tp=1 = 2 -> pp=1 x dp=1 x tp=1 = 1; going on from the "
                    f"checkpoint of step 4 ({run / 'checkpoints' / 'step-000004'}), 2 steps redone (the job had "
                    "finished step 6)."), lost
    assert back == ("bimetal restart: joined node amd (amd, now rank 1); world nvidia:1 -> nvidia:1,amd:1 on nv, amd, "
                    "layout pp=1 x dp=1 x tp=1 = 1 -> pp=2 x dp=1 x tp=1 = 2; going on from the checkpoint of step 8 "
                    f"({run / 'checkpoints' / 'step-000008'}), 0 steps redone (the job had finished step 8)."), back
    # the returned node ran the last stage to the end: it logs the job's steps (the last stage's first replica)
    assert f"step    {STEPS}/{STEPS}" in logs["amd-back"].read_text(errors="replace"), logs["amd-back"].read_text()

    # The references: each round's checkpoint, resumed by hand on the layout that round picked.
    got = _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for step, simulate, steps in ((4, "nvidia:1", range(5, 9)), (8, "nvidia:1,amd:1", range(9, STEPS + 1))):
        out, err = done[step]
        assert refs[step].returncode == 0, err[-3000:]
        layout = "pp=1 x dp=1" if simulate == "nvidia:1" else "pp=2 x dp=1"
        assert f"parallel.layout='auto' on {simulate} on 1 node: {layout}" in out, out[-3000:]
        want = _losses(tmp_path / f"ref{step}")
        assert sorted(want) == list(range(step + 1, STEPS + 1)), want
        for s in steps:
            assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got, want)


def _reference(run: Path, tmp_path: Path, step: int, simulate: str) -> subprocess.Popen[str]:
    """``bimetal train --simulate SIMULATE --resume`` from a copy of the run's checkpoint of ``step`` (complete
    when this is called), started now and left running: the first trains while the job goes on."""
    ref = tmp_path / f"ref{step}"
    name = f"step-{step:06d}"
    shutil.copytree(run / "checkpoints" / name, ref / "checkpoints" / name)
    return subprocess.Popen([sys.executable, "-m", "bimetal.cli", "train", *ARGS, f"--metrics.run_dir={ref}",
                             "--simulate", simulate, "--resume"], env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
