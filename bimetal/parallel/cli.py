"""``bimetal topo``: print the cluster view and the group table of a layout, without training.

Outside a launched job it starts the ranks itself (``--simulate``) through ``bimetal launch``; each rank
then initialises, exchanges topology, lays out the degrees and creates every group for real, so the table
shows what a training job would get.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from bimetal import transports
from bimetal.args import ArgumentParser
from bimetal.errors import UserError

if TYPE_CHECKING:
    from bimetal.parallel.layout import ParallelDims


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="bimetal topo", description=__doc__.splitlines()[0])
    p.add_argument("--simulate", help="simulated vendors by global rank, e.g. nvidia:2,amd:2")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tp-per-stage", default="", help="tensor-parallel degree of each stage, e.g. 2,1 "
                   "(as parallel.tp_per_stage)")
    p.add_argument("--dp-per-stage", default="", help="data-parallel degree of each stage, e.g. 2,1 "
                   "(as parallel.dp_per_stage)")
    p.add_argument("--allow-cross-vendor-dp", action="store_true")
    p.add_argument("--strict", action="store_true", help="refuse stages that are not vendor-homogeneous")
    p.add_argument("--pp-transport", default=transports.DEFAULT,
                   help=" | ".join(transports.NAMES))
    p.add_argument("--dp-transport", default=transports.DEFAULT,
                   help="for data-parallel groups that span vendors")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for start-up and group creation")
    p.add_argument("--interfaces", default="",
                   help="interfaces the cross-vendor transports may use on each node, names or patterns separated by "
                        "commas (as parallel.interfaces; default: BIMETAL_IFACES, else every up interface less "
                        "loopback, bridges and container networks)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        if not args.simulate:
            raise UserError("outside torchrun, give --simulate (e.g. --simulate nvidia:2,amd:2) or run under torchrun")
        _check_before_launch(args)
        from bimetal.launch import launch
        from bimetal.simulate import strip_simulate

        return launch(["-m", "bimetal.parallel.cli", *strip_simulate(argv)], simulate=args.simulate,
                      name="bimetal topo")
    return _run_rank(args)


def _stage_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option} {text!r} must be integers separated by commas, one per stage, e.g. 2,1.") from None


def _dims(args: argparse.Namespace) -> ParallelDims:
    from bimetal.parallel.layout import ParallelDims

    return ParallelDims(args.pp, args.dp, args.tp, args.allow_cross_vendor_dp, args.strict,
                        _stage_list(args.tp_per_stage, "--tp-per-stage"),
                        _stage_list(args.dp_per_stage, "--dp-per-stage"))


def _check_before_launch(args: argparse.Namespace) -> None:
    """The timeout and the layout against the simulated world, as the ranks would refuse them (once, here)."""
    from bimetal.parallel.groups import plan_groups
    from bimetal.parallel.layout import plan_layout
    from bimetal.topology.records import ClusterView, RankRecord
    from bimetal.topology.vendor import parse_simulate

    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout} must be a positive number of seconds.")
    vendors = parse_simulate(args.simulate)
    view = ClusterView([RankRecord(r, r, "localhost", v, "cpu", 0) for r, v in enumerate(vendors)])
    layout = plan_layout(view, _dims(args))
    plan_groups(view, layout, {"pp": args.pp_transport, "dp": args.dp_transport}, simulated=True)


def _run_rank(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from bimetal.parallel import init_parallel

    dims = _dims(args)
    interfaces = [n.strip() for n in args.interfaces.split(",") if n.strip()] or None
    ctx = init_parallel(
        dims, {"pp": args.pp_transport, "dp": args.dp_transport}, timedelta(seconds=args.timeout),
        interfaces=interfaces,
    )
    try:
        if ctx.rank == 0:
            for line in ctx.layout.shape_lines():
                print(line)
    finally:
        ctx.destroy()
    return 0


if __name__ == "__main__":
    import sys

    from bimetal.entry import run_command

    sys.exit(run_command("topo", main, sys.argv[1:]))
