"""Rank output through the launcher: every line prefixed with its rank, only the chosen ranks shown.

What torchrun does with ``--role rank --tee 3 --local-ranks-filter 0`` (torchtitan's launch script): each line a
rank writes to stdout or stderr reaches the launcher's stdout or stderr as ``[rank<R>]:<line>``, and ranks left
out of the filter print nothing. The launcher reads each rank's two streams through pipes, one thread per
stream, and writes whole lines under one lock, so lines of different ranks never mix within a line.

A rank left out keeps its last ``tail`` lines of stderr: when it fails, ``finish`` shows them (prefixed) before
the launcher's sentence, so the filter never hides why a rank died.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from typing import IO, TYPE_CHECKING, Any

from bimetal.errors import UserError

if TYPE_CHECKING:
    from bimetal.rank_fork import ForkedRank


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
        for line in iter(stream.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"
            if not show:
                if is_err:
                    self._tails[rank].append(line)
                continue
            self._write(sink, prefix + line)
        stream.close()

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
        for t in self._threads:
            t.join(timeout_s)  # a rank's leftover child holding the pipe must not hold the launcher
        self._threads = []
        for rank in failed:
            lines = self._tails.get(rank)
            if self.shown(rank) or not lines:
                continue
            head = f"[rank{rank}]:(the last {len(lines)} lines of rank {rank}'s stderr, hidden by the filter)\n"
            self._write(self._err, head.encode() + b"".join(f"[rank{rank}]:".encode() + x for x in lines))

    def torchrun_args(self) -> list[str]:
        """The same behaviour asked of torchrun (multi-node launches)."""
        args = ["--role", "rank", "--tee", "3"]
        if self.show is not None:
            args.append("--local-ranks-filter=" + ",".join(map(str, sorted(self.show))))
        return args
