"""Which back-end carries each group megatron-core creates: bimetal's classification applied by group.

``parallel_state.initialize_model_parallel`` creates every group through ``create_group(ranks, backend=...,
group_desc=...)``. Each is classified by its ranks' vendors (``bimetal.integrations.common.group_backend``):

* a back-end Megatron leaves open (``None``) or asks as ``nccl`` -> native inside one vendor, the chosen transport
  (cpu-forward or device-direct) across vendors: pipeline, embedding, model-parallel / distributed-optimizer
  instance, data-parallel groups alike, whatever Megatron calls them;
* ``gloo`` (Megatron's CPU-side groups: ``DATA_PARALLEL_GROUP_GLOO`` ...) stays Gloo: it carries CPU tensors, which
  Gloo moves between any two hosts;
* any other back-end asked for (``ucc``) is kept inside one vendor and refused across vendors, in one sentence;
* device-direct has no coalesced reduce-scatter or all-reduce, which Megatron's DDP and distributed optimizer use on
  the data-parallel groups: a data-parallel group that spans vendors is refused on it (cpu-forward carries it).

Pure Python: it records what it chose as ``GroupSpec`` rows for ``bimetal topo``'s group table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bimetal.errors import UserError
from bimetal.integrations.common import group_backend
from bimetal.parallel.groups import GroupSpec, classify, format_group_table
from bimetal.transports import BIMETAL, DEVICE_DIRECT, TRANSPORTS

DATA_PARALLEL = ("DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP", "INTRA_PARTIAL_DATA_PARALLEL_GROUP",
                 "INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP")
"""Megatron's descriptions of the groups its DDP reduces gradients over (``*_GLOO`` ones are Gloo's: not chosen)."""
CHOSEN = (None, "nccl")
"""Back-ends Megatron asks for that bimetal decides instead (nccl cannot span vendors; None is the world's)."""


@dataclass
class MegatronGroups:
    """Chooses each Megatron group's back-end and remembers the groups made, for the table."""

    vendors: list[str]
    """Vendor of every global rank."""
    transport: str = "cpu-forward"
    """Transport of every group that spans vendors: ``cpu-forward`` or ``device-direct``."""
    simulated: bool = True
    all_gloo: bool = False
    """Reference run: every group on plain Gloo, no vendor rules (simulation only)."""
    made: list[GroupSpec] = field(default_factory=list)
    _seen: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.transport not in BIMETAL:
            raise UserError(f"transport {self.transport!r} is unknown; use {' or '.join(BIMETAL)}")

    def choose(self, ranks: list[int] | tuple[int, ...], asked: str | None, desc: str | None) -> str | None:
        """The back-end for the group of ``ranks`` Megatron asked ``asked`` for; records it under ``desc``."""
        ranks = tuple(int(r) for r in ranks)
        vendors = tuple(self.vendors[r] for r in ranks)
        label = desc or "GROUP"
        name = f"{label}.{self._seen[label]}"
        self._seen[label] += 1
        if asked in CHOSEN:
            backend = group_backend(vendors, TRANSPORTS[self.transport].backend, self.simulated, self.all_gloo)
            if backend == DEVICE_DIRECT and label.startswith(DATA_PARALLEL):
                raise UserError(f"{label} spans vendors ({', '.join(dict.fromkeys(vendors))}), and device-direct "
                                "cannot carry the coalesced reduce-scatter Megatron's DDP runs on it; use "
                                "transport cpu-forward, or keep data parallelism inside each vendor")
        elif asked == "gloo" or classify(vendors) != "cross-vendor":
            backend = asked
        else:
            mix = ", ".join(f"{r}:{v}" for r, v in zip(ranks, vendors))
            raise UserError(f"Megatron asked for back-end {asked!r} for {label} over ranks of two vendors ({mix}), "
                            f"which it cannot span; leave that back-end unset and bimetal gives the group "
                            f"{self.transport}")
        if len(ranks) > 1:
            self.made.append(GroupSpec(name, label, ranks, vendors, classify(vendors), str(backend)))
        return backend

    def begin(self) -> None:
        """A new ``initialize_model_parallel``: its groups are numbered and tabled afresh."""
        self.made.clear()
        self._seen.clear()

    def table(self) -> str:
        return format_group_table(self.made)
