"""Fault injection into a cpu-forward group, for the reliability tests: wrappers around its Gloo stripes, so the
production classes carry no test hooks (as torchft keeps fault injection in wrapper groups).

``inject_fault(group, "corrupt")`` flips one byte of the next point-to-point message this rank sends (after its
checksum was computed: the receiver must notice); ``inject_fault(group, "stall", stripe=s, after=n)`` makes
stripe ``s`` of this rank stall after ``n`` more point-to-point posts: nothing posted, nothing completes, until
failover kills the stripe. The wrappers pass every other call through to the Gloo group they wrap.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch

from bimetal.comm.cpu_forward.links import CONTROL_TAG, POISON_TAG
from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup


class _Passthrough:
    """A stripe wrapper: what it does not override goes to the wrapped Gloo group."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Stalled:
    """A stalled stripe's op as this rank sees it: never completes; fails once the stripe is killed."""

    def __init__(self, gone: threading.Event):
        self._gone = gone

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._gone.wait(timeout.total_seconds() if timeout is not None else None):
            raise RuntimeError("stripe closed while stalled (injected fault)")
        raise RuntimeError("timed out on a stalled stripe (injected fault)")


class StallingStripe(_Passthrough):
    """Posts ``after`` more sends/receives normally, then stalls every later one (failover's kill still goes
    through: it closes the Gloo context, and the stalled ops fail as the real ones would)."""

    def __init__(self, inner: Any, after: int):
        super().__init__(inner)
        self.left = after
        self.gone = threading.Event()
        self._lock = threading.Lock()

    def _post(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        if tag == POISON_TAG:  # failover kills this stripe
            self.gone.set()
            return getattr(self.inner, kind)(tensors, peer, tag)
        with self._lock:
            if self.left <= 0:
                return _Stalled(self.gone)
            self.left -= 1
        return getattr(self.inner, kind)(tensors, peer, tag)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._post("send", tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return self._post("recv", tensors, peer, tag)


class CorruptingStripe(_Passthrough):
    """Sends a copy of the next non-empty message chunk with its first byte flipped (once per ``armed`` event,
    shared by every stripe of the group, so that exactly one chunk of one message is corrupted)."""

    def __init__(self, inner: Any, armed: threading.Event):
        super().__init__(inner)
        self.armed = armed

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        (buf,) = tensors
        if tag != CONTROL_TAG and buf.numel() and self.armed.is_set():
            self.armed.clear()
            bad = buf.clone()  # (the Gloo work holds it until the send completed)
            bad.reshape(-1).view(torch.uint8)[0] ^= 0xFF
            return self.inner.send([bad], peer, tag)
        return self.inner.send(tensors, peer, tag)


def inject_fault(group: Any, kind: str, stripe: int = 0, after: int = 0) -> None:
    """Wrap the stripes of cpu-forward ``group`` (this rank only) with a ``"corrupt"`` or ``"stall"`` fault."""
    if not isinstance(group, CpuForwardProcessGroup):
        raise TypeError(f"inject_fault needs a cpu-forward group, not {type(group).__name__}")
    stripes = group.state.stripes  # (the list ``links`` holds too)
    if kind == "stall":
        if not 0 <= stripe < len(stripes):
            raise ValueError(f"no stripe {stripe}; this group has {len(stripes)}")
        stripes[stripe] = StallingStripe(stripes[stripe], after)
    elif kind == "corrupt":
        armed = threading.Event()
        armed.set()
        for s, inner in enumerate(stripes):
            stripes[s] = CorruptingStripe(inner, armed)
    else:
        raise ValueError(f"unknown fault {kind!r}; expected 'corrupt' or 'stall'")
