"""The pipeline boundary between stages of different shapes: which rank sends which rows and columns to which.

A global microbatch of ``rows`` samples is split over a stage's ``dp`` replicas in equal runs of rows (replica
``r`` holds rows ``[r * rows / dp, (r + 1) * rows / dp)``), and a boundary activation ``[rows, seq, hidden]`` is
split over a replica's ``tp`` ranks along ``hidden`` (tp rank ``t`` sends only its share, as ``TPBoundary`` does
for equal shapes). A *piece* is the block two ranks of neighbouring stages have in common: the rows both replicas
hold, the columns both tp ranks hold. Each sender sends its pieces, each receiver assembles its rows and columns
from them (and sends the same blocks of the gradient back), so every element crosses the boundary exactly once:
the bytes per step are those of equal shapes with the same global batch.

Pure data; the pairs that exchange pieces get their own two-rank group (``groups.plan_groups``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bimetal.parallel.layout import Layout


@dataclass(frozen=True)
class Piece:
    """One block of a boundary activation: ``sender`` (stage s) -> ``receiver`` (stage s + 1)."""

    sender: int
    receiver: int
    rows: tuple[int, int]
    """Rows of the global microbatch, ``[start, stop)``."""
    cols: tuple[int, int]
    """Columns of the hidden dimension, ``[start, stop)``."""


def _runs(total: int, parts: int) -> list[tuple[int, int]]:
    step = total // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def boundary_pieces(layout: Layout, stage: int, rows: int, hidden: int) -> list[Piece]:
    """Every piece between ``stage`` and ``stage + 1`` for a microbatch of ``rows`` samples and width ``hidden``,
    in one order every rank agrees on (sender replica, sender tp rank, receiver replica, receiver tp rank)."""
    d = layout.dims
    out = []
    a_rows, b_rows = _runs(rows, d.stage_dp(stage)), _runs(rows, d.stage_dp(stage + 1))
    a_cols, b_cols = _runs(hidden, d.stage_tp(stage)), _runs(hidden, d.stage_tp(stage + 1))
    for r, ar in enumerate(a_rows):
        for t, ac in enumerate(a_cols):
            for q, br in enumerate(b_rows):
                rr = _overlap(ar, br)
                if rr is None:
                    continue
                for u, bc in enumerate(b_cols):
                    cc = _overlap(ac, bc)
                    if cc is not None:
                        out.append(Piece(layout.mesh[stage][r][t], layout.mesh[stage + 1][q][u], rr, cc))
    return out


def boundary_pairs(layout: Layout, stage: int) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs of global ranks that exchange pieces between ``stage`` and ``stage + 1``."""
    d = layout.dims
    rows = math.lcm(d.stage_dp(stage), d.stage_dp(stage + 1))
    hidden = math.lcm(d.stage_tp(stage), d.stage_tp(stage + 1))
    return list(dict.fromkeys((p.sender, p.receiver) for p in boundary_pieces(layout, stage, rows, hidden)))


def pair_name(layout: Layout, sender: int, receiver: int) -> str:
    """Group description of a boundary pair, e.g. ``pp.b0.dp1tp0-dp0tp0`` (stage 0's replica 1, tp rank 0, to
    stage 1's replica 0, tp rank 0)."""
    s, r, t = layout.coords(sender)
    _, q, u = layout.coords(receiver)
    return f"pp.b{s}.dp{r}tp{t}-dp{q}tp{u}"
