"""Ranks of a job simulated on the CPU start as forks of the launcher (``bimetal.rank_fork``), through the
entry points users type: each rank sees its own environment, arguments, ``sys.path[0]`` and session, as a new
interpreter would; a failing rank is reported the same way; a rank that leaves an idle thread pool ends as a new
interpreter does (its pool's exit hook, then its ``atexit`` handlers: no hang); ``BIMETAL_LAUNCH_FORK=0`` starts new
interpreters; and a training job's losses are bitwise the same either way.

The eight launches (``python -m bimetal.cli launch|train ...``, the command's own main) run side by side as forks of
one helper that imported torch once (``tests/forked_runs.py``), not eight interpreters each importing it (~3.5 s of
CPU apiece); what each launcher does from there, forks or new interpreters for its ranks, is its own."""

from __future__ import annotations

import json
import os
import subprocess
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


CODE = "import os, sys; print('rank', os.environ['RANK'], 'argv', sys.argv[1:]); sys.exit(int(sys.argv[1]))"
TRAIN = ["train", "--config", "configs/demo.toml", "--simulate", "nvidia:1,amd:1", "--parallel.dp=1",
         "--training.steps=3", "--checkpoint.every=0", "--metrics.log_every=1", "--data.seq_len=32"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """Every launch of this file, run once, side by side: (the probe's folder, name -> the launch's result)."""
    from forked_runs import runs

    base = tmp_path_factory.mktemp("rank-fork")
    script = base / "probe.py"
    script.write_text(PROBE)
    probe = ["launch", "--simulate", "nvidia:1,amd:1", "--", str(script)]
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        "probe-fork1": ([*probe, "--x", "7"], _env(BIMETAL_LAUNCH_FORK="1")),
        "probe-fork0": ([*probe, "--x", "7"], _env(BIMETAL_LAUNCH_FORK="0")),
        "probe-fail": ([*probe, "fail"], _env()),
        "c-0": (["launch", "--simulate", "amd:2", "--", "-c", CODE, "0"], _env()),
        "c-3": (["launch", "--simulate", "amd:2", "--", "-c", CODE, "3"], _env()),
        "module": (["launch", "--simulate", "amd:1", "--", "-m", "json.tool", "--help"], _env()),
        **{f"train-fork{fork}": ([*TRAIN, f"--metrics.run_dir={base / f'fork{fork}'}"], _env(BIMETAL_LAUNCH_FORK=fork))
           for fork in ("1", "0")},
    }
    done = runs([(["-m", "bimetal.cli", *argv], ROOT) for argv, _ in jobs.values()], env=_env(),
                envs=[env for _, env in jobs.values()], timeout=200)
    return base, dict(zip(jobs, done))


def _lines(out: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["rank"]: row for row in rows}


@pytest.mark.timeout(240)
def test_forked_ranks_see_what_a_new_interpreter_would_and_fork_zero_starts_one(launched) -> None:
    folder, done = launched
    for fork, preloaded in (("1", True), ("0", False)):
        proc = done[f"probe-fork{fork}"]
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("atexit: pool stopped True") == 2, (fork, proc.stdout)
        ranks = _lines(proc.stdout)
        assert sorted(ranks) == [0, 1], proc.stdout
        for row in ranks.values():
            assert row["argv"] == ["--x", "7"] and row["path0"] == str(folder) and row["name"] == "__main__"
            assert row["own_session"] and row["vendor"] == "nvidia:1,amd:1" and row["main_tid"]
            assert row["threads"] == 1  # OMP_NUM_THREADS=1 from the launcher, applied in the fork too
            assert row["preloaded"] is preloaded, (fork, row)


@pytest.mark.timeout(240)
def test_a_failing_forked_rank_is_named_with_its_traceback(launched) -> None:
    proc = launched[1]["probe-fail"]
    assert proc.returncode == 1
    assert "RuntimeError: rank one fails on purpose" in proc.stderr
    assert "rank 1 (amd) exited with status 1" in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
def test_module_and_c_programs_run_as_main(launched) -> None:
    proc = launched[1]["c-0"]
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 argv ['0']", "rank 1 argv ['0']"], proc.stdout
    proc = launched[1]["c-3"]
    assert proc.returncode == 1 and "exited with status 3" in proc.stderr, proc.stderr
    proc = launched[1]["module"]
    assert proc.returncode == 0 and "usage: python -m json.tool" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(240)
def test_training_losses_are_bitwise_the_same_forked_or_not(launched) -> None:
    folder, done = launched
    losses = {}
    for fork in ("1", "0"):
        proc = done[f"train-fork{fork}"]
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (folder / f"fork{fork}" / "metrics.jsonl").read_text().splitlines()]
        losses[fork] = [row["loss"] for row in rows if "loss" in row]
    assert len(losses["1"]) == 3 and losses["1"] == losses["0"]
