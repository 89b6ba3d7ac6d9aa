"""Per-step transport counters for the trainer's metrics: bytes staged through host memory, staging-pool
buffers allocated, bytes per stripe and failovers of the bimetal groups this job uses.

Every rank builds one ``TransportMeter`` (the layout is agreed with one all-reduce at start) and calls
``step()`` once per training step: the counters' growth since the last call, summed over all ranks with one
small all-reduce, so rank 0 can log the job's figures. A run that is not allocating shows
``pool_buffers_allocated`` 0 after warm-up; a run that is not falling back shows ``failovers`` 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

KEYS = ("bytes_staged", "pool_buffers_allocated", "failovers", "stripes_dead")
"""Summed per step (``stripes_dead``: how many stripes are down at the end of the step, all ranks)."""


class TransportMeter:
    """The growth of the ``comm_stats()`` counters of ``groups`` (those that have them) per step, all ranks."""

    def __init__(self, groups: list[Any]) -> None:
        seen: dict[int, Any] = {}
        for g in groups:
            if g is not None and hasattr(g, "comm_stats"):
                seen.setdefault(id(g), g)
        self.groups = list(seen.values())
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.stripes = 0
        if self.active:
            local = max((_stripes(g.comm_stats()) for g in self.groups), default=0)
            agreed = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            self.stripes = int(agreed.item())
            self.active = self.stripes > 0  # no rank has a bimetal group with stripes: nothing to log
        self._last = self._read()

    def _read(self) -> list[int]:
        out = [0] * (len(KEYS) + self.stripes)
        for g in self.groups:
            stats = g.comm_stats()
            for i, key in enumerate(KEYS):
                out[i] += int(stats.get(key, 0))
            for s in range(min(self.stripes, _stripes(stats))):
                out[len(KEYS) + s] += int(stats[f"bytes_stripe{s}"])
        return out

    def step(self) -> dict[str, Any] | None:
        """This step's figures for the whole job (call on every rank, once per step); None when inactive."""
        if not self.active:
            return None
        now = self._read()
        delta = [n - o for n, o in zip(now, self._last)]
        delta[KEYS.index("stripes_dead")] = now[KEYS.index("stripes_dead")]
        self._last = now
        total = torch.tensor(delta, dtype=torch.int64)
        dist.all_reduce(total)
        values = [int(v) for v in total.tolist()]
        rec: dict[str, Any] = dict(zip(KEYS, values))
        rec["bytes_per_stripe"] = values[len(KEYS):]
        return rec


def _stripes(stats: dict[str, int]) -> int:
    return sum(1 for k in stats if k.startswith("bytes_stripe"))
