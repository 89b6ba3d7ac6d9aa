"""Stripe failover of cpu-forward point-to-point (issue 8, item 3).

* loopback (no lab): one stripe stalls on the receiver, on the sender, or under traffic both ways at once
  (``cpu_forward.faults.inject_fault``), the
  message arrives bit-identical, the stripe is left with one warning per rank, the next transfer works;
  with every stripe stalled the receive fails with the op timeout's error, within timeout + 30 s;
* lab (root): a NIC cut with ``faults.nic_down`` during a striped 256 MiB transfer between two nodes.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from launcher import launch

from bimetal.comm.base import OpRecord
from bimetal.comm.cpu_forward.failover import MORE, Status
from bimetal.comm.striping import CpuForwardOptions
from bimetal.errors import UserError

HERE = Path(__file__).resolve().parent


def test_status_message_round_trips_and_rejects_what_does_not_fit() -> None:
    op = OpRecord("g", "send", 3, 1)
    expected = (7, 70, 3, op)  # transfer 7, 70 chunks over 3 stripes
    raw = Status.encode(7, 1, MORE, 0b010, {0, 33, 69}, 70)
    st = Status.parse(raw, 1, *expected)
    assert st.missing == [0, 33, 69] and st.assignment == [(0, 0), (33, 2), (69, 0)]
    for index, value in ((0, 1), (1, 8), (2, 0), (3, 9), (4, 0b1000), (5, 2)):
        bad = raw.clone()
        bad[index] = value
        with pytest.raises(Exception, match="malformed status"):
            Status.parse(bad, 1, *expected)
    every_stripe_dead = Status.encode(7, 1, MORE, 0b111, {1}, 70)
    with pytest.raises(Exception, match="alive stripes"):
        Status.parse(every_stripe_dead, 1, *expected)


def test_stall_option_from_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    assert CpuForwardOptions().resolved().stall_seconds(timedelta(seconds=60)) == 10.0
    assert CpuForwardOptions().resolved().stall_seconds(timedelta(seconds=6)) == 2.0
    monkeypatch.setenv("BIMETAL_CF_STALL_S", "3.5")
    assert CpuForwardOptions().resolved().stall_seconds(timedelta(seconds=60)) == 3.5
    monkeypatch.setenv("BIMETAL_CF_STALL_S", "soon")
    with pytest.raises(UserError, match="BIMETAL_CF_STALL_S"):
        CpuForwardOptions().resolved()


@pytest.mark.timeout(120)
def test_loopback_stalled_stripe_fails_over_and_all_stalled_times_out(tmp_path: Path) -> None:
    proc = launch("nvidia:1,amd:1", str(HERE / "cf_failover_rank.py"), str(tmp_path), timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, stripe in (("recv_stall", 1), ("send_stall", 0), ("both_ways", 1)):
            r = res[name]
            assert r["first"]["ok"] and r["second"]["ok"], (rank, name, r)
            assert r["dead"] == [stripe], (rank, name, r)
            assert len(r["warnings"]) == 1 and f"stripe {stripe} (interface lo)" in r["warnings"][0], r
            assert f"group 'pp.{name}'" in r["warnings"][0]
            # (the op timeout is 60 s and the test's 120: the first op finishing ok is the failover at work)
        r = res["all_stall"]["first"]
        op = "recv #1 with peer 1" if rank == 0 else "send #1 with peer 0"
        assert r["type"] == "TransportTimeout" and f"group 'pp.all_stall' {op} did not complete within 4 s" in \
            r["error"], r
        assert res["all_stall"]["dead"] == [], res["all_stall"]  # stripes that stall together are the peer's fault


def _leftovers(lab_id: str) -> list[str]:
    from bimetal.lab import cgroup
    from bimetal.lab.cluster import STATE_DIR

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    left = [n for n in out if n.startswith(f"bml-{lab_id}-")] + [str(p) for p in cgroup.lab_cgroups(lab_id)]
    return left + ([str(STATE_DIR)] if (STATE_DIR / f"{lab_id}.json").exists() else [])


def _run_cutting(lab: Any, out: Path, argv: list[str], cuts: list[tuple[str, int]]) -> dict[int, Any]:
    """Run the lab rank program; ``cuts`` (node, NIC) go down 1 s after rank 0 wrote ``go``."""
    from bimetal.lab import faults

    results: list[Any] = []
    job = threading.Thread(target=lambda: results.extend(lab.run(
        [str(HERE / "cf_failover_lab_rank.py"), str(out), *argv], timeout=100, capture=True)))
    job.start()
    deadline = time.monotonic() + 90
    while not (out / "go").exists() and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    cut = (out / "go").exists()
    if cut:
        time.sleep(1.0)
        for node, nic in cuts:
            faults.nic_down(lab, node, nic)
    job.join(timeout=110)
    text = "".join(r.output for r in results)
    assert cut and [r.returncode for r in results] == [0, 0], text[-4000:]
    return {int(line.split()[0][6:]): json.loads(line.split(" ", 1)[1])
            for line in text.splitlines() if line.startswith("RESULT")}


@pytest.mark.lab
@pytest.mark.timeout(120)
def test_lab_nic_down_mid_transfer_completes_bit_identical(make_lab: Any, tmp_path: Path) -> None:
    rate = 300  # Mbit/s per NIC: 256 MiB takes ~3.6 s on two, so the cut lands mid-transfer
    lab = make_lab(nodes=[{"name": "a", "vendor": "nvidia", "ranks": 1}, {"name": "b", "vendor": "amd", "ranks": 1}],
                   nics=2, rate_mbit=rate)
    rows = _run_cutting(lab, tmp_path, ["256"], [("b", 1)])
    for rank in (0, 1):
        r = rows[rank]
        assert r["dead"] == [1], r
        assert all(row["ok"] for row in r["rows"]), r
        warned = [len(row["warnings"]) for row in r["rows"]]
        assert warned == [0, 1, 0], r  # once, during the transfer the cut hit
        assert "stripe 1 (interface eth1)" in r["rows"][1]["warnings"][0] and "'pp.a-b'" in r["rows"][1]["warnings"][0]
    recv = rows[1]["rows"]
    print(f"\ncpu-forward 256 MiB a->b over 2 x {rate} Mbit/s: {recv[0]['seconds']:.2f} s with both NICs, "
          f"{recv[1]['seconds']:.2f} s with eth1 cut 1 s in; then {recv[2]['mib']:.0f} MiB on eth0 alone in "
          f"{recv[2]['seconds']:.2f} s")
    lab_id = lab.spec.lab_id
    lab.down()
    assert _leftovers(lab_id) == []


@pytest.mark.lab
@pytest.mark.timeout(120)
def test_lab_every_stripe_cut_fails_with_the_timeout_sentence(make_lab: Any, tmp_path: Path) -> None:
    """Stripes on eth1+eth2 (eth0 keeps the store and the default group), both cut mid-transfer."""
    lab = make_lab(nodes=[{"name": "a", "vendor": "nvidia", "ranks": 1}, {"name": "b", "vendor": "amd", "ranks": 1}],
                   nics=3, rate_mbit=100)
    rows = _run_cutting(lab, tmp_path, ["64", "alldown"], [("b", 1), ("b", 2)])
    for rank, op in ((0, "send #1 with peer 1"), (1, "recv #1 with peer 0")):
        r = rows[rank]
        assert r["type"] == "TransportTimeout" and f"group 'pp.a-b' {op} did not complete within 6 s" in r["error"], r
    print(f"\nevery stripe cut: send failed after {rows[0]['elapsed']:.1f} s, recv after {rows[1]['elapsed']:.1f} s "
          "(timeout 6 s)")
