"""The ``bimetal`` command: parses the sub-command and hands the rest to the layer that owns it.

Errors a user can cause (bad config, impossible layout, missing library) end with one sentence on
stderr and exit status 2; a traceback means a bug.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from bimetal.entry import run_command
from bimetal.errors import UserError

# command -> (module, function, one-line help). Each function takes argv and returns an exit status.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "launch": ("bimetal.launch", "main", "start ranks on this machine (simulation, lab) via torch's launcher"),
    "topo": ("bimetal.parallel.cli", "main", "print the cluster view and the group table for a layout"),
    "train": ("bimetal.train.cli", "main", "train LLaMA-3 / Qwen2 across vendors"),
    "plan": ("bimetal.plan.cli", "main", "rank layouts for a cluster spec with the cost model"),
    "profile": ("bimetal.plan.cli", "profile_main", "time model layers on the local device for the planner"),
    "titan": ("bimetal.integrations.torchtitan.cli", "main", "torchtitan's trainer across vendors"),
    "slurm": ("bimetal.plan.slurm_cli", "main", "write the sbatch script of a config: one hetjob component per vendor"),
    "lab": ("bimetal.lab.cli", "main", "bring up an emulated multi-node cluster and run a job on it"),
    "bench": ("bimetal.bench.cli", "main", "benchmarks: 'bench comm', 'bench engine', 'bench ladder', 'bench train'"),
}

# (command, first argument) -> (module, function): sub-commands served by a package other than the command's
# (the lab experiments of ``bimetal plan`` live in bimetal.bench, which plan must not import).
SUBCOMMANDS: dict[tuple[str, str], tuple[str, str]] = {
    ("plan", "calibrate"): ("bimetal.bench.calibrate", "main"),
    ("plan", "ladder-check"): ("bimetal.bench.ladder_check", "main"),
}


def _resolve(module: str, func: str) -> Callable[[list[str]], int]:
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"this build of bimetal has no {module}.{func} ({exc})") from exc


def _usage() -> str:
    lines = ["usage: bimetal <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"bimetal: unknown command {command!r}; the commands are {', '.join(COMMANDS)} (bimetal --help).",
              file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[command]
    if (command, rest[0] if rest else "") in SUBCOMMANDS:
        (module, func), rest = SUBCOMMANDS[command, rest[0]], rest[1:]
    return run_command(command, lambda args: _resolve(module, func)(args), rest)


if __name__ == "__main__":
    sys.exit(main())
