"""scripts/titan_matrix.py's reading of runs: an all-Gloo reference that dies of a native crash is run again from the
dump folder as it was, and a reference that crashes in every try is reported as such, not as bimetal's failure.

No rank runs here: ``_run_variant`` (one ``bimetal titan`` run) is replaced by a double that writes into the dump
folder what a run would and returns the records a crash or a clean run gives.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import titan_matrix  # noqa: E402

SEGV = "bimetal titan: rank 7 (amd) was killed by SIGSEGV after completing step 4; the job stopped."


def _record(rc: int, losses: list[float] | None, crash: str | None = None) -> dict:
    return {"rc": rc, "losses": losses, "checkpoints": [], "cause": crash or "", "command": "titan ...",
            "repeated_steps": [], "native_crash": crash}


def test_the_launchers_line_of_a_death_by_sigsegv_or_sigabrt_is_a_native_crash() -> None:
    assert titan_matrix.native_crash(f"[rank0]:...\n{SEGV}\n") == SEGV
    assert titan_matrix.native_crash("bimetal titan: rank 6 (amd) was also killed by SIGABRT.") is not None
    lost = "bimetal titan: rank 6 (amd) exited with status 1 (RuntimeError: Connection closed by peer); the job stopped"
    assert titan_matrix.native_crash(lost) is None
    assert titan_matrix.native_crash("[rank7]:bimetal titan: rank 7 was killed by SIGSEGV") is None  # a rank's line


def test_a_crashed_reference_variant_reruns_from_the_dump_folder_as_it_was(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Variant 0 writes step-2; variant 1's first try writes a partial step-10 and dies of SIGSEGV; its second try
    starts from step-2 alone (the partial checkpoint is gone) and ends well. bimetal's own run is run once."""
    tries: list[tuple[int, bool, list[str]]] = []

    def run_variant(simulate: str, args: list[str], i: int, dump: Path, all_gloo: bool, cwd: Path,
                    logs: Path | None, attempt: int) -> tuple[dict, str | None]:
        tries.append((i, all_gloo, sorted(p.name for p in dump.glob("step-*"))))
        dump.mkdir(parents=True, exist_ok=True)
        if i == 0:
            (dump / "step-2").mkdir()
            return _record(0, [8.0, 7.5]), None
        (dump / "step-10").mkdir()
        if all_gloo and attempt == 0:
            return _record(1, None, SEGV), SEGV
        return _record(0, [7.0, 6.5]), None

    monkeypatch.setattr(titan_matrix, "_run_variant", run_variant)
    gloo = titan_matrix._run("nvidia:4,amd:4", [["a"], ["b"]], tmp_path / "gloo", True, tmp_path)
    mixed = titan_matrix._run("nvidia:4,amd:4", [["a"], ["b"]], tmp_path / "mixed", False, tmp_path)
    assert tries == [(0, True, []), (1, True, ["step-2"]), (1, True, ["step-2"]),
                     (0, False, []), (1, False, ["step-2"])]
    assert gloo["reference_crashes"] == [SEGV] and mixed["reference_crashes"] == []
    status, detail = titan_matrix.classify(gloo, mixed)
    assert status == "identical" and detail.endswith(f"(stock Gloo of torch {titan_matrix.TORCH}) died of a native "
                                                     f"crash in 1 earlier try and was run again ({SEGV})"), detail


def test_a_reference_that_crashes_in_every_try_is_not_reported_as_bimetals_failure() -> None:
    mixed = {"variants": [_record(0, [8.0, 7.5]), _record(0, [7.0, 6.5])], "reference_crashes": []}
    gloo = {"variants": [_record(0, [8.0, 7.5]), _record(1, None, SEGV)], "reference_crashes": [SEGV, SEGV]}
    status, detail = titan_matrix.classify(gloo, mixed)
    assert status == "all-Gloo crashes", (status, detail)
    assert detail == (f"bimetal's run ended well (4 logged step(s) over 2 run(s)); its all-Gloo reference (stock "
                      f"Gloo of torch {titan_matrix.TORCH}) died of a native crash in each of 3 tries: {SEGV}")
    other = {"variants": [_record(0, [8.0, 7.5]), _record(1, None)], "reference_crashes": []}
    assert titan_matrix.classify(other, mixed)[0] == "fails"  # any other failure of the reference stays a failure
