"""Counts the operations each process group carries, at torch.distributed's Python API (every back-end alike).

torch.distributed's collectives and sends dispatch through ``__torch_function__`` (``all_gather_into_tensor`` and
``reduce_scatter_tensor`` through their ``*_single`` forms), so a ``TorchFunctionMode`` sees every one, however the
caller bound the function (Megatron binds ``reduce_scatter_tensor`` at import time). Each record: the group
(Megatron's description, its ranks, its back-end), the operation, and for a send or receive the peer's global rank,
so a check can tell whether an operation moved data between vendors and over which group. The example script's
``--count-ops`` runs one around its training loop; nothing is counted unless it is started.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_single",
               "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_single",
               "all_to_all_single", "all_to_all")


def _functions() -> dict[Any, str]:
    return {getattr(c10d, name): name for name in (*P2P, *COLLECTIVES) if hasattr(c10d, name)}


def _peer(name: str, group: Any, bound: dict[str, Any]) -> int | None:
    """A send's or receive's peer as a global rank (``dst``/``src``, or ``group_dst``/``group_src``)."""
    if name not in P2P:
        return None
    for key in ("dst", "src"):
        if bound.get(key) is not None:
            return int(bound[key])
    for key in ("group_dst", "group_src"):
        if bound.get(key) is not None:
            return dist.get_global_rank(group, int(bound[key]))
    return None


class OpCounter(TorchFunctionMode):
    """Counts (group, op, peer) while started (``start``/``stop``); ``records()`` lists them as plain data."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, tuple[int, ...], str, str, int | None]] = Counter()
        self._names = _functions()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = self._names.get(func)
        if name is not None:
            bound = inspect.signature(func).bind(*args, **kwargs).arguments
            group = bound.get("group") or dist.group.WORLD
            desc = "WORLD" if group is dist.group.WORLD else (getattr(group, "group_desc", "") or "?")
            key = (desc, tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group)), name,
                   _peer(name, group, bound))
            self.counts[key] += 1
        return func(*args, **kwargs)

    def start(self) -> None:
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def records(self) -> list[dict[str, Any]]:
        return [{"group": desc, "ranks": list(ranks), "backend": backend, "op": op, "peer": peer, "count": n}
                for (desc, ranks, backend, op, peer), n in sorted(self.counts.items(), key=str)]
