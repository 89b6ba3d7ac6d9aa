"""The stripes of a cpu-forward group as failover sees them: which Gloo contexts still work, how one is left for
good (``StripeSet.kill``), and the threads that wait on one stripe's operations (``Waiter``).

A stripe is killed by timing out a dummy receive on it (``POISON_TAG``): Gloo then closes every pair of that
context, fails the ops still posted there and writes nothing more into their buffers (measured on torch 2.13).
Fault injection wraps a stripe from outside (``cpu_forward.faults``); nothing here knows about it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

CONTROL_TAG = 0x7FFF0001  # failover's status messages; chunks keep the caller's tag
POISON_TAG = 0x7FFF0002  # the dummy receive that kills a stripe; never sent


class StripeSet:
    """The Gloo contexts of one group and which of them still work; shared by all of the group's transfers."""

    def __init__(self, pgs: list[Any], interfaces: list[str | None]):
        self.pgs = pgs
        self.interfaces = interfaces
        self.dead: dict[int, str] = {}
        """Stripe -> why it was left (stall or the Gloo error); never used again."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.pgs)

    def alive(self) -> list[int]:
        with self._lock:
            return [s for s in range(len(self.pgs)) if s not in self.dead]

    def is_dead(self, s: int) -> bool:
        with self._lock:
            return s in self.dead

    def dead_mask(self) -> int:
        with self._lock:
            return sum(1 << s for s in self.dead)

    def post(self, s: int, kind: str, buf: torch.Tensor, peer: int, tag: int) -> Any:
        pg = self.pgs[s]
        return pg.send([buf], peer, tag) if kind == "send" else pg.recv([buf], peer, tag)

    def kill(self, s: int, peer: int, reason: str, group: str, peer_global: int) -> None:
        """Leave stripe ``s`` for good: close its Gloo context (every pair) and warn once."""
        with self._lock:
            if s in self.dead:
                return
            self.dead[s] = reason
        # An application-side timeout makes Gloo close all pairs of the context and fail their ops.
        with contextlib.suppress(RuntimeError):
            self.pgs[s].recv([torch.zeros(1)], peer, POISON_TAG).wait(timedelta(milliseconds=1))
        iface = self.interfaces[s] if s < len(self.interfaces) and self.interfaces[s] else "Gloo's default device"
        warnings.warn(f"bimetal cpu-forward group {group!r}: stripe {s} (interface {iface}) to peer {peer_global} "
                      f"is degraded ({reason}); its chunks are re-sent on the other stripes and later transfers "
                      "avoid it", RuntimeWarning, stacklevel=2)


class Waiter:
    """A thread that waits on one stripe's works in posting order and reports each outcome."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def watch(self, work: Any, end: float, report: Callable[[str | None], None]) -> None:
        self._jobs.put((work, end, report))

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, end, report = job
            try:
                work.wait(timedelta(seconds=max(0.001, end - time.monotonic())))
            except Exception as exc:  # the Gloo error of this stripe: the coordinator decides what it means
                report(short_error(exc))
            else:
                report(None)


def short_error(exc: BaseException) -> str:
    """A Gloo error's first sentence, without its source-file prefix."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]
