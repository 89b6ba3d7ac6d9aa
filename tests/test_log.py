"""Diagnostics through ``bimetal.log``: a rank's log records and Python warnings come out as one
``[rank N] LEVEL: ...`` line each on stderr, once, however often the entry points set it up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from launcher import clean_env

SCRIPT = textwrap.dedent("""
    import logging, warnings
    from bimetal.entry import run_command
    from bimetal.log import rank_logging

    def main(argv):
        rank_logging(3)  # a second set-up (bimetal train's own) changes nothing
        logging.getLogger("bimetal.train.trainer").warning("checkpoint step-4 is damaged")
        warnings.warn("falls back to cpu-forward\\nsecond line", RuntimeWarning)
        logging.getLogger("bimetal.x").info("not shown: below WARNING")
        print("intended output")
        return 0

    raise SystemExit(run_command("test", main, []))
""")


def test_rank_lines_are_prefixed_once_and_warnings_join_them() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=clean_env(RANK="3"), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "intended output\n"
    assert proc.stderr.splitlines() == ["[rank 3] WARNING: checkpoint step-4 is damaged",
                                        "[rank 3] WARNING: falls back to cpu-forward"], proc.stderr


def test_outside_a_rank_a_warning_is_the_bare_message() -> None:
    script = ("import logging\nfrom bimetal.entry import run_command\n"
              "def main(argv):\n    logging.getLogger('bimetal.supervisor').warning('bimetal train: restarting')\n"
              "raise SystemExit(run_command('test', main, []))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "bimetal train: restarting\n", proc.stderr
