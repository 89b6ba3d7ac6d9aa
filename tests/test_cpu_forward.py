"""cpu-forward against plain Gloo: torch's parallel machinery on it, and its failure modes.

Every op x dtype x stripe count is in the operation table shared by all transports (``test_op_table.py``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import clean_env, free_port, launch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(240)


def test_torch_parallel_machinery_matches_gloo(tmp_path: Path) -> None:
    """DeviceMesh (backend_override) + DTensor redistribute, DDP, FSDP2 and 1F1B on cpu-forward vs Gloo."""
    proc = launch("nvidia:1,amd:1", str(HERE / "cf_parallel_rank.py"), str(tmp_path), timeout=200)
    for r in (0, 1):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(results) == {"dtensor", "ddp", "fsdp2", "pipeline_1f1b"}
        bad = {k: v for k, v in results.items() if v}
        assert not bad, f"rank {r}: {bad}"
    assert proc.returncode == 0, proc.stderr[-2000:]


FAULTS = [  # (mode, what rank 0 of the pair says, its peer named by global rank)
    ("die", "group 'pp.dp0' recv #2 with peer {peer} failed"),
    ("stall", "group 'pp.dp0' recv #2 with peer {peer} did not complete within 6 s"),
    # both time out; rank 0 sees its own timeout or, when rank 1's came first, the connection rank 1's Gloo closed:
    # either way its error says what rank 1 is doing
    ("desync", r"^group 'pp.dp0' all_reduce #2 (did not complete within 6 s \(the peer did not answer: dead, "
               r"stalled or in a different operation\)|failed: Connection closed by peer \S+); "
               r"desync: rank {peer} is in all_gather #2$"),
    ("corrupt", "group 'pp.dp0' recv #3 with peer {peer}: checksum mismatch, the data was corrupted in transit"),
]
MODES = [mode for mode, _ in FAULTS]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every fault at once, one pair of ranks each (the p-th of ``MODES``: ranks 2p and 2p+1), in one job: forks of
    one interpreter that imported torch once, with no launcher watching (``forked_ranks.py``), so the pair whose
    rank dies on purpose stops no other pair."""
    out = tmp_path_factory.mktemp("faults")
    modes = MODES
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(2 * len(modes)),
                    LOCAL_WORLD_SIZE=str(2 * len(modes)),
                    BIMETAL_SIMULATE=",".join(["nvidia:1,amd:1"] * len(modes)))  # each pair nvidia + amd, as before
    proc = subprocess.run([sys.executable, str(HERE / "forked_ranks.py"), str(2 * len(modes)), str(out / "ranks"),
                           "--", str(HERE / "cf_fault_rank.py"), str(out), ",".join(modes)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.parametrize(("mode", "fragment"), FAULTS, ids=MODES)
def test_dead_stalled_or_corrupting_peer_fails_naming_why(mode: str, fragment: str, faults: Path) -> None:
    result = json.loads((faults / f"{mode}.json").read_text())
    fragment = fragment.format(peer=2 * MODES.index(mode) + 1)
    if mode == "desync":
        assert result["error"] and re.search(fragment, result["error"]), result
    else:
        assert result["error"] and fragment in result["error"], result
