"""The argument parser of every bimetal command: argparse, with a command-line mistake as one sentence.

argparse answers a bad option with its usage block and an error line (exit status 2); bimetal's rule is one
sentence and exit status 2, so ``ArgumentParser.error`` raises ``UserError`` instead, which the entry point
(``bimetal.entry``) prints once as ``bimetal <command>: ...``. ``--help`` is unchanged. Every parser of every
command and script is this class (``tests/test_cli_parsers.py`` walks the command table to hold that).

An option the command does not know is named before a missing required one: argparse checks the required
ones first, so ``bimetal plan fit --outt x`` would say "--out is required" and leave the typo unnamed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from bimetal.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are a ``UserError`` naming the option and pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help.")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> Any:
        """argparse's ``parse_args``, with unknown options named first (a pass with nothing required)."""
        required = [a for a in self._actions if a.required] + [g for g in self._mutually_exclusive_groups
                                                                if g.required]
        for item in required:
            item.required = False
        try:
            _, extras = self.parse_known_args(args, argparse.Namespace())
        except UserError:
            extras = []  # a wrong value: the full parse below says so
        finally:
            for item in required:
                item.required = True
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return super().parse_args(args, namespace)
