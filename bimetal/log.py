"""Diagnostics: stdlib ``logging``, one line each on stderr, prefixed ``[rank N]`` in a rank.

Modules log with ``logging.getLogger(__name__)`` (warnings, failed sub-runs, restarts); Python warnings
(``warnings.warn`` from bimetal or torch) take the same path once a rank has called ``rank_logging``. A
process that is not a rank (the launcher, the lab) prints its records as the bare message (Python's
last-resort handler). What a command is for stays ``print``: tables, the step line, reports, and the one
sentence of a ``bimetal.errors.UserError``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

_installed: list[int] = []  # the rank whose handler is installed in this process


class _DropRepeats(logging.Filter):
    """A warning that is both logged and raised as a Python warning (device-direct fallback) shows once."""

    def __init__(self) -> None:
        super().__init__()
        self._last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        repeat, self._last = text == self._last, text
        return not repeat


def rank_logging(rank: int) -> None:
    """In a rank: warnings and log records at WARNING and above on stderr, one line each, ``[rank N] ...``.

    Called by each rank's entry point; a second call in the same process changes nothing.
    """
    if _installed:
        return
    _installed.append(rank)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s: %(message)s"))
    handler.addFilter(_DropRepeats())
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    log = logging.getLogger("bimetal.warnings")

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        text = str(message).strip()
        log.warning("%s", text.splitlines()[0] if text else category.__name__)

    warnings.showwarning = show
    # checkpoints are written per stage with DCP's no_dist mode on purpose (bimetal.train.checkpoint)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
