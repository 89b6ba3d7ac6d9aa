"""``bimetal launch``: start the ranks of a job on this machine.

It adds the simulation setting (``--simulate nvidia:2,amd:2`` -> ``BIMETAL_SIMULATE`` in every rank's
environment, vendor by global rank) and derives the number of ranks from it. A single-node job runs under
bimetal's own rank supervisor (``bimetal.supervisor``: torchrun's environment, but one sentence per failure and
every rank stopped on SIGINT/SIGTERM); a multi-node one (``--nnodes`` > 1 or ``--master-addr``) is handed to
``python -m torch.distributed.run``. On real clusters run ``torchrun`` directly; bimetal reads the standard
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bimetal.env import check_environment
from bimetal.errors import UserError
from bimetal.rank_output import RankOutput
from bimetal.topology.vendor import SIMULATE_ENV, SimulationSpecError, parse_simulate


def launch(
    rank_argv: list[str],
    simulate: str | None = None,
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    extra_env: dict[str, str] | None = None,
    torchrun_args: list[str] | None = None,
    name: str = "bimetal launch",
    output: RankOutput | None = None,
) -> int:
    """Run ``rank_argv`` (a script path or ``-m module`` plus arguments) as the ranks of one node.

    ``name`` starts the launcher's sentences (the command the user typed); ``output`` prefixes and filters the
    ranks' lines (``bimetal.rank_output``; torchrun's own options on a multi-node launch).
    Returns the launcher's exit status (non-zero if any rank failed).
    """
    if not rank_argv:
        raise UserError("nothing to launch: give a script or '-m module' after '--'")
    check_environment()  # a bad BIMETAL_* value: one sentence here, not one per rank
    if nnodes < 1 or max_restarts < 0 or (nproc_per_node is not None and nproc_per_node < 1):
        raise UserError(f"--nnodes={nnodes}, --nproc-per-node={nproc_per_node} and --max-restarts={max_restarts} "
                        "must be positive (restarts: zero or more)")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    vendors: list[str] = []
    if simulate:
        try:
            vendors = parse_simulate(simulate)
        except SimulationSpecError as exc:
            raise UserError(str(exc)) from None
        world = len(vendors)
        if world % nnodes:
            raise UserError(f"the simulated cluster {simulate!r} has {world} ranks, not a multiple of {nnodes} nodes")
        env[SIMULATE_ENV] = simulate
        if nproc_per_node is None:
            nproc_per_node = world // nnodes
        elif nproc_per_node * nnodes != world:
            raise UserError(
                f"--nproc-per-node {nproc_per_node} x {nnodes} nodes does not match the {world} ranks of {simulate!r}"
            )
    nproc_per_node = nproc_per_node or 1
    env.update(extra_env or {})
    if rank_argv[0] == "-m" and len(rank_argv) < 2:
        raise UserError("'-m' needs a module name")
    if nnodes == 1 and master_addr is None and not torchrun_args:
        from bimetal.supervisor import RankSupervisor

        return RankSupervisor([sys.executable, *rank_argv], nproc_per_node, env, max_restarts, name, vendors,
                              output=output).run()

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr or '127.0.0.1'}"]
        cmd.append(f"--master-port={master_port or 29500}")
    cmd += [f"--max-restarts={max_restarts}", *(output.torchrun_args() if output else []), *(torchrun_args or [])]
    if rank_argv[0] == "-m":
        cmd.append("--module")
        rank_argv = rank_argv[1:]
    cmd += rank_argv
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # torchrun forwards the signal to its workers; wait for it to tear them down.
        proc.wait()
        return 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bimetal launch", description=__doc__.splitlines()[0])
    p.add_argument("--simulate", help="simulated vendors by global rank, e.g. nvidia:2,amd:2")
    p.add_argument("--nproc-per-node", type=int, help="ranks on this node (default: from --simulate)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- <script | -m module> [args]")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(
        command, simulate=args.simulate, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        max_restarts=args.max_restarts,
    )
