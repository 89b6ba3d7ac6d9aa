"""What a training job prints while it runs: one step line per job, a progress bar on a terminal (every
rank's warnings go to ``bimetal.log``).

The step line comes from one rank only (the trainer picks the last stage's first replica, whose step ends
last); on a terminal it is a progress bar with an ETA redrawn in place, with a full line every
``metrics.log_every`` steps; elsewhere (a pipe, a log file, CI) plain lines every ``log_every`` steps and at the
last step, each with its ETA.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, TextIO

_BAR = 24


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class StepConsole:
    """Shows the steps of one job from ``start`` to ``total``."""

    def __init__(self, total: int, start: int = 0, log_every: int = 1, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.total, self.start, self.log_every = total, start, log_every
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._times: deque[float] = deque(maxlen=20)
        self._bar_shown = False

    def eta(self, step: int) -> float:
        """Seconds left at the mean of the recent steps (the first one, a warm-up, dropped once there are more)."""
        times = list(self._times)[1:] if len(self._times) > 1 else list(self._times)
        return (sum(times) / len(times)) * (self.total - step) if times else 0.0

    def line(self, rec: dict[str, Any]) -> str:
        mfu = f"{rec['mfu'] * 100:.1f}%" if rec.get("mfu") is not None else "unknown"
        return (f"step {rec['step']:5d}/{self.total} | loss {rec['loss']:.4f} | {rec['tokens_per_s']:9.0f} tok/s | "
                f"mfu {mfu} | lr {rec['lr']:.2e} | xvendor {rec['xvendor_comm_s'] * 1e3:.0f} ms "
                f"{rec['xvendor_bytes'] / 1e6:.2f} MB | eta {_duration(self.eta(rec['step']))}")

    def show(self, rec: dict[str, Any]) -> None:
        """Show step ``rec['step']`` (a metrics record)."""
        step = rec["step"]
        self._times.append(float(rec["step_s"]))
        full = step % self.log_every == 0 or step == self.total
        if not self.tty:
            if full:
                print(self.line(rec), file=self.stream, flush=True)
            return
        if full:
            self.stream.write("\r\x1b[K" + self.line(rec) + "\n")
        span = max(1, self.total - self.start)
        done = (step - self.start) / span
        filled = int(done * _BAR)
        bar = "#" * filled + "." * (_BAR - filled)
        self.stream.write(f"\r\x1b[K[{bar}] {done * 100:3.0f}% step {step}/{self.total} loss {rec['loss']:.4f} "
                          f"eta {_duration(self.eta(step))}")
        if step == self.total:
            self.stream.write("\r\x1b[K")
        self.stream.flush()
