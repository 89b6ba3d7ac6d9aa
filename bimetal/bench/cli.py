"""``bimetal bench NAME``: picks the benchmark and hands it the rest of the command line."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from bimetal.errors import UserError

# name -> module whose ``main(argv)`` runs it
BENCHES: dict[str, str] = {
    "comm": "bimetal.bench.comm",
    "ladder": "bimetal.bench.ladder",
    "train": "bimetal.bench.train",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        raise UserError(f"usage: bimetal bench {{{','.join(BENCHES)}}} [options]")
    run: Callable[[list[str]], int] = importlib.import_module(BENCHES[argv[0]]).main
    return run(argv[1:])
