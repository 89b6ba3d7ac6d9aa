"""Counts the operations each process group carries, at torch.distributed's Python API (every back-end alike).

Megatron calls ``torch.distributed.isend``, ``all_reduce`` and the rest by their module names; while an
``OpCounter`` runs, those names (in ``torch.distributed`` and ``distributed_c10d``, which ``P2POp`` checks against)
point at counting wrappers that call the real function. Each record: the group (Megatron's description, its
ranks, its back-end), the operation, and for a send or receive the peer's global rank, so a check can tell
whether an operation moved data between vendors and over which group. The example script's ``--count-ops`` runs
one around its training loop; nothing is counted unless it is started.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "broadcast", "reduce", "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "all_to_all", "all_to_all_single", "gather", "scatter")


def _group_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    position = 2 if name in P2P else None  # (tensor, peer, group, ...): Megatron passes the group by keyword too
    if position is not None and len(args) > position:
        return args[position]
    return None


def _peer_of(group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The peer's global rank: ``dst``/``src`` (global), or ``group_dst``/``group_src`` (``batch_isend_irecv`` passes
    those), or the second positional argument."""
    for key in ("dst", "src"):
        if kwargs.get(key) is not None:
            return int(kwargs[key])
    for key in ("group_dst", "group_src"):
        if kwargs.get(key) is not None:
            return dist.get_global_rank(group, int(kwargs[key]))
    return int(args[1]) if len(args) > 1 and args[1] is not None else None


class OpCounter:
    """Counts (group, op, peer) while started; ``records()`` lists them as plain data."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, tuple[int, ...], str, str, int | None]] = Counter()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, func: Any) -> Any:
        @functools.wraps(func)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = _group_of(name, args, kwargs) or dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(group))
            desc = "WORLD" if group is dist.group.WORLD else (getattr(group, "group_desc", "") or "?")
            peer = _peer_of(group, args, kwargs) if name in P2P else None
            self.counts[(desc, ranks, str(dist.get_backend(group)), name, peer)] += 1
            return func(*args, **kwargs)

        return counted

    def start(self) -> None:
        for name in (*P2P, *COLLECTIVES):
            func = getattr(c10d, name, None)
            if func is None:
                continue
            self._saved[name] = func
            wrapped = self._wrap(name, func)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def stop(self) -> None:
        for name, func in self._saved.items():
            setattr(c10d, name, func)
            setattr(dist, name, func)
        self._saved.clear()

    def records(self) -> list[dict[str, Any]]:
        return [{"group": desc, "ranks": list(ranks), "backend": backend, "op": op, "peer": peer, "count": n}
                for (desc, ranks, backend, op, peer), n in sorted(self.counts.items(), key=str)]
