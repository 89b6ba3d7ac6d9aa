"""Several independent runs of a rank module, forked from one interpreter that imported it once.

``runs([(ARGV, CWD), ...])`` runs each ``python -m bimetal.train ARGS...`` (``ARGV`` = ``["-m", "bimetal.train",
...]``) as a process of its own, all at once, and returns a ``subprocess.CompletedProcess`` per run (its exit status,
stdout and stderr as text). The runs start as forks of one helper process (``python tests/forked_runs.py SPEC``) that
did the rank's heavy imports once (``bimetal.rank_fork.preload``, as bimetal's launcher does before it forks the
ranks of a simulated job), instead of an interpreter each paying about four seconds of CPU for them. A run without
``--simulate`` and without a launcher's variables is one process holding the whole job: ``python -m bimetal.train``
runs the same ``bimetal.train.cli.main`` as the ``bimetal train`` command, so a test checking what such a run
computes (a resumed checkpoint's losses) pays one import for all its runs. With ``--simulate`` that ``main`` is the
launcher of a simulated job, as under ``bimetal train --simulate``: it forks the job's ranks from itself (already
preloaded). ``at_once=False`` runs the jobs one after another (simulated jobs of several ranks each, on a small
machine). A test about the command itself (its exit status and sentence) still runs the command.

Each run gets the caller's environment, its own working directory, session and files for fds 1 and 2, and SIGKILL
when the helper ends (the parent-death signal): the caller's timeout ends them all.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bimetal.rank_fork import fork_rank, preload

_PR_SET_PDEATHSIG = 1


def runs(jobs: list[tuple[list[str], Path]], env: dict[str, str] | None = None, timeout: float = 240,
         envs: list[dict[str, str]] | None = None, at_once: bool = True) -> list[subprocess.CompletedProcess]:
    """Every ``(argv, cwd)`` of ``jobs`` (see the module docstring), with ``envs[i]`` as job i's whole environment if
    given (else the helper's, ``env``); their results in the same order."""
    if not jobs:
        return []
    logs = Path(tempfile.mkdtemp(prefix="forked-runs-"))  # outside the runs' folders: they hold what the runs wrote
    spec = [{"argv": argv, "cwd": str(cwd), "out": str(logs / f"run{i}.out"), "err": str(logs / f"run{i}.err"),
             "env": envs[i] if envs is not None else None} for i, (argv, cwd) in enumerate(jobs)]
    (logs / "spec.json").write_text(json.dumps({"at_once": at_once, "runs": spec}))
    helper = subprocess.run([sys.executable, __file__, str(logs / "spec.json")], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert helper.returncode == 0, (helper.stdout[-2000:], helper.stderr[-3000:])
    codes = dict(tuple(map(int, line.split())) for line in helper.stdout.splitlines() if line.strip())
    assert sorted(codes) == list(range(len(jobs))), helper.stdout
    out = [subprocess.CompletedProcess([sys.executable, *s["argv"]], codes[i], Path(s["out"]).read_text(),
                                       Path(s["err"]).read_text()) for i, s in enumerate(spec)]
    shutil.rmtree(logs)
    return out


def fork_all(spec: list[dict], at_once: bool = True) -> None:
    """Fork a process per entry of ``spec`` (``argv``, ``env``: its whole environment or None for this one's,
    ``cwd`` or None, ``out`` and ``err``: the files for fds 1 and 2), each with the parent-death signal, from this
    process as it is (preloaded by the caller); print ``<index> <exit status>`` on a line of its own as each ends.
    ``at_once=False``: each waits for the one before."""
    pids: dict[int, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        if pid in pids:
            print(pids.pop(pid), os.waitstatus_to_exitcode(status), flush=True)

    for i, run in enumerate(spec):
        def in_child(run: dict = run) -> None:  # the run's folder and files, then the parent-death signal
            if run.get("cwd"):
                os.chdir(run["cwd"])
            for fd, key in ((1, "out"), (2, "err")):
                f = os.open(run[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        pids[fork_rank(run["argv"], run["env"] or dict(os.environ), pipes=False, in_child=in_child).pid] = i
        while pids and not at_once:
            reap()
    while pids:
        reap()


def main(spec_path: str) -> int:
    doc = json.loads(Path(spec_path).read_text())
    preload(doc["runs"][0]["argv"])
    fork_all(doc["runs"], doc["at_once"])
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    gc.freeze()  # as bimetal.entry does at a command's exit: the shutdown then skips walking the preloaded modules
    sys.exit(code)
