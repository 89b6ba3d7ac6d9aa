"""One job across torchrun's restarts (``bimetal.parallel.job``): a later round resumes by itself and says in one
line what changed and what is redone; a user's second job on the same folders is still a start, refused in every
round; the ranks of a round agree on its keys even where the store holds an earlier round's.

Losing a whole node under elastic torchrun, and the new layout, is the lab's test (``test_lab_elastic.py``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from launcher import clean_env

from bimetal.parallel import job
from bimetal.parallel.job import ROUND, Job, World, restart_line

ROOT = Path(__file__).resolve().parents[1]


def test_restart_line_names_what_was_lost_or_joined_and_the_steps_redone() -> None:
    four = World.of([("nv", "nvidia"), ("nv", "nvidia"), ("amd", "amd"), ("amd", "amd")], "pp=2 x dp=2")
    two = World.of([("nv", "nvidia"), ("nv", "nvidia")], "pp=1 x dp=2")
    assert restart_line(four, two, 13, 10, "c/step-000010") == (
        "bimetal restart: lost node amd (amd, ranks 2, 3 of 4); the whole amd island; world nvidia:2,amd:2 -> "
        "nvidia:2 on nv, layout pp=2 x dp=2 -> pp=1 x dp=2; going on from the checkpoint of step 10 (c/step-000010), "
        "3 steps redone (the job had finished step 13).")
    back = restart_line(two, four, 23, 20, "c/step-000020")
    assert back.startswith("bimetal restart: joined node amd (amd, now ranks 2, 3); world nvidia:2 -> "
                           "nvidia:2,amd:2 on nv, amd, layout pp=1 x dp=2 -> pp=2 x dp=2;"), back
    # one of two AMD nodes: the island stays
    mixed = World.of([("nv", "nvidia"), ("a1", "amd"), ("a2", "amd")], "pp=1 x dp=3")
    left = World.of([("nv", "nvidia"), ("a1", "amd")], "pp=1 x dp=2")
    line = restart_line(mixed, left, 5, 4, "c/step-000004")
    assert "lost node a2 (amd, rank 2 of 3); world" in line and "island" not in line, line
    assert restart_line(four, four, 6, 4, "c/s").startswith(
        "bimetal restart: no node lost: the same 4 ranks on nv, amd; world unchanged, layout pp=2 x dp=2;")
    assert restart_line(four, two, 3, 0, None).endswith("no complete checkpoint: going on from step 0, 3 steps "
                                                        "redone (the job had finished step 3).")


def test_ranks_of_a_round_agree_on_its_keys_past_an_earlier_rounds_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store still names the round before (its rank 0 is gone); rank 1 starts first and reads that token,
    gets no answer and reads again once this round's rank 0 has published its own: both take the new prefix.
    A rank reads the token again after 0.2 s instead of 2 s here (the waits are the test's whole wall)."""
    monkeypatch.setattr(job, "_RETRY_S", 0.2)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    old = "bimetal/round/" + "0" * 32
    server.set(ROUND, old[len("bimetal/round/"):])
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
        got[r] = Job(client).round_prefix(r, 3, timedelta(seconds=20))

    late = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in late:
        t.start()
    threading.Event().wait(0.6)  # longer than one wait for rank 0's answer: they read the old token again
    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    for t in (*late, zero):
        t.join(timeout=30)
    assert len(set(got.values())) == 1 and got[0] != old and sorted(got) == [0, 1, 2], got


def _torchrun(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """One process under torchrun's own agent (``--standalone``: c10d rendezvous), restarted once on a failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=1",
           "--monitor-interval=0.2", "-m", "bimetal.train", "--config", str(ROOT / "configs" / "demo.toml"),
           "--parallel.pp=1", "--parallel.dp=1", "--parallel.layers_per_stage=[]", "--training.steps=6",
           "--data.seq_len=32", "--checkpoint.every=2", f"--metrics.run_dir={run_dir}", *extra]
    return subprocess.run(cmd, env=clean_env(**(env or {})), cwd=ROOT, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(200)
def test_torchrun_restart_resumes_by_itself_and_a_second_fresh_job_is_refused_in_every_round(tmp_path: Path) -> None:
    run = tmp_path / "run"
    hurt = _torchrun(run, env={"BIMETAL_FAULT_KILL": "0:3"})
    out = hurt.stdout + hurt.stderr
    assert hurt.returncode == 0, out[-3000:]
    assert "rank 0 kills itself after step 3" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("bimetal restart:")]
    assert line.startswith("bimetal restart: no node lost: the same 1 rank on ") and "world unchanged" in line, line
    assert line.endswith(f"going on from the checkpoint of step 2 ({run / 'checkpoints' / 'step-000002'}), 1 step "
                         "redone (the job had finished step 3)."), line
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    assert sorted(before) == ["step-000002", "step-000004", "step-000006"]

    # The same command again, without --resume: another job (its own torchrun store). torchrun restarts the
    # refused round; that round is a start too, refused the same way, and nothing is written.
    again = _torchrun(run)
    out = again.stdout + again.stderr
    assert again.returncode != 0, out[-3000:]
    refusals = [ln for ln in out.splitlines() if "already holds checkpoints" in ln]
    assert len(refusals) == 2 and "resumed from" not in out, out[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before
