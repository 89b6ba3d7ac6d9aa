"""Rank output through the launcher: every line prefixed with its rank, only the chosen ranks shown.

What torchrun does with ``--role rank --tee 3 --local-ranks-filter 0`` (torchtitan's launch script): each line a
rank writes to stdout or stderr reaches the launcher's stdout or stderr as ``[rank<R>]:<line>``, and ranks left
out of the filter print nothing. The launcher reads each rank's two streams through pipes, one thread per
stream, and writes whole lines under one lock, so lines of different ranks never mix within a line.

A rank left out keeps its last ``tail`` lines of stderr: when it fails, ``finish`` shows them (prefixed) before
the launcher's sentence, so the filter never hides why a rank died. faulthandler's thread dump (torch's
``@record`` turns it on: a rank that aborts prints every thread's stack) is left out of that tail, so it cannot
push the cause out; and every rank's cause line - the C++ ``what():`` of an uncaught exception, the last
line of a Python traceback (an exception without a message of its own, re-raised from one that has, keeps the
earlier line), or the line glibc's heap checks or the C++ runtime printed as they aborted the rank (``malloc():
...``, ``terminate called ...``, which faulthandler's dump follows; a segfault prints none) - is kept for the
launcher's sentence (``cause``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import deque
from typing import IO, TYPE_CHECKING, Any

from bimetal.errors import UserError

if TYPE_CHECKING:
    from bimetal.rank_fork import ForkedRank


_DUMP_START = b"Fatal Python error:"
_DUMP_LINE = re.compile(rb"^(\s*$|Thread 0x|Current thread 0x|  File |  <no Python frame>|  Garbage-collecting|"
                        rb"Extension modules:|Stack \(most recent call first\))")
"""faulthandler's dump: its first line, then the lines it consists of (blank, thread headers, frames)."""
_LIBC_ABORT = re.compile(r"^(\w+\(\): |double free or corruption|corrupted |terminate called )")
"""What glibc's heap checks (``malloc(): unaligned tcache chunk detected``, ``double free or corruption``, ...) and
the C++ runtime print as they abort a process, on the line before faulthandler's dump."""


_NOT_CAUSES = ("Traceback", "During handling of the above exception", "The above exception was the direct cause")


def cause_of(line: str, in_traceback: bool) -> str | None:
    """The cause a stderr line states, if it states one: a C++ ``what():`` or, inside a Python traceback, the
    exception line (the first unindented line after the frames)."""
    if "what():" in line:
        return line.split("what():", 1)[1].strip() or None
    if in_traceback and line and not line[0].isspace() and not line.startswith(_NOT_CAUSES):
        return line.strip()
    return None


def parse_filter(text: str, world: int) -> set[int]:
    """``"0,3"`` -> ``{0, 3}``; ``UserError`` naming the text for anything but ranks of a ``world``-rank job."""
    try:
        ranks = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        ranks = set()
    if not ranks or min(ranks) < 0 or max(ranks) >= world:
        raise UserError(f"--local-ranks-filter {text!r} must list ranks of this {world}-rank job separated by commas, "
                        f"e.g. 0 or 0,{world - 1}")
    return ranks


class RankOutput:
    """Prefixes and filters the output of the ranks a launcher starts (``RankSupervisor(output=...)``)."""

    def __init__(self, show: set[int] | None = None, tail: int = 40, stdout: IO[Any] | None = None,
                 stderr: IO[Any] | None = None) -> None:
        self.show = show
        """Ranks whose lines are shown; None: every rank."""
        self.tail = tail
        self._out, self._err = stdout or sys.stdout, stderr or sys.stderr
        self._tails: dict[int, deque[bytes]] = {}
        self._causes: dict[int, str] = {}
        self._dumped: dict[int, int] = {}  # lines of faulthandler's dump left out of each rank's tail
        self._threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # held while writing a line (and across a forked rank's start)

    @staticmethod
    def popen_kwargs() -> dict[str, Any]:
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    def shown(self, rank: int) -> bool:
        return self.show is None or rank in self.show

    def attach(self, rank: int, proc: subprocess.Popen | ForkedRank) -> None:
        """Start reading ``proc``'s two pipes (it was started with ``popen_kwargs``)."""
        self._tails[rank] = deque(maxlen=self.tail)
        for stream, sink in ((proc.stdout, self._out), (proc.stderr, self._err)):
            if stream is None:
                continue
            t = threading.Thread(target=self._pump, args=(rank, stream, sink, sink is self._err), daemon=True,
                                 name=f"bimetal-rank{rank}-output")
            t.start()
            self._threads.append(t)

    def _pump(self, rank: int, stream: IO[bytes], sink: IO[Any], is_err: bool) -> None:
        prefix = f"[rank{rank}]:".encode()
        show = self.shown(rank)
        dumping = in_traceback = False
        before = ""  # the previous stderr line
        for line in iter(stream.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"
            if is_err:
                text = line.decode(errors="replace").rstrip("\n")
                in_traceback = in_traceback or text.startswith("Traceback (most recent call last)")
                cause = cause_of(text, in_traceback)
                if cause is not None:
                    if not (cause.endswith(":") and rank in self._causes):  # "RuntimeError:", its text below
                        self._causes[rank] = cause
                    in_traceback = False
                if line.startswith(_DUMP_START) and rank not in self._causes and _LIBC_ABORT.match(before):
                    self._causes[rank] = before.strip()  # what the C library said as it aborted the process
                before = text
                dumping = line.startswith(_DUMP_START) or (dumping and bool(_DUMP_LINE.match(line)))
                if dumping and not line.startswith(_DUMP_START):
                    self._dumped[rank] = self._dumped.get(rank, 0) + 1
                elif not show:
                    self._tails[rank].append(line)
            if show:
                self._write(sink, prefix + line)
        stream.close()

    def cause(self, rank: int) -> str:
        """The last cause line ``rank`` wrote to stderr (``cause_of``), or ""."""
        return self._causes.get(rank, "")

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the pipes to close (the ranks have exited): every line is in."""
        for t in self._threads:
            t.join(timeout_s)  # a rank's leftover child holding the pipe must not hold the launcher
        self._threads = []

    def _write(self, sink: IO[Any], data: bytes) -> None:
        with self.lock:
            buffer = getattr(sink, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                sink.write(data.decode(errors="replace"))
            sink.flush()

    def finish(self, failed: list[int], timeout_s: float = 5.0) -> None:
        """Wait for the pipes to drain (the ranks have exited), then show the stderr tail of each rank in
        ``failed`` that the filter hid."""
        self.drain(timeout_s)
        for rank in failed:
            lines = self._tails.get(rank)
            if self.shown(rank) or not lines:
                continue
            dumped = self._dumped.get(rank, 0)
            left = f"; {dumped} lines of faulthandler's thread dump left out" if dumped else ""
            head = f"[rank{rank}]:(the last {len(lines)} lines of rank {rank}'s stderr, hidden by the filter{left})\n"
            self._write(self._err, head.encode() + b"".join(f"[rank{rank}]:".encode() + x for x in lines))

    def torchrun_args(self) -> list[str]:
        """The same behaviour asked of torchrun (multi-node launches)."""
        args = ["--role", "rank", "--tee", "3"]
        if self.show is not None:
            args.append("--local-ranks-filter=" + ",".join(map(str, sorted(self.show))))
        return args
