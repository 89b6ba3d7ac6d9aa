"""The cost model fed the lab's own figures against the lab's measured ladder (recorded on this machine).

tests/data/ladder_lab.json: `bimetal bench ladder --out DIR` (defaults: 10 Mbit/s, 2 repeats, 10 steps),
tests/data/profile_debug_s128_b2.json: `bimetal profile --model debug --seq 128 --micro-batch 2`, and
tests/data/bench_comm_loopback.json: `bimetal bench comm --sizes 4K,64M --stripes 1,4`; all three measured
in one session on the shared 2-core CPU machine (see the "recorded" field of each file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bimetal.cli import main

DATA = Path(__file__).parent / "data"


def test_model_predicts_the_measured_lab_ladder_within_20_percent(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "ladder-check", "--ladder", str(DATA / "ladder_lab.json"), "--profile",
               str(DATA / "profile_debug_s128_b2.json"), "--bench-comm", str(DATA / "bench_comm_loopback.json")])
    out = capsys.readouterr().out
    rows = re.findall(r"^\((\w)\)\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", out, flags=re.M)
    assert [r[0] for r in rows] == list("abcde"), out
    table = json.loads((DATA / "ladder_lab.json").read_text())["table"]
    for key, tps, got_tps, _err_tps, ratio, got_ratio, _err_ratio in rows:
        assert float(got_ratio) == pytest.approx(table[key]["ratio_median"], abs=0.006)
        assert float(got_tps) == pytest.approx(table[key]["tokens_per_s_median"], abs=1)
        assert abs(float(ratio) - table[key]["ratio_median"]) / table[key]["ratio_median"] <= 0.2, out
        assert abs(float(tps) - table[key]["tokens_per_s_median"]) / table[key]["tokens_per_s_median"] <= 0.2, out
    assert rc == 0, out
