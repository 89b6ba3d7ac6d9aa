"""The planner's lab calibration: the 1F1B replay against hand-computed makespans, and the prediction path
(profile parts / CPU share, boundary transfer over the lab link) choosing an uneven split for a slow rank.

The measurement itself (``bimetal plan calibrate --lab configs/lab/calib.toml``) trains on the lab for about
a minute; it is a benchmark, not a test.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bimetal.bench.calibrate import lab_ranks
from bimetal.lab.spec import load_spec
from bimetal.plan.schedule import StageTimes, one_f_one_b, one_f_one_b_on
from bimetal.plan.stagesplit import Rank, best_split, even_split, predict, splits

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("p,m,fwd,bwd,want", [
    (2, 4, 1.0, 1.0, (4 + 2 - 1) * 2.0),   # equal stages, no transfers: (m + p - 1) x (F + B)
    (4, 8, 1.0, 2.0, (8 + 4 - 1) * 3.0),
    (1, 5, 1.0, 2.0, 5 * 3.0),             # one stage: m x (F + B)
])
def test_one_f_one_b_matches_hand_values(p: int, m: int, fwd: float, bwd: float, want: float) -> None:
    makespan, ends = one_f_one_b([StageTimes(fwd, bwd)] * p, m)
    assert makespan == pytest.approx(want) and len(ends) == p


def test_transfer_time_lengthens_the_schedule() -> None:
    base, _ = one_f_one_b([StageTimes(1.0, 1.0)] * 2, 4)
    slow, _ = one_f_one_b([StageTimes(1.0, 1.0, send_next=0.5), StageTimes(1.0, 1.0)], 4)
    assert slow > base


def test_shared_device_replay_is_the_dedicated_one_with_a_queue() -> None:
    """Stages on one device: the same programs as ``one_f_one_b`` (equal makespans with a device each), and with
    free transfers the device never idles (the makespan is all the compute); a transfer can only add to that."""
    rng = random.Random(0)
    for _ in range(100):
        p, m = rng.randint(1, 4), rng.randint(1, 8)
        st = [StageTimes(rng.uniform(0.1, 2), rng.uniform(0.1, 3), rng.choice([0.0, rng.uniform(0, 3)]))
              for _ in range(p)]
        assert one_f_one_b_on(st, m, shared_device=False) == pytest.approx(one_f_one_b(st, m)[0])
        free = [StageTimes(s.fwd, s.bwd) for s in st]
        assert one_f_one_b_on(free, m) == pytest.approx(m * sum(s.fwd + s.bwd for s in st))
        assert one_f_one_b_on(st, m) >= one_f_one_b_on(free, m) - 1e-9
    # by hand: 2 stages, F = B = 1, 4 microbatches: 16 s of compute; a 0.5 s link leaves the device idle while
    # stage 0's first backward waits for its gradient (4.0 -> 4.5), and more in the drain
    assert one_f_one_b_on([StageTimes(1.0, 1.0, 0.5), StageTimes(1.0, 1.0)], 4) > 16.0


def _profile() -> dict:
    part = {"fwd_s": 0.01, "bwd_s": 0.02, "optim_s": 0.001}
    small = {"fwd_s": 0.001, "bwd_s": 0.002, "optim_s": 0.0005}
    return {"parts": {"layer": part, "embed": small, "head": small}, "boundary_bytes": 1 << 16, "copy_gbps": 5.0}


def test_half_speed_rank_gets_fewer_layers() -> None:
    ranks = [Rank("nv", "nvidia", 1.0, 1, 200.0, 0.0), Rank("amd", "amd", 0.5, 1, 200.0, 0.0)]
    even = predict(_profile(), ranks, even_split(4, 2), 4)
    best = best_split(_profile(), ranks, 4, 4)
    assert best.split == [3, 1] and best.step_s < even.step_s
    assert [2, 2] in splits(4, 2) and len(splits(4, 2)) == 3
    assert best.boundary_s[0] > (1 << 16) / (200e6 / 8)  # at least the wire time of one activation


def test_lab_spec_becomes_planner_ranks() -> None:
    ranks = lab_ranks(load_spec(str(ROOT / "configs" / "lab" / "calib.toml")))
    assert len(ranks) == 2 and sorted(r.share for r in ranks) == [0.5, 1.0]
