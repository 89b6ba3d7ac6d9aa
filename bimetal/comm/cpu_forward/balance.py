"""Stripe shares that follow the links' measured rates, so every stripe of a message finishes at about the same
time on links of unequal or changing speed (a degraded NIC, a link shared with other traffic).

The receiver of a striped transfer measures, per stripe, the bytes that arrived in round 0 and when the last
of them did; ``rebalance`` turns that into the shares of the next transfer in the same direction with the
same peer, and the receiver's final status carries them (``failover.Status``), so both ends plan the next
message from the same numbers. Shares move halfway toward the measured rates each time (noise on one
transfer does not swing the split), never drop below about an eighth of an equal share (a stripe that was slow
keeps being measured and wins its share back when it recovers) and are zero for dead stripes.
"""

from __future__ import annotations

WEIGHT_SCALE = 1 << 16
"""Shares are integers summing to about this."""
MIN_MEASURED_BYTES = 1 << 20
"""A stripe's rate is measured only when it carried at least this much (smaller: per-op overhead dominates)."""


def rebalance(old: list[int] | None, k: int, dead_mask: int, moved: dict[int, int],
              seconds: dict[int, float]) -> list[int] | None:
    """The next shares from the current ones (None: equal), the dead stripes, and bytes/seconds per stripe
    (seconds from the start of round 0 to the stripe's last completed chunk). None: keep equal shares."""
    live = [s for s in range(k) if not dead_mask >> s & 1]
    if k == 1 or not live:
        return None
    current = [float(w) for w in old] if old and len(old) == k else [1.0] * k
    base = sum(current[s] for s in live) or 1.0
    share = {s: current[s] / base for s in live}
    if all(moved.get(s, 0) >= MIN_MEASURED_BYTES and seconds.get(s, 0.0) > 0 for s in live):
        rates = {s: moved[s] / seconds[s] for s in live}
        total = sum(rates.values())
        share = {s: 0.5 * share[s] + 0.5 * rates[s] / total for s in live}
    floor = 1.0 / (8 * len(live))
    share = {s: max(v, floor) for s, v in share.items()}
    norm = sum(share.values())
    weights = [0] * k
    for s in live:
        weights[s] = max(1, round(WEIGHT_SCALE * share[s] / norm))
    if old is None and dead_mask == 0 and max(weights) - min(weights) <= 1:
        return None  # still equal: keep the plain split
    return weights
