"""The ranks of one node, started and owned by bimetal (``bimetal launch``/``bimetal train --simulate``).

It keeps torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT, and a store the launcher hosts for every attempt, ``TORCHELASTIC_USE_AGENT_STORE``)
so a rank cannot tell it from torchrun, but it owns what torchrun does not let bimetal own:

* **the last word**: a rank that stops on an error writes its one sentence to a report file instead of
  printing it (``report_outcome``); the launcher prints one sentence for the job - a user error once, not once
  per rank, exit status 2 - and never torchrun's multi-line child-failure dump;
* **deaths**: the first rank that dies (signal, or an exit without a sentence) is named with its vendor, how it
  died, its last completed step (ranks note each step with ``report_step``) and its cause line: the Python
  exception it ended with (``report_crash`` writes it to torchrun's error file, ``TORCHELASTIC_ERROR_FILE``,
  which the launcher sets for each rank as torchrun does) or, with ``output``, the C++ ``what():`` line from its
  stderr. The survivors get ``grace_s`` to finish, then they are stopped; the ranks that ended after the
  first death are one more line, "stopped because rank R died", with the first of their own reasons;
* **signals**: SIGINT/SIGTERM to the launcher stops every rank it started (each rank runs in its own session
  and gets SIGKILL if the launcher itself is killed), exit status 128 + signal;
* **restarts**: with ``max_restarts`` the whole attempt is stopped and started again with the restart count
  raised; ranks then resume from their newest checkpoint by themselves;
* **output** (optional, ``bimetal.rank_output.RankOutput``): each rank's lines prefixed ``[rank<R>]:`` and only
  the chosen ranks shown, as torchrun's ``--local-ranks-filter``; otherwise the ranks write to the launcher's
  own stdout and stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bimetal.env import read as read_env
from bimetal.errors import UserError
from bimetal.outputs import write_text
from bimetal.rank_fork import ForkedRank, fork_rank, preload
from bimetal.rank_output import RankOutput

_log = logging.getLogger(__name__)

REPORT_ENV = "BIMETAL_LAUNCH_REPORT"
"""Folder where the ranks of a bimetal-launched attempt leave their outcome and last completed step."""
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""torchrun's per-rank file for the exception a rank ended with (torch's ``@record`` writes it too)."""

_PR_SET_PDEATHSIG = 1


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _record(name: str, text: str) -> bool:
    """Rank side: replace the record ``name`` in the launcher's folder whole (a temporary file renamed over it:
    a rank killed while writing leaves the previous record, never an empty one); False when not
    bimetal-launched or the folder is gone (the launcher finished and cleaned up: nothing to tell it)."""
    folder = read_env(REPORT_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    try:
        write_text(Path(folder, name), text)
    except OSError:
        return False
    return True


def report_step(step: int) -> None:
    """Rank side: note that this rank completed ``step`` (no-op unless a bimetal launcher started it)."""
    _record(f"rank-{_rank()}.step", str(step))


def report_crash(exc: BaseException) -> None:
    """Rank side: the exception that ends this rank (a bug: the traceback is printed too), in torchrun's error
    file format, where torchrun or bimetal's launcher asked for it; its line becomes the launcher's cause."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        write_text(path, json.dumps(data))


def report_outcome(status: int, message: str) -> bool:
    """Rank side: leave this rank's final sentence for the launcher; False when not bimetal-launched
    (the caller then prints it itself)."""
    return _record(f"rank-{_rank()}.json", json.dumps({"status": status, "message": message, "time": time.time()}))


def _die_with_parent() -> None:  # runs in the child between fork and exec (or the forked rank's start)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _start_store(port: int) -> tuple[int, int]:
    """The job's store, as torchrun's agent hosts it (one for every attempt), served by a child process forked now,
    while the launcher has no other thread; the launcher itself then never has one (the server's thread lives in
    that child), so the ranks it forks later copy no lock another thread holds. ``port`` 0: any free one.
    Returns the child's pid and the port; a port it cannot listen on is one sentence."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the store's process: serve until the launcher kills it (or dies: the parent-death signal)
        code = 0
        try:
            os.close(ready_r)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends it, after its ranks
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _die_with_parent()
            from torch.distributed import TCPStore

            try:
                store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
                os.write(ready_w, f"ok {store.port}".encode())
            except RuntimeError as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                os.write(ready_w, f"error {first}".encode()[:4000])
                os._exit(1)
            os.close(ready_w)
            while True:
                signal.pause()
        except BaseException:  # noqa: BLE001 - the child must reach os._exit whatever happened
            code = 1
        finally:
            os._exit(code)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        said = ready.read().decode(errors="replace")  # the child writes once, then closes (or dies: EOF)
    if said.startswith("ok "):
        return pid, int(said.split()[1])
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    reason = said[len("error "):] if said.startswith("error ") else "its process ended before it listened"
    raise UserError(f"the launcher cannot listen on port {port} ({reason}); choose a free --master-port or leave "
                    "it out.")


def error_file_cause(data: dict[str, Any]) -> str:
    """The cause line of torch's error file (``@record``): its exception's message, or, where that has no text on
    its first line (``RuntimeError:`` re-raised from another, as torch's pipeline stage does), the first exception
    line of the recorded traceback, which Python prints root cause first."""
    from bimetal.rank_output import cause_of

    entry = data["message"]
    message = str(entry["message"] if isinstance(entry, dict) else entry)
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    stack = entry.get("extraInfo", {}).get("py_callstack", "") if isinstance(entry, dict) else ""
    if first.endswith(":") and isinstance(stack, str):
        in_traceback = False
        for line in stack.splitlines():
            in_traceback = in_traceback or line.startswith("Traceback (most recent call last)")
            cause = cause_of(line, in_traceback)
            if cause is not None and not cause.endswith(":"):
                return cause
    return message


_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe")
"""A rank's cause line that says only that a peer went away (Gloo's words, on a socket the peer's death closed)."""


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class _Rank:
    rank: int
    vendor: str
    proc: subprocess.Popen | ForkedRank
    code: int | None = None
    stopped_by_us: bool = False
    seen: float = float("inf")  # when the launcher saw it end (time.monotonic): who died first

    def label(self) -> str:
        return f"rank {self.rank}" + (f" ({self.vendor})" if self.vendor else "")


@dataclass
class _Outcome:
    status: int
    lines: list[str] = field(default_factory=list)
    restartable: bool = False


class RankSupervisor:
    """Start ``nproc`` copies of ``cmd`` as the ranks of a single-node job and watch them to the end."""

    def __init__(self, cmd: list[str], nproc: int, env: dict[str, str], max_restarts: int = 0,
                 name: str = "bimetal launch", vendors: list[str] | None = None, grace_s: float = 10.0,
                 port: int = 0, output: RankOutput | None = None, fork: bool = False) -> None:
        self.cmd, self.nproc, self.env, self.max_restarts = cmd, nproc, env, max_restarts
        self.fork = fork  # ranks start as forks of this process (bimetal.rank_fork), cmd[0] being this Python
        self.port = port  # of the store the launcher hosts (--master-port); 0: any free one
        self.name, self.vendors, self.grace_s, self.output = name, vendors or [], grace_s, output
        self._signal: int | None = None
        self._ranks: list[_Rank] = []
        # one per launch, as torchrun --standalone's: a run folder's elastic-job.json names this job only
        self.run_id = f"bimetal-{uuid.uuid4().hex[:12]}"

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def run(self) -> int:
        """Run the job (restarting it up to ``max_restarts`` times); returns the launcher's exit status."""
        if self.fork:
            preload(self.cmd[1:])
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        store_pid, port = _start_store(self.port)
        root = Path(tempfile.mkdtemp(prefix="bimetal-launch-"))
        try:
            for attempt in range(self.max_restarts + 1):
                outcome = self._attempt(attempt, port, root / f"attempt{attempt}")
                if self.output is not None:  # every line the ranks wrote, and why a hidden one failed, come first
                    self.output.finish([rk.rank for rk in self._ranks if rk.code not in (None, 0)
                                        and not rk.stopped_by_us])
                if outcome.restartable and attempt < self.max_restarts and self._signal is None:
                    _log.warning("%s: %s; restarting all %d ranks (restart %d of %d).", self.name,
                                 outcome.lines[0].rstrip("."), self.nproc, attempt + 1, self.max_restarts)
                    continue
                for line in outcome.lines:
                    print(f"{self.name}: {line}", file=sys.stderr, flush=True)
                return outcome.status
            return 1  # not reached: the last attempt always returns
        finally:
            self._stop(self._ranks, 0.0)
            for s, handler in old.items():
                signal.signal(s, handler)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(store_pid, signal.SIGKILL)
                os.waitpid(store_pid, 0)
            shutil.rmtree(root, ignore_errors=True)

    def _attempt(self, attempt: int, port: int, folder: Path) -> _Outcome:
        folder.mkdir(parents=True)
        base = dict(self.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(self.nproc),
                    LOCAL_WORLD_SIZE=str(self.nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                    ROLE_WORLD_SIZE=str(self.nproc), TORCHELASTIC_RESTART_COUNT=str(attempt),
                    TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts), TORCHELASTIC_RUN_ID=self.run_id,
                    TORCHELASTIC_USE_AGENT_STORE="True", **{REPORT_ENV: str(folder)})
        self._ranks = []
        # Every rank starts while this process has no other thread: a fork (the ranks themselves, or Popen's
        # child before its exec) copies only the forking thread, so a lock another thread held at that moment
        # would stay held forever in the child. The store's server runs in a process of its own
        # (``_start_store``); the output pumps start after the last rank.
        for r in range(self.nproc):
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r),
                       **{ERROR_FILE_ENV: str(folder / f"rank-{r}.error.json")})
            proc: subprocess.Popen | ForkedRank
            if self.fork:
                proc = fork_rank(self.cmd[1:], env, pipes=self.output is not None, in_child=_die_with_parent,
                                 guard=self.output.lock if self.output is not None else None)
            else:
                pipes = self.output.popen_kwargs() if self.output is not None else {}
                proc = subprocess.Popen(self.cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                        **pipes)
            self._ranks.append(_Rank(r, self.vendors[r] if r < len(self.vendors) else "", proc))
        if self.output is not None:
            for rk in self._ranks:
                self.output.attach(rk.rank, rk.proc)
        return self._watch(folder, attempt)

    def _watch(self, folder: Path, attempt: int) -> _Outcome:
        """Watch the ranks of an attempt to their end: its outcome."""
        ranks = self._ranks
        deadline: float | None = None
        restartable = attempt < self.max_restarts
        while True:
            if self._signal is not None:
                self._stop(ranks, 0.0)
                return self._interrupted(folder)
            for rk in ranks:
                if rk.code is None:
                    rk.code = rk.proc.poll()
                    if rk.code is not None:
                        rk.seen = time.monotonic()
            if all(rk.code == 0 for rk in ranks):
                return _Outcome(0)
            failed = [rk for rk in ranks if rk.code not in (None, 0)]
            if failed and deadline is None:
                user_error = any(self._report(folder, rk.rank).get("status") == 2 for rk in failed)
                # restarting or a user error: the survivors have nothing to add; a death: let them say why
                deadline = time.monotonic() + (0.0 if restartable else 1.0 if user_error else self.grace_s)
            if deadline is not None and (all(rk.code is not None for rk in ranks) or time.monotonic() > deadline):
                break
            time.sleep(0.02)  # fine enough that a death and the exits it causes are rarely seen in one pass
        self._stop(ranks, 3.0)
        if self.output is not None:
            self.output.drain()  # every stderr line is in, for the cause lines
        return self._verdict(ranks, folder, restartable)

    def _stop(self, ranks: list[_Rank], grace: float) -> None:
        """SIGTERM every rank still running (its whole session), SIGKILL after ``grace`` seconds."""
        live = [rk for rk in ranks if rk.proc.poll() is None]
        for rk in live:
            rk.stopped_by_us = True
            self._kill(rk, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(rk.proc.poll() is None for rk in live) and time.monotonic() < end:
            time.sleep(0.05)
        for rk in live:
            if rk.proc.poll() is None:
                self._kill(rk, signal.SIGKILL)
            rk.proc.wait()
            rk.code = rk.proc.returncode
            rk.seen = min(rk.seen, time.monotonic())

    @staticmethod
    def _kill(rk: _Rank, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rk.proc.pid, sig)

    @staticmethod
    def _report(folder: Path, rank: int) -> dict[str, Any]:
        try:
            data = json.loads(Path(folder, f"rank-{rank}.json").read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _last_step(folder: Path, rank: int) -> int | None:
        try:
            return int(Path(folder, f"rank-{rank}.step").read_text())
        except (OSError, ValueError):
            return None

    def _steps_text(self, folder: Path, rank: int) -> str:
        step = self._last_step(folder, rank)
        if step is not None:
            return f" after completing step {step}"
        # a job that counts steps (some rank noted one) but not this rank: it died in its first step
        return " before completing a step" if any(folder.glob("rank-*.step")) else ""

    def _interrupted(self, folder: Path) -> _Outcome:
        sig = self._signal or signal.SIGTERM
        steps = [s for s in (self._last_step(folder, rk.rank) for rk in self._ranks) if s is not None]
        where = f" (last completed step {min(steps)})" if steps else ""
        return _Outcome(128 + sig, [f"stopped by {signal.Signals(sig).name}: all {self.nproc} ranks it started are "
                                    f"stopped{where}."])

    def _cause(self, folder: Path, rank: int) -> str:
        """The line that says why ``rank`` crashed: its exception from the error file, else (with ``output``) the
        C++ ``what():`` or Python exception line of its stderr; "" when there is none."""
        try:
            text = error_file_cause(json.loads(Path(folder, f"rank-{rank}.error.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            text = self.output.cause(rank) if self.output is not None else ""
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return first if len(first) <= 300 else first[:297] + "..."

    def _verdict(self, ranks: list[_Rank], folder: Path, restartable: bool) -> _Outcome:
        """One line per failure: the first rank that died (how, its step, its cause), then the ranks that ended
        after it as one "stopped because rank R died" line, then ranks the launcher had to stop."""
        reports = {rk.rank: self._report(folder, rk.rank) for rk in ranks}
        user = sorted((rep["time"], rep["message"]) for rep in reports.values()
                      if rep.get("status") == 2 and isinstance(rep.get("message"), str))
        if user:  # the same mistake seen by several ranks is one sentence
            return _Outcome(2, [user[0][1]])
        said = {r: rep["message"] for r, rep in reports.items() if isinstance(rep.get("message"), str)}
        ended = [rk for rk in ranks if rk.code not in (None, 0) and not rk.stopped_by_us]
        # An exit on a lost peer connection follows the death of that peer, though the launcher can see it first
        # (an all-Gloo titan run: rank 6's "Connection closed by peer" exit was seen before rank 7's SIGSEGV)
        signalled = any((rk.code or 0) < 0 for rk in ended)
        lost = {rk.rank for rk in ended if signalled and (rk.code or 0) > 0 and rk.rank not in said
                and _PEER_LOST.search(self._cause(folder, rk.rank))}
        # who went first: the launcher's poll order, then a death by signal before an exit (a survivor's exit
        # follows the death that caused it, possibly within one poll), then a crash before a sentence
        ended.sort(key=lambda rk: (rk.rank in lost, rk.seen, 0 if (rk.code or 0) < 0 else 1 if rk.rank not in said
                                   else 2, rk.rank))
        end = "." if restartable else "; the job stopped."
        lines: list[str] = []
        first = ended[0] if ended and ended[0].rank not in said else None
        if first is None:  # no rank died: the ranks' own sentences (a stall, a broken link) say why
            lines += [message for _, message in sorted((reports[r].get("time", 0.0), m) for r, m in said.items())]
            lines += [f"{rk.label()} {_how(rk.code or 0)}{self._steps_text(folder, rk.rank)}{end}"
                      for rk in ended if rk.rank not in said]
        else:
            cause = self._cause(folder, first.rank)
            lines.append(f"{first.label()} {_how(first.code or 0)}{self._steps_text(folder, first.rank)}"
                         + (f" ({cause})" if cause else "") + end)
            rest = ended[1:] + [rk for rk in ranks if rk.stopped_by_us and rk.rank in said]
            also = [rk for rk in rest if (rk.code or 0) < 0 and rk.rank not in said]  # died of a signal too
            if also:
                how = sorted({_how(rk.code or 0) for rk in also})
                lines.append(f"{_ranks_text(also)} {'were' if len(also) > 1 else 'was'} also "
                             f"{' or '.join(h.removeprefix('was ') for h in how)}.")
            stopped = [rk for rk in rest if rk not in also]
            if stopped:
                why = sorted((reports[rk.rank].get("time", 0.0), said[rk.rank]) for rk in stopped if rk.rank in said)
                crashes = [self._cause(folder, rk.rank) for rk in stopped if rk.rank not in said]
                detail = (why[0][1] if why else next((c for c in crashes if c), "")).rstrip(".")
                lines.append(f"{_ranks_text(stopped)} stopped because rank {first.rank} died"
                             + (f" (first reason given: {detail})" if detail else "") + ".")
        slow = [rk for rk in ranks if rk.stopped_by_us and rk.rank not in said]
        if slow:
            lines.append(f"{_ranks_text(slow)} did not stop within {self.grace_s:g} s of the failure and "
                         f"{'were' if len(slow) > 1 else 'was'} stopped by the launcher.")
        if not lines:
            lines = ["the job stopped for no reason the ranks gave."]
        return _Outcome(1, lines, restartable=restartable)


def _ranks_text(ranks: list[_Rank]) -> str:
    """"rank 2 (amd)", "ranks 0 (nvidia), 1 (nvidia) and 2 (amd)"."""
    names = [rk.label().removeprefix("rank ") for rk in sorted(ranks, key=lambda rk: rk.rank)]
    if len(names) == 1:
        return f"rank {names[0]}"
    return f"ranks {', '.join(names[:-1])} and {names[-1]}"
