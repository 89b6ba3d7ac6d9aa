"""The receiver's status message of a failover transfer (``failover``): a fixed-layout int64 tensor
``[magic, transfer number, round, flags, dead-stripe mask, missing count, bitmap of missing chunks, stripe
shares]``, encoded here and validated field by field when it comes off the network (no pickle).
"""

from __future__ import annotations

import torch

from bimetal.comm.base import OpRecord, TransportError
from bimetal.comm.cpu_forward.balance import WEIGHT_SCALE

MAGIC = 0x626D6631  # "bmf1"
HEADER = 6
DONE, MORE, CORRUPT = 0, 1, 2


def word_count(chunks: int) -> int:
    return (chunks + 31) // 32


class Status:
    """The receiver's status: fixed-layout int64, validated field by field (it comes off the network)."""

    def __init__(self, flags: int, dead_mask: int, missing: list[int], k: int, weights: list[int] | None = None):
        self.flags, self.dead_mask, self.missing, self.weights = flags, dead_mask, missing, weights
        alive = [s for s in range(k) if not dead_mask >> s & 1]
        self.assignment = [(j, alive[i % len(alive)]) for i, j in enumerate(missing)] if alive else []

    @staticmethod
    def encode(number: int, round_: int, flags: int, dead_mask: int, missing: set[int], chunks: int,
               weights: list[int] | None = None, k: int | None = None) -> torch.Tensor:
        """``weights``: the stripe shares of the next transfer (with DONE); all zero: keep the current ones."""
        bits = [0] * word_count(chunks)
        for j in missing:
            bits[j // 32] |= 1 << (j % 32)
        shares = list(weights) if weights else [0] * (k or 0)  # (no words at all: read as "keep")
        return torch.tensor([MAGIC, number, round_, flags, dead_mask, len(missing), *bits, *shares],
                            dtype=torch.int64)

    @staticmethod
    def parse(raw: torch.Tensor, round_: int, number: int, chunks: int, k: int, op: OpRecord) -> Status:
        """The status of round ``round_`` of transfer ``number`` (``chunks`` chunks over ``k`` stripes, for ``op``),
        or a ``TransportError`` naming every field that is wrong."""
        v = [int(x) for x in raw.tolist()]
        magic, got, rnd, flags, mask, count = v[:HEADER]
        words = word_count(chunks)
        shares = v[HEADER + words:]
        v = v[:HEADER + words]
        missing = [w * 32 + b for w, word in enumerate(v[HEADER:]) for b in range(32) if word >> b & 1]
        problems = [name for name, bad in (
            ("magic", magic != MAGIC), ("transfer number", got != number), ("round", rnd != round_),
            ("flags", flags not in (DONE, MORE, CORRUPT)), ("dead mask", not 0 <= mask < 1 << k),
            ("missing count", count != len(missing) or (flags == MORE) != (count > 0)),
            ("missing chunk", any(j >= chunks for j in missing) or any(w >> 32 for w in v[HEADER:])),
            ("alive stripes", flags == MORE and mask == (1 << k) - 1),
            ("stripe weights", len(shares) not in (0, k) or any(not 0 <= w <= WEIGHT_SCALE for w in shares)
             or (any(shares) and (not any(shares[s] for s in range(k) if not mask >> s & 1)
                                  or any(shares[s] for s in range(k) if mask >> s & 1))))) if bad]
        if problems:
            raise TransportError(f"{op.describe()}: malformed status from the peer (bad "
                                 f"{', '.join(problems)}); not used")
        return Status(flags, mask, missing, k, shares if any(shares) else None)
