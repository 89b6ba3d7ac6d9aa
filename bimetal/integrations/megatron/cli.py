"""``bimetal megatron``: a megatron-core script across vendors, without editing it.

    bimetal megatron --simulate nvidia:2,amd:2 -- scripts/megatron_gpt.py --pp 2 --tp 2
    torchrun --nproc-per-node 8 -m bimetal.integrations.megatron -- train.py ARGS     # one node of a real job

Each rank calls ``bimetal.integrations.megatron.initialize`` (the one call; a script that makes it too is fine)
and then runs the script as ``__main__`` with its own arguments. With ``--simulate`` this process checks the
script and the installed megatron-core and starts one rank per simulated GPU; without it, this process is one rank
of a job torchrun (or srun) started.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from bimetal import transports
from bimetal.args import ArgumentParser
from bimetal.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="bimetal megatron", description=__doc__.splitlines()[0])
    p.add_argument("--simulate", help="simulated vendors by global rank, e.g. nvidia:2,amd:2 (CPU, this machine)")
    p.add_argument("--transport", choices=transports.BIMETAL, default=transports.DEFAULT,
                   help=f"transport of every group that spans vendors (default: {transports.DEFAULT})")
    p.add_argument("--all-gloo", action="store_true",
                   help="reference run: every group on plain Gloo, no vendor rules (with --simulate only)")
    p.add_argument("--local-ranks-filter", default="0",
                   help="with --simulate: the ranks whose output is shown, each line prefixed [rank<R>]: (default 0)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: the Megatron training script")
    return p


def _script(command: list[str]) -> tuple[Path, list[str]]:
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise UserError("no script given; bimetal megatron [options] -- SCRIPT [ARGS]")
    script = Path(command[0])
    if not script.is_file():
        raise UserError(f"the script {command[0]!r} does not exist")
    return script, command[1:]


def main(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    script, args = _script(opts.command)
    from bimetal.topology.vendor import is_simulated

    if opts.all_gloo and not (opts.simulate or is_simulated()):
        raise UserError("--all-gloo is a reference for simulated runs; it needs --simulate")
    if not opts.simulate:
        if not any(v in os.environ for v in ("RANK", "SLURM_PROCID")):
            raise UserError("without --simulate this is one rank of a job started by torchrun or srun, but RANK is "
                            "not set; add --simulate (e.g. nvidia:1,amd:1) or start it with torchrun")
        return run_rank(script, args, opts.transport, opts.all_gloo)
    from bimetal.integrations.megatron.hooks import check_release
    from bimetal.launch import launch
    from bimetal.rank_output import RankOutput, parse_filter
    from bimetal.topology.vendor import parse_simulate

    try:
        vendors = parse_simulate(opts.simulate)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_release(functions=False)  # the version here once, before any rank starts; each rank checks the rest
    rank_argv = ["-m", "bimetal.integrations.megatron", f"--transport={opts.transport}"]
    if opts.all_gloo:
        rank_argv.append("--all-gloo")
    return launch([*rank_argv, "--", str(script), *args], simulate=opts.simulate, name="bimetal megatron",
                  output=RankOutput(parse_filter(opts.local_ranks_filter, len(vendors))),
                  extra_env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def run_rank(script: Path, args: list[str], transport: str, all_gloo: bool) -> int:
    """One rank: bimetal's call, then the script as ``__main__`` (its ``sys.argv`` as if run directly)."""
    import bimetal.integrations.megatron as integration

    integration.initialize(transport, all_gloo=all_gloo)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def rank_main() -> int:
    """``python -m bimetal.integrations.megatron``: errors a user can cause end in one sentence, exit 2."""
    from bimetal.integrations.common import rank_entry  # the rank's imports, not the argument check's

    return rank_entry(main, "bimetal megatron")
