"""The import layers of DESIGN.md hold (``lint-imports``, contracts in pyproject.toml), and every module of
bimetal sits in one of them, so a new package cannot slip past the contract unchecked."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layers() -> list[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [name.strip() for row in layers for name in re.split(r"[|:]", row)]


def test_every_top_level_module_is_in_a_layer() -> None:
    pkg = ROOT / "bimetal"
    found = {f"bimetal.{p.stem}" for p in pkg.glob("*.py") if p.name != "__init__.py"}
    found |= {f"bimetal.{p.parent.name}" for p in pkg.glob("*/__init__.py")}
    assert found - set(_layers()) == set(), "add these to [tool.importlinter] layers in pyproject.toml"


def test_lint_imports_keeps_every_contract() -> None:
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
    assert "0 broken" in proc.stdout
