"""`bimetal plan fit` on a bench comm report recorded on this machine (tests/data/bench_comm_loopback.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bimetal.errors import UserError
from bimetal.plan.fit import main
from bimetal.plan.spec import load_spec

DATA = Path(__file__).parent / "data" / "bench_comm_loopback.json"
SPEC = "configs/clusters/h200_mi325x.toml"


def test_fit_sets_the_host_path_constants_from_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {(r["variant"], r["bytes"]): r["median_s"] for r in json.loads(DATA.read_text())["rows"]}
    big = 64 * 2**20
    conn, iface = big / rows[("gloo", big)] / 1e9, big / rows[("cpu-forward x4", big)] / 1e9
    latency = rows[("gloo", 4096)] / 2 * 1e6
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"copy_gbps": 7.5, "achieved_flops": 1e9}))
    out = tmp_path / "fitted.toml"
    assert main([SPEC, "--bench-comm", str(DATA), "--profile", str(prof), "--group", "mi325x",
                 "--out", str(out)]) == 0
    h200, mi = load_spec(out).groups
    assert mi.tcp_conn_gbps == pytest.approx(conn, abs=1e-3)
    assert mi.tcp_iface_gbps == pytest.approx(iface, abs=1e-3)
    assert mi.msg_latency_us == pytest.approx(latency, abs=0.1)
    assert mi.host_copy_gbps == 7.5
    assert (h200.tcp_conn_gbps, h200.host_copy_gbps) == (2.0, 8 * 52.0)  # not chosen: defaults stay
    assert "tcp_conn_gbps" in capsys.readouterr().out


def test_fit_refuses_bad_inputs(tmp_path: Path) -> None:
    out = str(tmp_path / "o.toml")
    with pytest.raises(UserError, match="'gpu0' is not a group of"):
        main([SPEC, "--bench-comm", str(DATA), "--group", "gpu0", "--out", out])
    bad = tmp_path / "b.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="is not a `bimetal bench comm` JSON"):
        main([SPEC, "--bench-comm", str(bad), "--out", out])
    assert not Path(out).exists()
