"""`bimetal plan` views through the command line: one layout, a train config, the ladder, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bimetal.errors import UserError
from bimetal.plan.cli import main

H200 = "configs/clusters/h200_mi325x.toml"


def _ladder(out: str) -> dict[int, tuple[float, float]]:
    rows = re.findall(r"^(\d)\. .+? {2,}(\d+)\s+([\d.]+)\s", out, flags=re.M)
    return {int(k): (float(tf), float(r)) for k, tf, r in rows}


def test_ladder_orders_the_rungs_and_prints_one_node_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([H200, "--ladder"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"one h200 node alone:\s+\d+ TFLOP/s per GPU", out)
    assert re.search(r"one mi325x node alone:\s+\d+ TFLOP/s per GPU", out)
    rungs = _ladder(out)
    assert sorted(rungs) == [1, 2, 3, 4, 5], out
    tf = [rungs[k][0] for k in range(1, 6)]
    assert tf[0] < tf[1] <= tf[2] < tf[3] <= tf[4], out
    assert all(0 < rungs[k][1] < 1 for k in rungs), out  # below the faster one-node baseline


def test_a_slow_tcp_stack_separates_one_shared_nic_from_one_per_gpu(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "c.toml"
    spec.write_text(Path(H200).read_text().replace("gpudirect = true", "gpudirect = true\ntcp_iface_gbps = 4"))
    assert main([str(spec), "--ladder"]) == 0
    rungs = _ladder(capsys.readouterr().out)
    assert rungs[2][0] < rungs[3][0]


def test_one_layout_and_a_train_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([H200, "--pp", "2", "--dp-shard", "8", "--transport", "gloo", "--nics", "shared"]) == 0
    gloo = capsys.readouterr().out
    assert "pp=2 dp=8 dp_shard=8" in gloo
    assert "transports: pp gloo, dp gloo, one-vendor groups native, NICs shared" in gloo
    assert main([H200, "--pp", "2", "--dp-shard", "8", "--transport", "device-direct"]) == 0
    dd = capsys.readouterr().out
    t = [float(re.search(r"([\d.]+) TFLOP/s per GPU \(", o).group(1)) for o in (gloo, dd)]  # type: ignore[union-attr]
    assert t[0] < t[1]
    assert main(["configs/clusters/h100_mi300x.toml", "--config", "configs/llama3-8b-h100-mi300x.toml"]) == 0
    out = capsys.readouterr().out
    assert "pp=2 dp=4 dp_shard=4 tp=2" in out and "split=[17, 15]" in out


@pytest.mark.parametrize(("args", "msg"), [
    (["--pp", "2", "--split", "1,2"], "split [1, 2] must give each of the 2 stages"),
    (["--pp", "2", "--split", "a"], "must be comma-separated layer counts"),
    (["--ladder", "--profile", "intel=x.json"], "must be VENDOR=FILE"),
    (["--config", "configs/llama3-8b-h100-mi300x.toml", "--seq", "128"], "--config gives the layout"),
    (["--transport", "gloo"], "--transport describes one layout; add --pp"),
    (["--ladder", "--nics", "shared"], "--nics has no effect with --ladder"),
    (["--config", "configs/llama3-8b-h100-mi300x.toml", "--pp", "2"], "--pp has no effect with --config"),
])
def test_bad_layout_is_refused(args: list[str], msg: str) -> None:
    with pytest.raises(UserError, match=re.escape(msg)):
        main([H200, *args])


def test_bad_layout_is_one_sentence_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "plan", H200, "--pp", "3"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "does not divide the 16 GPUs" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_profile_replaces_a_vendors_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "amd.json"
    prof.write_text(json.dumps({"achieved_flops": 300e12}))
    assert main([H200, "--ladder"]) == 0
    before = capsys.readouterr().out
    assert main([H200, "--ladder", "--profile", f"amd={prof}"]) == 0
    after = capsys.readouterr().out
    mi = [float(re.search(r"one mi325x node alone:\s+(\d+)", o).group(1)) for o in (before, after)]  # type: ignore[union-attr]
    assert mi[1] < mi[0] and _ladder(after)[5][0] < _ladder(before)[5][0]
