"""``bimetal bench NAME``: picks the benchmark and hands it the rest of the command line."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from bimetal.errors import UserError

# name -> (module, function taking argv)
BENCHES: dict[str, tuple[str, str]] = {
    "comm": ("bimetal.bench.comm", "main"),
    "engine": ("bimetal.bench.cli", "engine_main"),
    "gpu-ladder": ("bimetal.bench.gpu_ladder", "main"),
    "ladder": ("bimetal.bench.ladder", "main"),
    "train": ("bimetal.bench.train", "main"),
}


def engine_main(argv: list[str]) -> int:
    """``bench comm`` with the device-direct rows: gloo, cpu-forward x1, device-direct and the engine alone
    (``bimetal.bench.engine``), at 4 KiB and 64 MiB, unless the options say otherwise."""
    from bimetal.bench.comm import main as comm_main

    args = list(argv)
    if not any(a.startswith("--transports") for a in args):
        args += ["--transports", "gloo,cpu-forward,device-direct,dd-engine", "--stripes", "1"]
    if not any(a.startswith("--sizes") for a in args):
        args += ["--sizes", "4K,64M"]
    return comm_main(args)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        raise UserError(f"usage: bimetal bench {{{','.join(BENCHES)}}} [options]")
    run: Callable[[list[str]], int] = getattr(importlib.import_module(BENCHES[argv[0]][0]), BENCHES[argv[0]][1])
    return run(argv[1:])
