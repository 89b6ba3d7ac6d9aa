"""A pipeline group whose hops each run on the back-end of their kind: native inside a vendor, a transport across.

A pipeline group (the ranks of one replica's stages, in stage order) talks only between neighbouring stages: a
*pair* of ranks carries the activations one way and their gradients back. Each pair is classified like any
group (``groups.classify``): one vendor -> the vendor's native library, two -> the cross-vendor transport. When
every pair of a pipeline gets the same back-end the pipeline is one plain group, as before; otherwise it is a
``bimetal_per_hop`` group (``bimetal.comm.per_hop.PerHopGroup``) that torch's pipelining and torchtitan's
schedules use as their one pp group, and that sends each transfer over its pair's group.

Made here, collectively (every rank of the world calls ``create_pipeline_group`` in the same order):

* one group per pair on a bimetal transport; two per native pair, one per direction (why: ``per_hop``);
* one group over all the pipeline's ranks for its collectives (loss broadcast, grad-norm all-reduce,
  barriers), on the cross-vendor transport - cpu-forward when the pairs use device-direct: a few bytes per step
  do not need an RDMA engine of their own;
* the ``bimetal_per_hop`` group itself, with this rank's routes as its ``pg_options``.

The input is plain data - the ranks and a list of ``PairSpec`` (rank a, rank b, back-end) - so a boundary between
stages of different shapes (several senders per receiver) is built the same way from its own pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal.comm.per_hop import PerHopOptions, Route
from bimetal.transports import DEVICE_DIRECT, PER_HOP, SIM_NATIVE

REVERSE = "/reverse"
"""Suffix of the second group of a native pair (traffic from the later stage to the earlier one)."""
DIRECTED = ("nccl", SIM_NATIVE)
"""Native back-ends whose pairs get one group per direction (one stream per communicator)."""


@dataclass(frozen=True)
class PairSpec:
    """One hop of a pipeline: two ranks (earlier stage first) and the back-end between them."""

    name: str
    """Group description, e.g. ``pp.dp0.hop1-2`` (stages 1 and 2)."""
    ranks: tuple[int, int]
    backend: str
    cross_vendor: bool

    @property
    def directed(self) -> bool:
        return self.backend in DIRECTED


def stage_pairs(owners: Sequence[int]) -> list[tuple[int, int]]:
    """Positions (in the pipeline group) of the ranks that exchange activations: the owners of each two
    consecutive (virtual) stages, earlier stage first, each pair of ranks once, in order of first use.

    ``owners[k]`` is the position holding stage ``k``: ``range(pp)`` for one stage per rank; a looped schedule
    (``0, 1, 2, 3, 0, 1, 2, 3``) adds the wrap-around from the last position back to the first; a V schedule
    (``0, 1, 2, 3, 3, 2, 1, 0``) adds none (its turn is on one rank)."""
    pairs: list[tuple[int, int]] = []
    seen: set[frozenset[int]] = set()
    for a, b in zip(owners, owners[1:]):
        if a != b and frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            pairs.append((a, b))
    return pairs


def collectives_backend(cross_backend: str) -> str:
    """Back-end of the pipeline's collectives group: the cross-vendor transport, cpu-forward for device-direct."""
    from bimetal.transports import CPU_FORWARD

    return CPU_FORWARD if cross_backend == DEVICE_DIRECT else cross_backend


def create_pipeline_group(name: str, ranks: Sequence[int], pairs: Sequence[PairSpec], collectives: str,
                          collectives_name: str, timeout: timedelta, pg_options: dict[str, Any] | None = None
                          ) -> dict[str, dist.ProcessGroup | None]:
    """Create the pipeline's groups (collective: every rank of the world, same order); name -> group (None where
    this rank is not a member). Keys: each pair's name (its forward group for a native pair, ``name/reverse`` for
    the other direction), ``collectives_name`` and ``name`` (the ``bimetal_per_hop`` group). ``pg_options``:
    back-end -> the options its groups get (bimetal's transports: the interfaces named)."""
    me = dist.get_rank()
    out: dict[str, dist.ProcessGroup | None] = {}

    def new(desc: str, members: Sequence[int], backend: str, key: str) -> dist.ProcessGroup | None:
        pg = dist.new_group(list(members), backend=backend, timeout=timeout, group_desc=desc,
                            pg_options=(pg_options or {}).get(backend))
        out[key] = pg if me in members else None
        return out[key]

    routes: dict[int, Route] = {}
    for p in pairs:
        a, b = p.ranks
        fwd = new(p.name, (a, b), p.backend, p.name)
        back = new(p.name + REVERSE, (a, b), p.backend, p.name + REVERSE) if p.directed else fwd
        if me not in (a, b) or fwd is None or back is None:
            continue
        peer = b if me == a else a
        send, recv = (fwd, back) if me == a else (back, fwd)
        routes[peer] = Route(peer, send, recv, dist.get_group_rank(send, peer), dist.get_group_rank(recv, peer),
                             p.name, p.backend, p.cross_vendor)
    coll = new(collectives_name, ranks, collectives, collectives_name)
    options = PerHopOptions(routes, coll, collectives_name, [p.name for p in pairs]) if coll is not None else None
    pg = dist.new_group(list(ranks), backend=PER_HOP, timeout=timeout, group_desc=name, pg_options=options)
    out[name] = pg if me in ranks else None
    return out
