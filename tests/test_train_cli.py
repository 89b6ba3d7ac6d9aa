"""``bimetal train`` bad inputs: one sentence on stderr, exit status 2, no traceback.

The first case runs the console script (a subprocess: the exit status and the sentence shown for real); the
others are refused before any rank starts, so they run ``bimetal.cli.main`` in this process (``cli_inprocess``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import cli_main

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).parent / "bimetal")
    return subprocess.run([exe, "train", *args], capture_output=True, text=True, timeout=50)


@pytest.mark.parametrize(("toml", "extra", "match", "console"), [
    ("[optim]\nlearning_rate = 1\n", [], "optim.learning_rate", True),
    ("[parallel]\npp = 2\nlayers_per_stage = [3]\n", [], "layers_per_stage", False),
    ("[data]\npath = '/nonexistent/corpus.txt'\n", [], "does not exist", False),
    ("", ["--training.steps=abc"], "training.steps", False),
])
def test_bad_input_exits_2(tmp_path: Path, toml: str, extra: list[str], match: str, console: bool, capsys,
                           monkeypatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text(toml)
    if console:
        r = _run("--config", str(f), *extra)
        code, err = r.returncode, r.stderr
    else:
        code, _, err = cli_main(["train", "--config", str(f), *extra], capsys, monkeypatch)
    assert code == 2, err
    assert match in err and "Traceback" not in err
