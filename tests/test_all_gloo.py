"""One-vendor groups on stock Gloo from the trainer's own key (with the gloo transports: every group on Gloo,
the first rung of `bimetal plan --ladder`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import bimetal

from bimetal.config import load_config
from bimetal.errors import UserError

pytestmark = pytest.mark.timeout(150)


def test_homogeneous_gloo_puts_one_vendor_groups_on_gloo(tmp_path: Path) -> None:
    proc = bimetal("train", "--simulate", "nvidia:2", "--model.flavour=debug", "--parallel.dp=2",
                   "--parallel.homogeneous_backend=gloo", "--training.steps=1", f"--metrics.run_dir={tmp_path / 'run'}",
                   "--checkpoint.every=0", timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("dp.")}
    # the simulated native back-end would be bimetal_sim_native here
    assert rows["dp.stage0"][-2:] == ["homogeneous-nvidia", "gloo"], proc.stdout


def test_homogeneous_backend_values() -> None:
    assert load_config(None, ["--parallel.homogeneous_backend=gloo"]).parallel.homogeneous_backend == "gloo"
    with pytest.raises(UserError, match="parallel.homogeneous_backend='nccl' is unknown; use 'native' or 'gloo'"):
        load_config(None, ["--parallel.homogeneous_backend=nccl"])
