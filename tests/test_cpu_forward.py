"""cpu-forward against plain Gloo: every op x dtype x stripe count (1, 2), on 2 and 4 ranks.

One launched session per world size runs all cases (see ``cf_rank.py``) so process start-up is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(240)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        env.pop(key, None)
    return env


@pytest.mark.parametrize("simulate", ["nvidia:1,amd:1", "nvidia:2,amd:2"])
def test_every_op_matches_gloo(simulate: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", simulate, "--",
                           str(HERE / "cf_rank.py"), str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    world = sum(int(p.split(":")[1]) for p in simulate.split(","))
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == world
    for f in files:
        results = json.loads(f.read_text())
        # 2 stripe counts x 6 dtypes x (4 or 5 reductions + 9 other ops) + 4 per stripe count
        assert len(results) == 170, f"{f.name}: {len(results)} cases ran"
        bad = [f"{r['case']}: {r['detail']}" for r in results if not r["ok"]]
        assert not bad, f"{f.name}: " + "\n".join(bad[:10])
