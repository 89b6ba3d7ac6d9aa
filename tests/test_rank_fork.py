"""Ranks of a job simulated on the CPU start as forks of the launcher (``bimetal.rank_fork``), through the
entry points users type: each rank sees its own environment, arguments, ``sys.path[0]`` and session, as a new
interpreter would; a failing rank is reported the same way; a rank that leaves an idle thread pool ends as a new
interpreter does (its pool's exit hook, then its ``atexit`` handlers: no hang); ``BIMETAL_LAUNCH_FORK=0`` starts new
interpreters; and a training job's losses are bitwise the same either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import atexit, json, os, sys, threading
from concurrent.futures import ThreadPoolExecutor
# an idle pool held to the end (as Inductor's compile pool is): its worker waits for work until threading's exit
# hook tells it to stop; the atexit handler sees whether that hook ran first, as it does in a new interpreter
pool = ThreadPoolExecutor(1)
pool.submit(int).result()
atexit.register(lambda: print("atexit: pool stopped", not any(t.is_alive() for t in pool._threads), flush=True))
# a fork has torch loaded: its thread count is the launcher's setting applied in the fork; a new interpreter does not
# import torch for it (~3 s of CPU), since torch takes OMP_NUM_THREADS from its environment when it is imported
preloaded = "torch.distributed.checkpoint" in sys.modules
threads = sys.modules["torch"].get_num_threads() if preloaded else int(os.environ["OMP_NUM_THREADS"])
print(json.dumps({"rank": int(os.environ["RANK"]), "main_tid": threading.main_thread().native_id == os.getpid(),
                  "argv": sys.argv[1:], "path0": sys.path[0], "threads": threads, "preloaded": preloaded,
                  "own_session": os.getsid(0) == os.getpid(), "vendor": os.environ["BIMETAL_SIMULATE"],
                  "name": __name__}), flush=True)
if os.environ["RANK"] == "1" and "fail" in sys.argv:
    raise RuntimeError("rank one fails on purpose")
"""


def _env(**extra: str) -> dict[str, str]:
    dropped = ("BIMETAL_", "RANK", "WORLD_SIZE", "MASTER_", "OMP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return {**env, **extra}


def _launch(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return subprocess.run([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "nvidia:1,amd:1", "--",
                           str(script), *args], env=_env(**extra), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def _lines(out: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["rank"]: row for row in rows}


@pytest.mark.timeout(240)
def test_forked_ranks_see_what_a_new_interpreter_would_and_fork_zero_starts_one(tmp_path: Path) -> None:
    for fork, preloaded in (("1", True), ("0", False)):
        proc = _launch(tmp_path, "--x", "7", BIMETAL_LAUNCH_FORK=fork)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("atexit: pool stopped True") == 2, (fork, proc.stdout)
        ranks = _lines(proc.stdout)
        assert sorted(ranks) == [0, 1], proc.stdout
        for row in ranks.values():
            assert row["argv"] == ["--x", "7"] and row["path0"] == str(tmp_path) and row["name"] == "__main__"
            assert row["own_session"] and row["vendor"] == "nvidia:1,amd:1" and row["main_tid"]
            assert row["threads"] == 1  # OMP_NUM_THREADS=1 from the launcher, applied in the fork too
            assert row["preloaded"] is preloaded, (fork, row)


def test_a_failing_forked_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "fail")
    assert proc.returncode == 1
    assert "RuntimeError: rank one fails on purpose" in proc.stderr
    assert "rank 1 (amd) exited with status 1" in proc.stderr, proc.stderr


def test_module_and_c_programs_run_as_main() -> None:
    code = "import os, sys; print('rank', os.environ['RANK'], 'argv', sys.argv[1:]); sys.exit(int(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "amd:2", "--", "-c", code,
                           "0"], env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 argv ['0']", "rank 1 argv ['0']"], proc.stdout
    proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "amd:2", "--", "-c", code,
                           "3"], env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1 and "exited with status 3" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "amd:1", "--", "-m",
                           "json.tool", "--help"], env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "usage: python -m json.tool" in proc.stdout, proc.stdout + proc.stderr


def test_training_losses_are_bitwise_the_same_forked_or_not(tmp_path: Path) -> None:
    losses = {}
    for fork in ("1", "0"):
        run = tmp_path / f"fork{fork}"
        proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "train", "--config", "configs/demo.toml",
                               "--simulate", "nvidia:1,amd:1", "--parallel.dp=1", "--training.steps=3",
                               "--checkpoint.every=0", "--metrics.log_every=1", "--data.seq_len=32",
                               f"--metrics.run_dir={run}"], env=_env(BIMETAL_LAUNCH_FORK=fork), capture_output=True,
                              text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[fork] = [row["loss"] for row in rows if "loss" in row]
    assert len(losses["1"]) == 3 and losses["1"] == losses["0"]
