"""cpu-forward's own counters beyond the base ones: bytes per stripe and transfers that needed failover.

``CpuForwardProcessGroup.comm_stats()`` joins them with the base counters (bytes staged through host memory)
and the staging pool's allocations; the trainer logs their per-step differences (``bimetal.comm.meter``).
"""

from __future__ import annotations

import threading


class StripeStats:
    """Bytes each stripe carried out of this rank (point-to-point sends, re-sends included) and the sends that
    re-sent chunks after losing a stripe."""

    def __init__(self, stripes: int):
        self._lock = threading.Lock()
        self.stripe_bytes = [0] * stripes
        self.failovers = 0
        """Point-to-point sends that lost a stripe mid-message and re-sent its chunks on the others."""

    def transfer(self, moved: dict[int, int], rounds: int) -> None:
        with self._lock:
            for s, n in moved.items():
                self.stripe_bytes[s] += n
            self.failovers += rounds > 0

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            out = {"failovers": self.failovers}
            out.update({f"bytes_stripe{s}": n for s, n in enumerate(self.stripe_bytes)})
            return out
