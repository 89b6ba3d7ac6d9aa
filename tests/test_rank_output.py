"""Rank output through the launcher (``bimetal.rank_output``) and a ``bimetal titan`` rank's refusal, without a job:
two short child processes stand in for ranks; ``tests/test_titan_output.py`` checks the same through launched
torchtitan ranks."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bimetal.errors import UserError
from bimetal.rank_output import RankOutput, parse_filter

pytestmark = pytest.mark.timeout(60)


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], **RankOutput.popen_kwargs())


def test_lines_are_prefixed_and_a_hidden_failed_rank_shows_its_stderr_tail() -> None:
    out, err = io.StringIO(), io.StringIO()
    output = RankOutput({0}, tail=3, stdout=out, stderr=err)
    shown = _child("import sys; print('a'); print('b', file=sys.stderr); print('c', end='')")
    hidden = _child("import sys; print('x'); [print(f'y{i}', file=sys.stderr) for i in range(6)]; sys.exit(1)")
    output.attach(0, shown)
    output.attach(1, hidden)
    assert shown.wait() == 0 and hidden.wait() == 1
    output.finish(failed=[1])
    assert out.getvalue() == "[rank0]:a\n[rank0]:c\n"  # a last line without a newline gets one
    lines = err.getvalue().splitlines()
    assert lines[0] == "[rank0]:b"
    assert lines[1] == "[rank1]:(the last 3 lines of rank 1's stderr, hidden by the filter)"
    assert lines[2:] == ["[rank1]:y3", "[rank1]:y4", "[rank1]:y5"]  # never its stdout
    assert output.torchrun_args() == ["--role", "rank", "--tee", "3", "--local-ranks-filter=0"]


def test_every_rank_shown_without_a_filter_and_a_bad_filter_is_one_sentence() -> None:
    out = io.StringIO()
    output = RankOutput(None, stdout=out, stderr=io.StringIO())
    for r in range(2):
        proc = _child(f"print('r{r}')")
        output.attach(r, proc)
        proc.wait()
    output.finish(failed=[])
    assert sorted(out.getvalue().splitlines()) == ["[rank0]:r0", "[rank1]:r1"]
    assert parse_filter("0, 3", 4) == {0, 3}
    for bad in ("4", "a", "", "-1"):
        with pytest.raises(UserError, match="--local-ranks-filter .* must list ranks of this 4-rank job"):
            parse_filter(bad, 4)


def test_a_titan_ranks_refusal_goes_to_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from bimetal.integrations.torchtitan.cli import rank_main

    monkeypatch.setattr(sys, "argv", ["bimetal.integrations.torchtitan", "--all-gloo"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("BIMETAL_LAUNCH_REPORT", str(tmp_path))
    assert rank_main() == 2
    report = json.loads((tmp_path / "rank-1.json").read_text())
    assert report["status"] == 2 and report["message"].startswith("--all-gloo is a reference for simulated runs")
    assert capsys.readouterr().err == ""  # the launcher says it once, as "bimetal titan: ..."
    monkeypatch.delenv("BIMETAL_LAUNCH_REPORT")
    assert rank_main() == 2
    assert capsys.readouterr().err.startswith("bimetal titan: --all-gloo is a reference for simulated runs")
