"""The one way multi-rank tests start ranks, and the one way a rank ends.

Two kinds of start, both here:

* **as a user would**: ``bimetal(...)`` runs ``python -m bimetal.cli ARGS`` (``bimetal launch --simulate ...
  -- SCRIPT``, ``bimetal train ...``) in a subprocess with ``clean_env()``; a rank script ends through
  ``rank_main(main)``;
* **in-process ranks**: ``spawn(fn, args)`` starts ``fn(rank, *args)`` in ``nprocs`` spawned processes
  (``torch.multiprocessing``) for tests that build their process group themselves.

Every rank ends through ``rank_exit``: the garbage collector runs while the interpreter is still whole, so
a process group still held by a reference cycle (a pipeline stage and its schedule) is destroyed now and its
destructor joins Gloo's worker threads. Left to interpreter shutdown, a worker still releasing the last
broadcast's tensors needs the GIL after finalization began and the process aborts ("terminate called without
an active exception", SIGABRT: seen in CI on ``test_train_pipeline.py::test_pipeline_matches_single_process
[gpipe]``). bimetal's own rank entry points (``bimetal.train``, ``bimetal titan``) do the same.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

# What a parent launcher or the developer's shell may have set that would change what a launched job does.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables and bimetal settings, one OMP thread, plus ``extra``.

    ``tests/`` leads PYTHONPATH, so a rank script written anywhere can end through ``rank_main``.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BIMETAL_", "TORCHELASTIC")) and k not in _LAUNCHER_VARS}
    path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def bimetal(*args: str, env: dict[str, str] | None = None, timeout: float = 200,
            cwd: Path | None = ROOT) -> subprocess.CompletedProcess:
    """``python -m bimetal.cli ARGS`` to completion, output captured as text (``env`` defaults to ``clean_env()``)."""
    return subprocess.run([sys.executable, "-m", "bimetal.cli", *args], env=clean_env() if env is None else env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def launch(simulate: str, script: str | Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 200) -> subprocess.CompletedProcess:
    """``bimetal launch --simulate SIMULATE -- SCRIPT ARGS``: one rank per simulated device runs ``script``."""
    return bimetal("launch", "--simulate", simulate, "--", str(script), *args, env=env, timeout=timeout)


def rank_exit() -> None:
    """The last thing a rank does: collect garbage while the interpreter is whole (see the module docstring)."""
    gc.collect()


def rank_main(main: Callable[[], Any]) -> None:
    """A rank script's ``if __name__ == "__main__"``: ``main()``, then the common rank exit."""
    try:
        main()
    finally:
        rank_exit()


def _spawned(rank: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(rank, *args)
    finally:
        rank_exit()


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 2, poll_s: float = 100) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes, waited for; a rank that fails raises here.

    ``fn`` must be a module-level function (it is pickled into the spawned interpreters); the test's own
    timeout bounds the wait.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_spawned, args=(fn, args), nprocs=nprocs, start_method="spawn", join=False)
    while not ctx.join(timeout=poll_s):
        pass


def run_threads(rank: Callable[[int], Any], size: int = 2, join_s: float = 40) -> None:
    """``rank(r)`` for every r on ``size`` threads of this process (in-process groups on a shared store); the
    first rank's error is raised here, and a rank still running after ``join_s`` fails the test as hung."""
    import threading

    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            rank(r)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
