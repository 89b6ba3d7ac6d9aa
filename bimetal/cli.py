"""The ``bimetal`` command: every command and sub-command in one table, each served by one function.

A row names the function that serves a command line (``module:function``, imported only when used); that
function builds its own parser beside its handling and takes the rest of the command line. A command with
sub-commands lists them in the same table, whatever package serves them: ``plan calibrate`` is a benchmark on
the lab (``bimetal.bench``, which the planner must not import), so this layer, above both, names it.

Errors a user can cause (bad config, impossible layout, missing library) end with one sentence on
stderr and exit status 2; a traceback means a bug.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from bimetal.entry import run_command
from bimetal.errors import UserError


@dataclass(frozen=True)
class Command:
    """One ``bimetal`` command: its one-line help, the function for the command itself (None: it needs a
    sub-command) and its sub-commands (name -> function), each ``module:function`` taking argv, returning a
    status."""

    help: str
    serve: str | None
    subcommands: dict[str, str] = field(default_factory=dict)


COMMANDS: dict[str, Command] = {
    "launch": Command("start ranks on this machine (simulation, lab) via torch's launcher", "bimetal.launch:main"),
    "topo": Command("print the cluster view and the group table for a layout", "bimetal.parallel.cli:main"),
    "train": Command("train LLaMA-3 / Qwen2 across vendors", "bimetal.train.cli:main"),
    "plan": Command("rank layouts for a cluster spec with the cost model", "bimetal.plan.cli:main", {
        "fit": "bimetal.plan.fit:main",
        "calibrate": "bimetal.bench.calibrate:main",
        "ladder-check": "bimetal.bench.ladder_check:main",
    }),
    "profile": Command("time model layers on the local device for the planner", "bimetal.plan.profile:profile_main"),
    "titan": Command("torchtitan's trainer across vendors", "bimetal.integrations.torchtitan.cli:main"),
    "megatron": Command("a megatron-core script across vendors", "bimetal.integrations.megatron.cli:main"),
    "slurm": Command("write the sbatch script of a config: one hetjob component per vendor",
                     "bimetal.plan.slurm_cli:main", {"check": "bimetal.plan.slurm_cli:check_main"}),
    "lab": Command("bring up an emulated multi-node cluster and run a job on it", None, {
        "up": "bimetal.lab.cli:up_main",
        "down": "bimetal.lab.cli:down_main",
        "run": "bimetal.lab.cli:run_main",
        "status": "bimetal.lab.cli:status_main",
    }),
    "bench": Command("benchmarks: transports, the throughput ladders, replicated vs sharded training", None, {
        "comm": "bimetal.bench.comm:main",
        "engine": "bimetal.bench.comm:engine_main",
        "gpu-ladder": "bimetal.bench.gpu_ladder:main",
        "ladder": "bimetal.bench.ladder:main",
        "train": "bimetal.bench.train:main",
    }),
}


def _resolve(serve: str) -> Callable[[list[str]], int]:
    module, func = serve.split(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"this build of bimetal has no {module}.{func} ({exc})") from exc


def _usage() -> str:
    lines = ["usage: bimetal <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {c.help}" + (f" ({name} {' | '.join(c.subcommands)})" if c.subcommands else "")
              for name, c in COMMANDS.items()]
    return "\n".join(lines)


def _sub_usage(name: str, c: Command) -> str:
    return f"usage: bimetal {name} {{{','.join(c.subcommands)}}} [options]"


def _route(name: str, rest: list[str]) -> int:
    """Run ``bimetal NAME REST`` with the function of its row."""
    c = COMMANDS[name]
    if rest and rest[0] in c.subcommands:
        return _resolve(c.subcommands[rest[0]])(rest[1:])
    if c.serve is not None:
        return _resolve(c.serve)(rest)
    if rest and rest[0] in ("-h", "--help"):
        print(f"{_sub_usage(name, c)}\n\n{c.help}\n\nsub-commands (each takes --help): {', '.join(c.subcommands)}")
        return 0
    raise UserError(f"{'no sub-command given' if not rest else f'no sub-command {rest[0]!r}'}; {_sub_usage(name, c)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bimetal: unknown command {name!r}; the commands are {', '.join(COMMANDS)} (bimetal --help).",
              file=sys.stderr)
        return 2
    # the sentence of a sub-command names it: "bimetal plan fit: ...", as its own --help does
    label = f"{name} {rest[0]}" if rest and rest[0] in COMMANDS[name].subcommands else name
    return run_command(label, lambda args: _route(name, args), rest)


if __name__ == "__main__":
    sys.exit(main())
