"""``bimetal train``: check the command through ``prepare``, then print the dry-run, start the ranks or train.

Every check that needs no process group runs in ``bimetal.train.prepare`` before anything starts, for the run
and for ``--dry-run`` alike, so a mistake is one sentence before any rank starts. Inside a rank (``RANK`` set,
by torchrun or bimetal's launcher; or a task of an srun step, whose Slurm variables become torchrun's, see
``bimetal.topology.slurm``) only the cheap ones run again, the folders this rank writes and, under srun, the
allocation against the cluster spec.
"""

from __future__ import annotations

import argparse
import os
import sys

from bimetal.args import ArgumentParser
from bimetal.log import rank_logging
from bimetal.simulate import strip_simulate
from bimetal.topology import slurm
from bimetal.train.metrics import format_summary
from bimetal.train.preflight import check_slurm
from bimetal.train.prepare import add_options, prepare


class _TrainParser(ArgumentParser):
    """The parser of ``bimetal train``, whose help ends with every config key (``format_keys``). That list is made
    from the config schema's JSON schemas, about 0.25 s of CPU: made when the help is shown, not in every run and
    every rank that starts as a new interpreter."""

    def format_help(self) -> str:
        if self.epilog is None:
            from bimetal.train.keys import format_keys

            self.epilog = format_keys()
        return super().format_help()


def main(argv: list[str]) -> int:
    parser = _TrainParser(prog="bimetal train", description="Train across vendors.",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser)
    ns, rest = parser.parse_known_args(argv)
    # A task of an srun step is a rank: Slurm's variables become torchrun's (not under --simulate, which starts
    # its own ranks, nor under torchrun, which set RANK already).
    slurm_job = None if ns.simulate else slurm.adopt()
    job = prepare(ns, rest)
    if job.note:  # the layout chosen from --simulate, once every check has passed
        print(job.note, file=sys.stderr if ns.json else sys.stdout, flush=True)
    if ns.dry_run:
        from bimetal.train.dryrun import dry_run

        return dry_run(job.cfg, ns.json, local=job.local, device_type=job.device_type)
    if "RANK" in os.environ:
        if slurm_job is not None:
            check_slurm(job.cfg, slurm_job)
        rank_logging(int(os.environ["RANK"]))
    elif job.vendors:
        from bimetal.launch import launch

        return launch(["-m", "bimetal.train", *strip_simulate(argv), *job.auto], simulate=ns.simulate,
                      nproc_per_node=len(job.vendors), max_restarts=ns.max_restarts, name="bimetal train")
    from bimetal.train.trainer import train

    summary = train(job.cfg, job.keep)
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
