"""One step of a measured run (the GPU check's rows, the GPU ladder's ranks) as a process tree that ends whole.

A step is a launcher (``bimetal launch``, ``bimetal train --simulate``) whose ranks run in sessions of their own,
and a rank may start processes of its own. Killing the launcher's process group alone leaves those behind on a
timeout, holding the GPU while the next step runs. So the caller becomes a **child subreaper**
(``PR_SET_CHILD_SUBREAPER``): whatever its steps start and orphan is re-parented to it, never to init, and
``end_tree`` finds every descendant in ``/proc`` by parent id, kills each one's process group and the process
itself with SIGKILL, reaps them, and waits until they are gone.

``run_step`` runs one command under a timeout; SIGTERM or SIGINT to the caller (a ``timeout`` around the whole
run) ends the step's tree too and raises ``Stopped``, so the caller can still write what it has.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

_PR_SET_CHILD_SUBREAPER = 36


class Stopped(Exception):
    """The run was told to stop (SIGTERM or SIGINT) while a step ran; the step's processes are ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def become_subreaper() -> bool:
    """Make this process the one orphans of its descendants are re-parented to (Linux); False where it cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children (from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        p = queue.pop(0)
        found.append(p)
        queue.extend(children.get(p, []))
    return found


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_tree(spare: frozenset[int] = frozenset(), wait_s: float = 15.0) -> list[int]:
    """SIGKILL every descendant of this process but ``spare`` (and theirs) and each one's process group, reap
    them, and wait up to ``wait_s`` for them to be gone. Returns the pids it killed."""
    ours = os.getpgid(0)
    killed: list[int] = []
    for _ in range(5):  # again: a process may have forked while the others were killed
        found = [p for p in descendants(os.getpid()) if p not in killed and p not in spare]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                group = os.getpgid(pid)
                if group != ours:
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed += found
    end = time.monotonic() + wait_s
    while any(_alive(p) for p in killed) and time.monotonic() < end:
        time.sleep(0.05)
    for pid in killed:  # reap ours: the step, and orphans re-parented to us (the others' parents reap theirs)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    return killed


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    def stop(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_step(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
             cwd: Path | None = None, fork: bool = False) -> int | None:
    """Run ``args`` in a session of its own, its output in ``log``; its exit status, or None when it outlived
    ``timeout`` seconds (its whole tree then ended). ``Stopped`` when this process is told to stop meanwhile.

    ``fork``: ``args`` is ``[python, PROGRAM...]`` and runs in a fork of this process (``bimetal.rank_fork``), not
    a new interpreter: a caller that imported the launcher and the trainer once (``preload``) does not pay those
    imports again for every step. Only where a fork means the same (``rank_fork.fork_wanted``: no GPU context)."""
    become_subreaper()
    before = frozenset(descendants(os.getpid()))  # the caller's other children (and theirs) are not the step's
    with open(log, "w") as f, _stop_signals():
        proc: subprocess.Popen[bytes] | _Forked = (
            _Forked(args[1:], env, f, cwd) if fork else
            subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True))
        try:
            rc = proc.wait(max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            end_tree(before)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1)
            return None
        except Stopped:
            end_tree(before)
            raise
        end_tree(before)  # what the step left running (a rank's own child) goes with it
        return rc


class _Forked:
    """A step forked from this process, with the part of ``subprocess.Popen``'s interface ``run_step`` uses."""

    def __init__(self, program: list[str], env: dict[str, str] | None, log: IO[str], cwd: Path | None) -> None:
        from bimetal.rank_fork import fork_rank

        def in_child() -> None:  # what Popen does for a new interpreter: its working folder, output to the log
            if cwd is not None:
                os.chdir(cwd)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)

        self._rank = fork_rank(program, dict(os.environ if env is None else env), pipes=False, in_child=in_child)

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while True:
            try:
                rc = self._rank.poll()
            except ChildProcessError:  # already reaped by end_tree after a timeout: it was killed
                return -signal.SIGKILL
            if rc is not None:
                return rc
            if time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self._rank.args, timeout)
            time.sleep(0.05)
