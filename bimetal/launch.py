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
import importlib.util
import os
import socket
import subprocess
import sys

from bimetal.args import ArgumentParser
from bimetal.env import check_environment, check_needs
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
    check_needs(simulated=bool(simulate) or bool(os.environ.get(SIMULATE_ENV)))  # a GPU asked for and absent
    if nnodes < 1 or max_restarts < 0 or (nproc_per_node is not None and nproc_per_node < 1):
        raise UserError(f"--nnodes={nnodes}, --nproc-per-node={nproc_per_node} and --max-restarts={max_restarts} "
                        "must be positive (restarts: zero or more)")
    _check_nodes(nnodes, node_rank, master_addr, master_port)
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
    _check_program(rank_argv)
    if nnodes == 1 and master_addr is None and not torchrun_args:
        from bimetal.rank_fork import fork_wanted
        from bimetal.supervisor import RankSupervisor

        fork = fork_wanted(env, simulated=bool(env.get(SIMULATE_ENV)))
        return RankSupervisor([sys.executable, *rank_argv], nproc_per_node, env, max_restarts, name, vendors,
                              port=master_port or 0, output=output, fork=fork).run()

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


def _check_program(rank_argv: list[str]) -> None:
    """The script or module the ranks run exists (else every rank fails alike, after they all started)."""
    if rank_argv[0] == "-m":
        if len(rank_argv) < 2:
            raise UserError("'-m' needs a module name")
        try:
            found = importlib.util.find_spec(rank_argv[1]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"module {rank_argv[1]!r} cannot be found by this Python ({sys.executable}); check "
                            "the name after -m.")
    elif rank_argv[0] == "-c":
        return
    elif rank_argv[0].startswith("-"):
        raise UserError(f"{rank_argv[0]!r} is not a script; give a script path or '-m module' after '--'.")
    elif not os.path.isfile(rank_argv[0]):
        raise UserError(f"script {rank_argv[0]!r} does not exist; give a script path or '-m module' after '--'.")


def _check_nodes(nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None) -> None:
    """The node options, and the master port free where this node hosts the rendezvous (node 0): a busy one is
    one sentence here, not torchrun's traceback after the ranks of the other nodes started."""
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} must be from 0 to {nnodes - 1} (--nnodes {nnodes}).")
    if nnodes > 1 and not master_addr:
        raise UserError(f"--nnodes {nnodes} needs --master-addr: the address of node 0, which every node connects "
                        "to.")
    if master_port is not None and not 0 < master_port < 65536:
        raise UserError(f"--master-port {master_port} is not a TCP port; give one from 1 to 65535.")
    if node_rank == 0:
        why = port_in_use(master_port or (29500 if master_addr else 0))
        if why:
            raise UserError(f"--master-port {master_port or 29500} cannot be used on this machine ({why}); "
                            "choose a free port, or leave --master-port out.")


def port_in_use(port: int) -> str | None:
    """Why a TCP listener cannot be opened on ``port`` of every interface here (as torch's TCPStore opens one),
    or None; port 0 (any free port) is always fine."""
    if not port:
        return None
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here: the IPv4 try decides
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1)
            return None
        except OSError as exc:
            return str(exc.strerror or exc)
        finally:
            sock.close()
    return None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="bimetal launch", description=__doc__.splitlines()[0])
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
