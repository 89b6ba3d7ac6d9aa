"""``bimetal train`` bad inputs: one sentence on stderr, exit status 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).parent / "bimetal")
    return subprocess.run([exe, "train", *args], capture_output=True, text=True, timeout=50)


@pytest.mark.parametrize(("toml", "extra", "match"), [
    ("[optim]\nlearning_rate = 1\n", [], "optim.learning_rate"),
    ("[parallel]\npp = 2\nlayers_per_stage = [3]\n", [], "layers_per_stage"),
    ("[data]\npath = '/nonexistent/corpus.txt'\n", [], "does not exist"),
    ("", ["--training.steps=abc"], "training.steps"),
])
def test_bad_input_exits_2(tmp_path: Path, toml: str, extra: list[str], match: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(toml)
    r = _run("--config", str(f), *extra)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr
