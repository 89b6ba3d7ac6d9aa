"""Every command's argument parsing ends a mistake in one sentence: the whole command table, walked.

Each command and sub-command of ``bimetal.cli.COMMANDS`` (a command added later is walked too) is given an
option nobody defined; the answer is one line on stderr starting ``bimetal <command>``, exit status 2, no usage
block and no traceback. The commands run in this process (``bimetal.cli.main``), so the walk costs imports only.
Beside it, a static check that no module or script builds a plain ``argparse.ArgumentParser``, whose errors
are argparse's usage dump.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bimetal import cli

ROOT = Path(__file__).resolve().parents[1]


def _command_lines() -> list[list[str]]:
    lines = []
    for name, command in cli.COMMANDS.items():
        if command.serve is not None:
            lines.append([name])
        lines += [[name, sub] for sub in command.subcommands]
    return lines


@pytest.mark.parametrize("words", _command_lines(), ids=" ".join)
def test_an_unknown_option_is_one_sentence(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([*words, "--no-such-option"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-1000:], err[-2000:])
    assert len(lines) == 1, err
    assert lines[0].startswith(f"bimetal {' '.join(words)}: "), lines[0]
    assert "usage:" not in err + out and "Traceback" not in err, err
    # a command that passes options it does not know to another program (train: config overrides; slurm and
    # titan: the trainer's) names the option or first asks for what it cannot start without
    assert "--no-such-option" in lines[0] or "give --config" in lines[0] or "no GPU" in lines[0], lines[0]


def test_a_missing_required_option_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["slurm", "check"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("bimetal slurm check: the following arguments are required: --cluster; see bimetal slurm "
                           "check --help."), err


def test_every_parser_is_the_one_parser_class() -> None:
    plain = re.compile(r"argparse\.ArgumentParser\(")
    files = [*ROOT.joinpath("bimetal").rglob("*.py"), *ROOT.joinpath("scripts").glob("*.py")]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
             if plain.search(line) and f.name != "args.py"]
    assert not found, f"parsers outside bimetal.args.ArgumentParser: {found}"
