"""cpu-forward against plain Gloo: torch's parallel machinery on it, and its failure modes.

Every op x dtype x stripe count is in the operation table shared by all transports (``test_op_table.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launcher import launch

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


@pytest.mark.parametrize(("mode", "fragment"), [
    ("die", "group 'pp.dp0' recv #2 with peer 1 failed"),
    ("stall", "group 'pp.dp0' recv #2 with peer 1 did not complete within 6 s"),
    # both time out; rank 0 sees its own timeout or, when rank 1's came first, the connection rank 1's Gloo closed:
    # either way its error says what rank 1 is doing
    ("desync", r"^group 'pp.dp0' all_reduce #2 (did not complete within 6 s \(the peer did not answer: dead, "
               r"stalled or in a different operation\)|failed: Connection closed by peer \S+); "
               r"desync: rank 1 is in all_gather #2$"),
    ("corrupt", "group 'pp.dp0' recv #3 with peer 1: checksum mismatch, the data was corrupted in transit"),
])
def test_dead_stalled_or_corrupting_peer_fails_naming_why(mode: str, fragment: str, tmp_path: Path) -> None:
    launch("nvidia:1,amd:1", str(HERE / "cf_fault_rank.py"), str(tmp_path), mode, timeout=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    if mode == "desync":
        assert result["error"] and re.search(fragment, result["error"]), result
    else:
        assert result["error"] and fragment in result["error"], result
