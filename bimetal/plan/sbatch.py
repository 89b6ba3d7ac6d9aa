"""The sbatch script of a job: one hetjob component per node group of the cluster spec, in stage order.

Pure text from plain data (``SbatchJob``), so the shipped configs' scripts are unit-tested without Slurm. Why
srun tasks rather than torchrun per node: Slurm then is the launcher - one task per GPU, its signals reach every
rank (``scancel``), ``--kill-on-bad-exit`` stops the step when one rank fails - and SLURM_PROCID is already global
over a het step, component 0's tasks first, so stage 0 lands on component 0 with no node-rank bookkeeping
across components (torchrun's c10d rendezvous numbers nodes in arrival order). The ranks turn Slurm's variables
into torchrun's themselves (``bimetal.topology.slurm.adopt``); the batch script checks the allocation against the
layout once, before ``srun``, so a wrong allocation ends in one sentence with no rank started.

An elastic job (``elastic``: ``bimetal slurm --elastic MIN``, a config of ``parallel.layout = "auto"``) is the
exception: there srun starts one torchrun agent per node (``--nnodes MIN:MAX``, c10d rendezvous on the first node
of component 0, ``--max-restarts``), because only torchrun's agent restarts the ranks on the nodes that are left;
``--no-kill`` keeps the allocation and the step going when a node fails, and ``--kill-on-bad-exit=0`` keeps the
surviving agents. Ranks are then numbered by the rendezvous, and ``layout = "auto"`` places the stages on the
world it finds. A node lost does not come back into a Slurm allocation: growing back is the next job.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from bimetal.errors import UserError
from bimetal.plan.spec import ClusterSpec
from bimetal.topology.slurm import Island


def islands(spec: ClusterSpec, order: Sequence[str] | None = None) -> list[Island]:
    """The node groups of ``spec`` as the job's components, in rank order.

    Default order: by vendor of first appearance, then file order - how ``bimetal.parallel.layout`` orders ranks
    into stages, so component 0 holds stage 0. ``order`` (group names, e.g. a torchtitan plan's stage groups)
    replaces it and must name every group once.
    """
    groups = {g.name: g for g in spec.groups}
    if order is None:
        vendors = list(dict.fromkeys(g.vendor for g in spec.groups))
        names = [g.name for v in vendors for g in spec.groups if g.vendor == v]
    else:
        names = list(dict.fromkeys(order))
        unknown = [n for n in names if n not in groups]
        if unknown or len(names) != len(groups):
            why = f"unknown: {', '.join(unknown)}" if unknown else "some are missing"
            raise UserError(f"the stage groups {', '.join(order)} must name each node group of {spec.path} "
                            f"({', '.join(groups)}) once; {why}.")
    return [Island(name=n, vendor=groups[n].vendor, gpu=groups[n].gpu, nodes=groups[n].count,
                   gpus_per_node=groups[n].gpus_per_node) for n in names]


def rank_ranges(parts: Sequence[Island]) -> list[range]:
    """Global ranks of each component (one per GPU, component by component)."""
    out, first = [], 0
    for isl in parts:
        n = isl.nodes * isl.gpus_per_node
        out.append(range(first, first + n))
        first += n
    return out


@dataclass(frozen=True)
class Component:
    """One hetjob component of the script."""

    island: Island
    partition: str
    python: str
    """Interpreter of this vendor's torch build on those nodes."""
    stages: str = ""
    """What it holds, for the header, e.g. ``"stage 0"``."""


@dataclass(frozen=True)
class SbatchJob:
    """Everything the script says; ``render`` writes it."""

    job_name: str
    components: tuple[Component, ...]
    rank_args: tuple[str, ...]
    """After ``python``: ``-m bimetal.train --config ...``."""
    check_args: tuple[str, ...]
    """After ``python``: the batch step's allocation check."""
    chdir: str
    output: str
    source: str
    """The cluster spec, as the header names it."""
    command: str
    """The ``bimetal slurm`` command line that wrote the script."""
    simulate: bool = False
    """Ranks play their component's vendor on CPU (``BIMETAL_VENDOR``); no GPUs are requested."""
    master_port: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    account: str | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)
    """Further ``#SBATCH`` options for every component."""
    elastic: int | None = None
    """The fewest nodes the job goes on with (torchrun per node, ``--nnodes elastic:all``); None: srun tasks."""
    max_restarts: int = 3
    """With ``elastic``: torchrun's ``--max-restarts``."""
    rdzv_conf: str | None = None
    """With ``elastic``: torchrun's ``--rdzv-conf`` for every agent (checked KEY=N pairs); None: torch's defaults."""


def render(job: SbatchJob) -> str:
    """The sbatch script."""
    het = len(job.components) > 1
    ranges = rank_ranges([c.island for c in job.components])
    lines = ["#!/bin/bash",
             f"# {job.job_name}: {len(job.components)} {'hetjob components' if het else 'component'}, one per node "
             f"group of {job.source}, in stage order.",
             f"# Written by: {job.command}"]
    for i, (c, ranks) in enumerate(zip(job.components, ranges)):
        lines.append(f"#   component {i}: {c.island.describe()}, partition {c.partition}: ranks "
                     f"{ranks.start}-{ranks.stop - 1}{', ' + c.stages if c.stages else ''}")
    lines += ["# One task per GPU, each task one rank: the ranks read RANK, LOCAL_RANK and WORLD_SIZE from srun's",
              "# SLURM_PROCID, SLURM_LOCALID and SLURM_STEP_NUM_TASKS, and meet at rank 0 on the first node of",
              "# component 0 (MASTER_ADDR); MASTER_PORT is set below, or derived from the job id.",
              "# Submit: sbatch THIS_FILE    Stop every rank: scancel JOBID"]
    if job.elastic:
        total = sum(c.island.nodes for c in job.components)
        lines = lines[:-4] + [
            f"# Elastic: one torchrun agent per node (--nnodes {job.elastic}:{total}, c10d rendezvous on the first",
            "# node of component 0, --max-restarts); when nodes fail, the agents left restart the ranks on what is",
            "# left (at least MIN nodes), which pick their layout and resume from the last complete checkpoint by",
            "# themselves. --no-kill keeps the allocation when a node fails.",
            "# Submit: sbatch THIS_FILE    Stop every rank: scancel JOBID"]
    if job.simulate:
        lines.append("# Simulated: each component's ranks play its vendor on CPU (BIMETAL_VENDOR); no GPUs requested.")
    head = [f"--job-name={job.job_name}", f"--chdir={job.chdir}", f"--output={job.output}"]
    head += [f"--time={job.time}"] * bool(job.time) + [f"--account={job.account}"] * bool(job.account)
    for i, c in enumerate(job.components):
        if i:
            lines.append("#SBATCH hetjob")
        per_node = 1 if job.elastic else c.island.gpus_per_node  # elastic: a task is a node's torchrun agent
        opts = (head if i == 0 else []) + [f"--partition={c.partition}", f"--nodes={c.island.nodes}",
                                           f"--ntasks-per-node={per_node}"]
        if job.elastic and i == 0:
            opts.append("--no-kill")
        if not job.simulate and c.island.vendor != "cpu":
            opts.append(f"--gpus-per-node={c.island.gpus_per_node}")
        if job.cpus_per_task:
            opts.append(f"--cpus-per-task={job.cpus_per_task}")
        if i and job.time:  # a time limit is per component
            opts.append(f"--time={job.time}")
        lines += [f"#SBATCH {o}" for o in opts + list(job.extra)]
    lines += ["", "set -euo pipefail", "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    if job.master_port:
        lines.append(f"export MASTER_PORT=${{MASTER_PORT:-{job.master_port}}}")
    lines += ["# The allocation against the layout, once, before any rank starts (the ranks check again).",
              _join([job.components[0].python, *job.check_args]), ""]
    if job.elastic:
        first = "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}" if het else "$SLURM_JOB_NODELIST"
        lines += ["# The rendezvous: the first node of component 0, the port above or one from the job id.",
                  f'RDZV_HOST=$(scontrol show hostnames "{first}" | head -n 1)',
                  "RDZV_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 10000))}",
                  "# A store per round: with torch's default, the first round's store shared, an agent that joins a",
                  "# running job waits for its address forever (growing back, docs/moving-a-run.md).",
                  "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", ""]
    steps = []
    for i, c in enumerate(job.components):
        opts = ["--kill-on-bad-exit=0" if job.elastic else "--kill-on-bad-exit=1"] + [f"--het-group={i}"] * het
        if job.simulate:
            opts.append(f"--export=ALL,BIMETAL_VENDOR={c.island.vendor}")
        if job.elastic:
            total = sum(x.island.nodes for x in job.components)
            agent = [c.python, "-m", "torch.distributed.run", f"--nnodes={job.elastic}:{total}",
                     f"--nproc-per-node={c.island.gpus_per_node}", "--rdzv-backend=c10d",
                     f"--max-restarts={job.max_restarts}"] + [f"--rdzv-conf={job.rdzv_conf}"] * bool(job.rdzv_conf)
            # the variables stay unquoted: the shell fills them in
            steps.append(_join(["--no-kill", *opts, *agent]) + ' --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" '
                         '--rdzv-id="$SLURM_JOB_ID" ' + _join(job.rank_args))
        else:
            steps.append(_join(opts + [c.python, *job.rank_args]))
    lines.append("srun " + " \\\n  : ".join(steps))
    return "\n".join(lines) + "\n"


def _join(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)
