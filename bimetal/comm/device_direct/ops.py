"""One device-direct point-to-point operation as the proxy sees it, its states, and the proxy's byte counters.

An ``Op`` is made on the caller's thread (``Proxy.send``/``recv``) and from then on advanced only by the proxy
thread through the states of ``OpState``; which states an op passes depends on its wire protocol
(``transfers.py``):

* send, eager:      NEW -> EAGER (waiting for a credit) -> EAGER_WRITING -> done
* send, rendezvous: NEW -> WAIT_RTR -> WRITING -> done
* recv, eager/inline: NEW -> POSTED -> done (when the note arrives)
* recv, rendezvous: NEW -> RTR (tensor registered, address sent) -> done (on ``fin``)

Inline sends never become an op of the proxy thread: the caller's thread sends their note at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future


class OpState(enum.Enum):
    """Where an operation stands (see the module docstring for the paths through them)."""

    NEW = "new"
    """Admitted; waits for the tensor's producer (its CUDA event) before anything moves."""
    EAGER = "eager"
    """Eager send: waits for a free slot (credit) at the receiver."""
    EAGER_WRITING = "eager-writing"
    """Eager send: the one write into the receiver's slot is in flight."""
    WAIT_RTR = "wait-rtr"
    """Rendezvous send: waits for the receiver's ``rtr`` with the address of its tensor."""
    WRITING = "writing"
    """Rendezvous send: chunk writes into the receiver's tensor in flight, ``window`` at a time."""
    POSTED = "posted"
    """Eager or inline recv: waits for the sender's note."""
    RTR = "rtr"
    """Rendezvous recv: the user's tensor is registered and its address sent; waits for ``fin``."""


def ready_event(t: torch.Tensor) -> Any:
    """An event on the producing stream, so the proxy does not read (or overwrite) the tensor too early."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


@dataclass(eq=False)  # ops compare by identity (their tensors make == ambiguous)
class Op:
    kind: str  # send | recv
    flat: torch.Tensor  # the user's bytes (uint8 view)
    peer: int
    tag: int
    what: str  # for error messages: group, op, sequence number
    fut: Future
    deadline: float
    ready: Any = None  # cuda event or None
    seq: int = -1
    state: OpState = OpState.NEW
    off: int = 0  # rendezvous sender: bytes posted
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # (handle, nbytes, send-pool buffer or -1)
    # in flight, oldest first
    region: Any = None  # the registration of the user's tensor in use (a Registrations region), if any
    addr: int = 0  # rendezvous: the receiver's registered address of the user tensor
    slot: int = -1
    since: float = 0.0  # rendezvous sender: when it started waiting for rtr

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.peer, self.tag, self.seq)


@dataclass
class Counters:
    """What the proxy moved, and how (``comm_stats`` of the group)."""

    staged_bytes: int = 0  # bytes bounced through host memory (all of it, the engine's bounces included)
    engine_bounce_bytes: int = 0  # of those, what Mooncake's TCP transport bounced inside the engine (no GPU path)
    direct_bytes: int = 0  # bytes the engine wrote from our memory into a peer's without a host bounce
    landing_copy_bytes: int = 0  # eager bytes copied slot -> user tensor on the same device
    inline_sent_bytes: int = 0  # host-tensor bytes that rode inside our notes (not staged: no bounce)
    inline_received_bytes: int = 0
    received_bytes: int = 0
    notes_sent: int = 0  # control messages, for profiling
    registrations: int = 0  # memory registrations with the engine (the group's own buffers, then cache misses)
    unregistrations: int = 0
    registered_bytes: int = 0  # registered now
    send_copy_bytes: int = 0  # bytes copied into the registered send pool (same device, no host bounce)

    def engine_bounce(self, n: int) -> None:
        """``n`` bytes of device memory that the engine's TCP transport copied through host memory: staging,
        counted as such, and also on their own so that bimetal's own staging (the rest) can be told apart."""
        self.staged_bytes += n
        self.engine_bounce_bytes += n

    def stats(self) -> dict[str, int]:
        """The counters under their ``comm_stats`` names."""
        return {"bytes_staged": self.staged_bytes, "bytes_engine_bounced": self.engine_bounce_bytes,
                "bytes_direct": self.direct_bytes,
                "landing_copy_bytes": self.landing_copy_bytes, "bytes_inline_sent": self.inline_sent_bytes,
                "bytes_inline_received": self.inline_received_bytes, "control_notes_sent": self.notes_sent,
                "engine_registrations": self.registrations, "engine_unregistrations": self.unregistrations,
                "engine_registered_bytes": self.registered_bytes, "bytes_send_copied": self.send_copy_bytes}
