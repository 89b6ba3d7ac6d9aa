"""Every group on stock Gloo from the trainer's own keys (the first rung of `bimetal plan --ladder`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)


def test_homogeneous_gloo_puts_one_vendor_groups_on_gloo(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "bimetal.cli", "train", "--simulate", "nvidia:2,amd:2", "--model.flavour=debug",
           "--parallel.pp=2", "--parallel.dp=2", "--parallel.pp_transport=gloo", "--parallel.dp_transport=gloo",
           "--training.steps=1", f"--metrics.run_dir={tmp_path / 'run'}", "--checkpoint.every=0"]
    proc = subprocess.run([*cmd, "--parallel.homogeneous_backend=gloo"], env=env, capture_output=True, text=True,
                          timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("pp.", "dp."))}
    assert rows["pp.dp0"][-2:] == ["cross-vendor", "gloo"], proc.stdout
    assert rows["dp.stage0"][-2:] == ["homogeneous-nvidia", "gloo"], proc.stdout
    assert rows["dp.stage1"][-2:] == ["homogeneous-amd", "gloo"], proc.stdout
    bad = subprocess.run([*cmd, "--parallel.homogeneous_backend=nccl"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "parallel.homogeneous_backend='nccl' is unknown" in bad.stderr, bad.stderr
