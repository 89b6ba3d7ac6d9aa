"""Predicted step time of a contiguous layer split over a chain of pipeline ranks of different speeds.

Each stage's cost comes only from measured inputs: the local CPU's per-part profile (``bimetal profile``:
block, embedding, head with its loss, AdamW update; forward and backward apart), divided by the rank's
CPU share; boundary transfers are cpu-forward (staging memcpy at the profiled bandwidth on both sides,
the link rate and latency between nodes, loopback inside a node); the 1F1B replay
(``bimetal.plan.schedule``) gives the pipeline time, and the slowest stage's optimizer update follows
(every rank waits for it at the next step's first exchange). Pure Python; ``bimetal plan calibrate``
(``bimetal.bench.calibrate``) measures these predictions on the lab.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from bimetal.errors import UserError
from bimetal.plan.hostpath import CHUNK_BYTES
from bimetal.plan.schedule import StageTimes, one_f_one_b


@dataclass(frozen=True)
class Rank:
    """One lab rank as a pipeline stage: where it sits and how fast its CPU share lets it run."""

    node: str
    vendor: str
    share: float
    nics: int
    rate_mbit: float
    latency_ms: float


@dataclass
class Prediction:
    """Predicted step of one layer split, with the terms it is made of."""

    split: list[int]
    step_s: float
    pipeline_s: float
    optim_s: float
    stage_fwd_s: list[float] = field(default_factory=list)
    stage_bwd_s: list[float] = field(default_factory=list)
    boundary_s: list[float] = field(default_factory=list)
    """One transfer (activation or its gradient) across boundary j -> j+1."""


def transfer_s(profile: dict[str, Any], a: Rank, b: Rank, nbytes: float) -> float:
    """One cpu-forward message a -> b: staging copy on each side (at its CPU share) plus the link."""
    copy = nbytes / (float(profile["copy_gbps"]) * 1e9)
    stage = copy / a.share + copy / b.share
    if a.node == b.node:  # loopback inside a node namespace: only the copies
        return stage
    nics = max(1, min(a.nics, b.nics, math.ceil(nbytes / CHUNK_BYTES)))
    rate = min(a.rate_mbit, b.rate_mbit) * 1e6 / 8 * nics
    return stage + nbytes / rate + max(a.latency_ms, b.latency_ms) / 1e3


def predict(profile: dict[str, Any], ranks: list[Rank], split: list[int], microbatches: int) -> Prediction:
    """Step time of ``split`` (layers per stage) on ``ranks`` at the profile's microbatch shape."""
    if len(split) != len(ranks):
        raise UserError(f"split {split} has {len(split)} stages but the lab has {len(ranks)} ranks (dp = 1).")
    parts = profile["parts"]
    last = len(split) - 1

    def total(j: int, key: str) -> float:
        t = split[j] * parts["layer"][key] + (parts["embed"][key] if j == 0 else 0.0)
        return (t + (parts["head"][key] if j == last else 0.0)) / ranks[j].share

    nbytes = float(profile["boundary_bytes"])
    stages = [StageTimes(total(j, "fwd_s"), total(j, "bwd_s"),
                         transfer_s(profile, ranks[j], ranks[j + 1], nbytes) if j < last else 0.0)
              for j in range(len(split))]
    pipeline, _ = one_f_one_b(stages, microbatches)
    optim = max(total(j, "optim_s") for j in range(len(split)))
    return Prediction(list(split), pipeline + optim, pipeline, optim, [s.fwd for s in stages],
                      [s.bwd for s in stages], [s.send_next for s in stages[:-1]])


def splits(layers: int, stages: int) -> list[list[int]]:
    """Every contiguous split of ``layers`` into ``stages`` parts of at least one layer."""
    return [[b - a for a, b in zip((0, *cuts), (*cuts, layers))]
            for cuts in itertools.combinations(range(1, layers), stages - 1)]


def even_split(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if j < layers % stages else 0) for j in range(stages)]


def best_split(profile: dict[str, Any], ranks: list[Rank], layers: int, microbatches: int) -> Prediction:
    """The planner's split: least predicted step time over all contiguous splits."""
    return min((predict(profile, ranks, s, microbatches) for s in splits(layers, len(ranks))),
               key=lambda p: p.step_s)
