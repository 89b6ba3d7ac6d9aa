"""Run ``bimetal ARGS`` in the test process, for refusals that come before any rank starts.

A refusal of bad input happens while the command checks its arguments, before a rank or any other process is
started, so running ``bimetal.cli.main`` here shows the same exit status and sentence as the console script
without paying for an interpreter start and a torch import (~3 s of CPU each). Each family of refusals still
keeps at least one case through the real console script (a subprocess) in its test file.

The run happens inside an xdist worker that goes on to run other tests, so ``cli_main`` checks that the command
left nothing behind: the environment, the working directory, the root logger's handlers, the handlers of the
signals a launcher touches, the threads, and no torch.distributed process group.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import pytest

from bimetal.cli import main

# What a parent launcher or the developer's shell may have set that would change what a command does (as in
# launcher.clean_env, which a subprocess gets).
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1)


def _state() -> dict[str, object]:
    import torch.distributed as dist

    return {"env": dict(os.environ), "cwd": os.getcwd(), "log": list(logging.getLogger().handlers),
            "signals": {s: signal.getsignal(s) for s in _SIGNALS},
            "group": dist.is_available() and dist.is_initialized()}


def cli_main(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
             env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, str, str]:
    """``bimetal ARGV`` by ``bimetal.cli.main`` in this process: (exit status, stdout, stderr).

    The environment is this process's without launcher variables and bimetal settings, plus ``env`` (as
    ``launcher.clean_env`` gives a subprocess); ``cwd`` is the working directory while it runs. Asserts that the
    command left the process as it found it.
    """
    for key in list(os.environ):
        if key.startswith(("BIMETAL_", "TORCHELASTIC")) or key in _LAUNCHER_VARS:
            monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    capsys.readouterr()
    before, threads = _state(), set(threading.enumerate())
    code = main(list(argv))
    out, err = capsys.readouterr()
    after = _state()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # a thread the command started and left running (one an earlier test left may end meanwhile: not this one's)
    assert not set(threading.enumerate()) - threads, sorted(t.name for t in set(threading.enumerate()) - threads)
    return code, out, err
