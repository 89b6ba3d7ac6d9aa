"""Receive-slot credits of the eager protocol: which of a peer's slots we may write, which of ours we owe back.

A sender takes a credit (a free slot of the pool the receiver registered for it) before each eager write; the
receiver owes the slot back once it has copied the data out. Owed credits ride on the next note to that peer
or, after a short delay (or when half the slots are owed), in a ``credit`` note of their own, so a ping-pong
pays no extra control message and a fast sender never overwrites data the receiver has not consumed.
"""

from __future__ import annotations

import collections
import time

CREDIT_DELAY_S = 1e-3  # owed credits wait this long for a note to ride on before they get their own


class Credits:
    """Free slots per peer (ours to write into theirs) and owed slots per peer (theirs, in our pools)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: dict[int, collections.deque[int]] = {}
        self._owed: dict[int, list[int]] = collections.defaultdict(list)  # peer -> slots consumed, not returned
        self._owed_since: dict[int, float] = {}

    def add_peer(self, peer: int) -> None:
        self._free[peer] = collections.deque(range(self.slots))

    def take(self, peer: int) -> int | None:
        """A free slot of ``peer``'s pool for us, or None while all are in use."""
        free = self._free[peer]
        return free.popleft() if free else None

    def returned(self, peer: int, slots: tuple[int, ...]) -> None:
        """``peer`` consumed these slots: we may write them again."""
        self._free[peer].extend(slots)

    def owe(self, peer: int, slot: int) -> None:
        self._owed[peer].append(slot)
        self._owed_since.setdefault(peer, time.monotonic())

    def ride_along(self, peer: int) -> list[int]:
        """The slots we owe ``peer``, now handed over (they go out on the note being sent)."""
        self._owed_since.pop(peer, None)
        return self._owed.pop(peer, [])

    def due(self, force: bool = False) -> list[int]:
        """Peers whose owed credits should go out in a note of their own now."""
        now = time.monotonic()
        return [peer for peer, owed in self._owed.items()
                if force or 2 * len(owed) >= self.slots or now - self._owed_since.get(peer, now) >= CREDIT_DELAY_S]

    def forget(self, peer: int) -> None:
        """``peer`` is gone: nothing is owed to it any more."""
        self._owed.pop(peer, None)
        self._owed_since.pop(peer, None)

    @property
    def owing(self) -> bool:
        return bool(self._owed)
