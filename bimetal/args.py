"""The argument parser of every bimetal command: argparse, with a command-line mistake as one sentence.

argparse answers a bad option with its usage block and an error line (exit status 2); bimetal's rule is one
sentence and exit status 2, so ``ArgumentParser.error`` raises ``UserError`` instead, which the entry point
(``bimetal.entry``) prints once as ``bimetal <command>: ...``. ``--help`` is unchanged.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from bimetal.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are a ``UserError`` naming the option and pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help.")
