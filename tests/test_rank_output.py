"""Rank output through the launcher (``bimetal.rank_output``) and a ``bimetal titan`` rank's refusal, without a job:
two short child processes stand in for ranks; ``tests/test_titan_output.py`` checks the same through launched
torchtitan ranks."""

from __future__ import annotations

import io
import json
import os
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


_ABORT = """
import faulthandler, os, signal, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # one more thread in the dump
sys.stderr.write("terminate called after throwing an instance of 'c10::DistBackendError'\\n"
                 "  what():  writev failed: Bad address\\nException raised from send at pair.cc:42\\n")
sys.stderr.flush()
faulthandler.enable(all_threads=True)  # as torch's @record does
os.kill(os.getpid(), signal.SIGABRT)
"""


def test_a_crash_is_one_line_with_its_cause_not_the_thread_dump(capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 aborts on a C++ exception (its what() line, then faulthandler's dump), rank 2 ends on a Python
    exception through bimetal's entry point a moment later, rank 0 exits 1 after a while: the launcher's first
    line names rank 1, SIGABRT and the what(); the others are one line, stopped because rank 1 died, with the
    Python exception as their first reason; the hidden tail shows the what() and leaves the dump out."""
    from bimetal.supervisor import RankSupervisor

    code = ("import os, sys, time\nrank = int(os.environ['RANK'])\n"
            f"if rank == 1:\n    exec({_ABORT!r})\n"
            "time.sleep(0.5 if rank else 3.0)\n"
            "if rank == 2:\n    from bimetal.entry import run_command\n"
            "    run_command('x', lambda argv: [][1], [])\n"
            "sys.exit(1)\n")
    err = io.StringIO()
    output = RankOutput({0}, stdout=io.StringIO(), stderr=err)
    status = RankSupervisor([sys.executable, "-c", code], 3, dict(os.environ), name="bimetal launch",
                            vendors=["nvidia", "nvidia", "amd"], output=output, grace_s=120).run()
    said = capsys.readouterr().err.splitlines()
    assert status == 1
    assert said == [
        "bimetal launch: rank 1 (nvidia) was killed by SIGABRT (writev failed: Bad address); the job stopped.",
        "bimetal launch: ranks 0 (nvidia) and 2 (amd) stopped because rank 1 died (first reason given: IndexError: "
        "list index out of range)."], said
    tail = err.getvalue().split("[rank1]:(the last", 1)[1].split("[rank2]:", 1)[0].splitlines()
    assert "faulthandler's thread dump left out" in tail[0] and "what():  writev failed" in "\n".join(tail), tail
    assert not any("Thread 0x" in line or 'File "' in line for line in tail), tail
    assert output.cause(2) == "IndexError: list index out of range"


def test_cause_lines_of_an_abort_by_the_c_library_and_of_a_re_raised_exception() -> None:
    """What glibc's heap check said before faulthandler's dump is the rank's cause when nothing else is (seen in an
    8-rank torchtitan run); a segfault's preceding line is not; an exception re-raised without a message keeps the
    one that has it."""
    import types

    aborted = (b"[titan] step 4\nmalloc(): unaligned tcache chunk detected\nFatal Python error: Aborted\n\n"
               b"Thread 0x00007f (most recent call first):\n  File \"x.py\", line 1 in f\n")
    reraised = (b"Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: [pair.cc:553] "
                b"Connection closed by peer\n\nThe above exception was the direct cause of the following exception:"
                b"\n\nTraceback (most recent call last):\n  File \"x.py\", line 2, in g\nRuntimeError: \n"
                b"        Failed to run stage backward:\n")
    segfault = b"W1207 _redistribute.py:390] While redistributing ...\nFatal Python error: Segmentation fault\n\n"
    output = RankOutput({0}, stdout=io.StringIO(), stderr=io.StringIO())
    for rank, err in ((1, aborted), (2, reraised), (3, segfault)):
        output.attach(rank, types.SimpleNamespace(stdout=io.BytesIO(b""), stderr=io.BytesIO(err)))
    output.drain()
    assert output.cause(1) == "malloc(): unaligned tcache chunk detected"
    assert output.cause(2) == "RuntimeError: [pair.cc:553] Connection closed by peer"
    assert output.cause(3) == ""  # a segfault says nothing before the dump: a warning there is no cause


def test_an_error_file_of_a_re_raised_exception_names_its_root_cause() -> None:
    """torch's pipeline stage re-raises a failed backward as ``RuntimeError`` whose message starts on its second
    line; the launcher's "first reason given" is the Gloo error it came from, not "RuntimeError:"."""
    from bimetal.supervisor import error_file_cause

    stack = ("Traceback (most recent call last):\n  File \"stage.py\", line 1, in backward\n    work.wait()\n"
             "RuntimeError: [pair.cc:537] Read error: Connection reset by peer\n\nThe above exception was the "
             "direct cause of the following exception:\n\nTraceback (most recent call last):\n  File \"b.py\", "
             "line 2, in stage_backward\nRuntimeError: \n        Failed to run stage backward:\n")
    data = {"message": {"message": "RuntimeError: \n        Failed to run stage backward:\n",
                        "extraInfo": {"py_callstack": stack, "timestamp": "0"}}}
    assert error_file_cause(data) == "RuntimeError: [pair.cc:537] Read error: Connection reset by peer"
    plain = {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": stack}}}
    assert error_file_cause(plain) == "ValueError: bad"


def test_the_step_record_is_replaced_never_rewritten_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed between the truncation and the write of an in-place rewrite leaves an empty record; a
    replaced one is the old file or the new one. The old file, held by a second link, keeps its step: the
    record was renamed over, not truncated."""
    from bimetal.supervisor import REPORT_ENV, report_step

    monkeypatch.setenv(REPORT_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    report_step(3)
    (tmp_path / "old").hardlink_to(tmp_path / "rank-3.step")
    report_step(4)
    assert (tmp_path / "rank-3.step").read_text() == "4" and (tmp_path / "old").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "rank-3.step"]  # no temporary left


def test_the_verdict_orders_deaths_and_gives_one_line_per_failure(tmp_path: Path) -> None:
    """Four ended ranks, read from the launcher's records alone (no processes): rank 1 exited (status 1, no
    sentence) in the same poll as rank 2 was killed by SIGABRT, rank 3 aborted a poll later and rank 0 said why
    it stopped. The death by a signal counts first; rank 3 is one "also" line; ranks 0 and 1 one "stopped because"
    line with rank 0's sentence; no line per rank."""
    from bimetal.supervisor import RankSupervisor, _Rank

    (tmp_path / "rank-0.json").write_text(json.dumps({"status": 1, "message": "rank 0 stopped in step 3: peer gone.",
                                                      "time": 5.0}))
    ranks = [_Rank(0, "nvidia", None, code=1, seen=1.05), _Rank(1, "nvidia", None, code=1, seen=1.0),  # type: ignore[arg-type]
             _Rank(2, "amd", None, code=-6, seen=1.0), _Rank(3, "amd", None, code=-6, seen=1.02)]  # type: ignore[arg-type]
    outcome = RankSupervisor(["python"], 4, {})._verdict(ranks, tmp_path, restartable=False)
    assert outcome.status == 1
    assert outcome.lines == ["rank 2 (amd) was killed by SIGABRT; the job stopped.",
                             "rank 3 (amd) was also killed by SIGABRT.",
                             "ranks 0 (nvidia) and 1 (nvidia) stopped because rank 2 died (first reason given: rank 0 "
                             "stopped in step 3: peer gone)."], outcome.lines


def test_an_exit_on_a_lost_peer_counts_after_the_death_by_signal_that_caused_it(tmp_path: Path) -> None:
    """Rank 0's exit on Gloo's "Connection closed by peer" was seen a poll before rank 1's SIGSEGV (the death that
    closed the socket): rank 1 is named first, with rank 0 as one "stopped because" line; without a signal death
    the exit itself is the first failure."""
    from bimetal.supervisor import RankSupervisor, _Rank

    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:65201."
    (tmp_path / "rank-0.error.json").write_text(json.dumps({"message": {"message": lost}}))
    ranks = [_Rank(0, "amd", None, code=1, seen=1.0), _Rank(1, "amd", None, code=-11, seen=1.3)]  # type: ignore[arg-type]
    outcome = RankSupervisor(["python"], 2, {})._verdict(ranks, tmp_path, restartable=False)
    assert outcome.lines == ["rank 1 (amd) was killed by SIGSEGV; the job stopped.",
                             f"rank 0 (amd) stopped because rank 1 died (first reason given: {lost.rstrip('.')})."], \
        outcome.lines
    alone = [_Rank(0, "amd", None, code=1, seen=1.0)]  # type: ignore[arg-type]
    outcome = RankSupervisor(["python"], 1, {})._verdict(alone, tmp_path, restartable=False)
    assert outcome.lines == [f"rank 0 (amd) exited with status 1 ({lost}); the job stopped."], outcome.lines
