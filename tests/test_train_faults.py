"""Training under faults: a rank SIGKILLed or stalled mid-training.

* With ``--max-restarts`` torchrun restarts the job, every rank resumes from the newest complete
  checkpoint by itself, and the loss at the final step equals that of an uninterrupted run; metrics.jsonl
  holds each step once. A damaged newest checkpoint is skipped by ``--resume`` with one sentence.
* Without restarts, every surviving rank stops with one sentence naming its step, the phase and the group, soon
  enough after the fault that ``parallel.timeout_s`` (6 s), not the default 120 s, was what ended its wait
  (and, on bimetal transports, the peer and sequence number); none hangs. These ranks run with no launcher
  watching them (``forked_ranks.py``), so nothing but their own timeouts stops them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import bimetal, clean_env, free_port

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(240)
STEPS = 7  # checkpoints of steps 3, 6 and 7 (the last): one more than keep_last=2 keeps
TIMEOUT_S = 10
STALL_TIMEOUT_S = 6
"""The collectives' timeout where a survivor's wait for a dead or stalled peer is what ends it (the wall counts)."""
COMMON = ["--config", str(ROOT / "configs" / "demo.toml"), f"--training.steps={STEPS}", "--data.seq_len=32",
          "--metrics.log_every=1"]


def _train(run_dir: Path, extra_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return bimetal("train", *COMMON, f"--parallel.timeout_s={TIMEOUT_S}", "--simulate", "nvidia:2,amd:2",
                   "--checkpoint.every=3",
                   f"--metrics.run_dir={run_dir}", *args, env=clean_env(**extra_env), timeout=200)


def _loss_at(run_dir: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if r["step"] == step][-1]


def _steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_argv(run_dir: Path, *args: str) -> list[str]:
    """``_train``'s job as ``python -m bimetal.train`` (the ``bimetal train`` command's own ``main``: under
    ``--simulate`` the job's launcher)."""
    return ["-m", "bimetal.train", *COMMON, f"--parallel.timeout_s={TIMEOUT_S}", "--simulate", "nvidia:2,amd:2",
            "--checkpoint.every=3", f"--metrics.run_dir={run_dir}", *args]


def test_killed_rank_restarts_and_reaches_the_same_final_loss(tmp_path: Path) -> None:
    # The reference and the hurt job, one after the other, forked from one interpreter that imported the trainer
    # once (tests/forked_runs.py) instead of a new one each. Rank 3 (AMD, last stage) dies after step 5; the
    # checkpoint of step 3 is the newest complete one.
    from forked_runs import runs

    ref, hurt = runs([(_train_argv(tmp_path / "ref"), ROOT),
                      (_train_argv(tmp_path / "hurt", "--max-restarts=1", "--checkpoint.keep_last=2"), ROOT)],
                     envs=[clean_env(), clean_env(BIMETAL_FAULT_KILL="3:5")], at_once=False, timeout=230)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = hurt.stdout + hurt.stderr
    assert hurt.returncode == 0, out[-3000:]
    assert "rank 3 kills itself after step 5" in out
    assert "resumed from" in out and "step-000003 at step 3" in out, out[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("bimetal restart:")]
    assert ": no node lost: the same 4 ranks on " in line and line.endswith("), 2 steps redone (the job had finished "
                                                                           "step 5)."), line
    assert _loss_at(tmp_path / "hurt", STEPS) == pytest.approx(_loss_at(tmp_path / "ref", STEPS), rel=1e-5)
    # the replayed steps 4-5 replaced their first records; the summary starts at the run's step 1
    assert _steps_logged(tmp_path / "hurt") == list(range(1, STEPS + 1))
    summary = json.loads((tmp_path / "hurt" / "summary.json").read_text())
    assert summary["first_step"] == 1 and summary["loss_start"] == pytest.approx(_loss_at(tmp_path / "ref", 1))
    # keep_last=2: of the checkpoints of steps 3, 6 and 7 the two newest are left
    ckpts = tmp_path / "hurt" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000006", "step-000007"]

    # The newest checkpoint is damaged in place (bytes changed, size kept: only the ranks of stage 1, which read
    # that file, find it, by its checksum): --resume says so in one sentence, and every rank goes on from the one
    # before it, to the same final loss, logging step 7 once. (Files cut short: test_nothing_lost.py.)
    data = max((ckpts / "step-000007" / "stage1").glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    again = _train(tmp_path / "hurt", {}, "--resume", "--checkpoint.keep_last=2")
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "Traceback" not in out, out[-3000:]
    warned = [line for line in out.splitlines() if "is damaged" in line]
    assert len(warned) == 1 and "step-000007 is damaged (stage1/" in warned[0], out[-3000:]
    assert warned[0].endswith("resuming from step-000006 instead."), warned
    assert "step-000006 at step 6" in out, out[-3000:]
    assert _steps_logged(tmp_path / "hurt") == list(range(1, STEPS + 1))
    assert _loss_at(tmp_path / "hurt", STEPS) == pytest.approx(_loss_at(tmp_path / "ref", STEPS), rel=1e-5)


def _start_ranks(run_dir: Path, fault: dict[str, str]) -> subprocess.Popen:
    """The four ranks as bare processes, with no launcher watching them (bimetal's launcher and torchrun's agent
    would stop the survivors at once): forks of one interpreter that imported the trainer once
    (``forked_ranks.py``), which prints ``<rank> <status>`` as each ends; each rank's stderr is
    ``run_dir/ranks/rank<R>.err``."""
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
                    BIMETAL_SIMULATE="nvidia:2,amd:2", **fault)
    return subprocess.Popen([sys.executable, str(HERE / "forked_ranks.py"), "4", str(run_dir / "ranks"), "--",
                             "-m", "bimetal.train", *COMMON, f"--parallel.timeout_s={STALL_TIMEOUT_S}",
                             f"--metrics.run_dir={run_dir}"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _survivors_stop(ranks: subprocess.Popen, run_dir: Path, victim: int, started: float) -> dict[int, str]:
    """Wait for every rank but ``victim``; each must exit non-zero in time with a one-sentence reason."""
    errors: dict[int, str] = {}
    codes: dict[int, int] = {}
    try:
        assert ranks.stdout is not None
        while len(codes) < 3:
            line = ranks.stdout.readline()  # the test's timeout bounds this wait
            if not line:
                break
            rank, code = map(int, line.split())
            if rank != victim:  # a killed victim ends too (-9); a stalled one is killed below
                codes[rank] = code
        waited = time.monotonic() - started
        assert sorted(codes) == [r for r in range(4) if r != victim], (codes, ranks.stderr.read()[-2000:]
                                                                       if ranks.poll() is not None else "")
        # the fault comes after start-up and 3 steps (5 s on an idle machine, a minute on a loaded one), and the
        # survivors stop STALL_TIMEOUT_S after it: far sooner than the 120 s of the default timeout after the fault,
        # which is what this tells apart (how fast the machine is, it does not)
        assert waited < STALL_TIMEOUT_S + 100, f"the survivors took {waited:.0f} s after the start"
        for r, code in codes.items():
            err = (run_dir / "ranks" / f"rank{r}.err").read_text()
            assert code == 1, f"rank {r} exited {code}: {err[-2000:]}"
            assert "Traceback" not in err, err[-2000:]
            errors[r] = err.strip().splitlines()[-1]
    finally:
        ranks.kill()  # and with it any rank still running (its parent-death signal)
        ranks.communicate()
    return errors


def test_killed_rank_without_restarts_stops_every_survivor_with_a_reason(tmp_path: Path) -> None:
    t0 = time.monotonic()
    errors = _survivors_stop(_start_ranks(tmp_path / "run", {"BIMETAL_FAULT_KILL": "3:3"}), tmp_path / "run", 3, t0)
    for r, line in errors.items():
        assert line.startswith(f"bimetal train: rank {r} stopped in step 4 during the "), line
        assert "on group '" in line, line
    # rank 1 is rank 3's pipeline peer over cpu-forward: its sentence names that group, the op and the peer
    assert "group 'pp.dp1'" in errors[1] and "with peer 3" in errors[1], errors[1]


def test_rank_killed_while_a_checkpoint_is_written_is_named_and_the_rest_stopped_because_of_it(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while the checkpoint of step 2 is written: the launcher's first sentence names it and
    the signal, the three others are one line "stopped because rank 1 died" (not reported dead), no rank prints a
    traceback, and the unfinished checkpoint is not published as step 2."""
    run_dir = tmp_path / "run"
    proc = bimetal("train", *COMMON[:2], "--training.steps=2", "--data.seq_len=32", "--parallel.microbatches=2",
                   "--simulate", "nvidia:2,amd:2", "--checkpoint.every=2", f"--metrics.run_dir={run_dir}",
                   env=clean_env(BIMETAL_FAULT_KILL_IN_CHECKPOINT="1:2"), timeout=200)
    said = [line for line in proc.stderr.splitlines() if line.startswith("bimetal train: ")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert said[0] == "bimetal train: rank 1 (nvidia) was killed by SIGKILL after completing step 1; the job stopped."
    assert said[1].startswith("bimetal train: ranks 0 (nvidia), 2 (amd) and 3 (amd) stopped because rank 1 died "
                              "(first reason given: rank "), said
    assert "in step 2 during the checkpoint save" in said[1] and len(said) == 2, said
    assert not (run_dir / "checkpoints" / "step-000002").exists()


def test_stalled_rank_stops_every_survivor_within_the_timeout(tmp_path: Path) -> None:
    t0 = time.monotonic()
    errors = _survivors_stop(_start_ranks(tmp_path / "run", {"BIMETAL_FAULT_STALL": "3:3:300"}), tmp_path / "run", 3,
                             t0)
    assert f"did not complete within {STALL_TIMEOUT_S} s" in errors[1] and "with peer 3" in errors[1], errors[1]
    for r, line in errors.items():
        assert f"rank {r} stopped in step 4" in line, line
