"""A rank under Slurm: who it is from Slurm's environment, and the job's allocation checked against a layout.

Under ``srun`` every task is one rank. ``read_job`` parses what Slurm puts in the environment: the job's
components (one per hetjob component, or one for a plain job) with their nodes and tasks per node, and - inside
a step - this task's global id, its id on the node, the step's task count and the GPUs of its node. ``adopt``
turns that into torchrun's contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
where no launcher has set it, so the rest of bimetal reads one contract; the Slurm node name becomes the rank's
host identity (``BIMETAL_HOST``). ``check_allocation`` refuses, in one sentence, an allocation that does not have
the shape the layout needs (components, nodes per component, one task per GPU, the vendor of each component).

Measured on Slurm 22.05 with a het step (``srun --het-group=0 ... : --het-group=1 ...``): SLURM_PROCID runs over
all components in order (component 0's tasks first) and SLURM_STEP_NUM_TASKS counts them all; SLURM_LOCALID
counts per node; the job's and the step's node lists span every component sorted by name, so the master
address is the first node of ``SLURM_JOB_NODELIST_HET_GROUP_0`` (where the batch script and task 0 run); the
batch script itself has SLURM_PROCID=0 but no SLURM_STEP_ID, so it is never taken for a rank.
Pure Python: no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from bimetal.errors import UserError

PORT_BASE = 20000
"""MASTER_PORT, when nobody set one, is ``PORT_BASE + job id % PORT_SPAN``: the same on every task of the job
(a het job's components share the leader's id), below Linux's ephemeral range so no outgoing connection holds it."""
PORT_SPAN = 10000
HOST_ENV = "BIMETAL_HOST"  # topology.exchange reads it: ranks with one name share a node


class SlurmEnvError(UserError):
    """Slurm's environment is missing a variable or holds one bimetal cannot read."""


@dataclass(frozen=True)
class Component:
    """One component of the job (a hetjob component, or the whole of a plain job) as Slurm allocated it."""

    index: int
    partition: str
    nodes: tuple[str, ...]
    """Node names in Slurm's order (the order tasks are placed in)."""
    tasks_per_node: tuple[int, ...]
    """Tasks on each node, same order as ``nodes``."""

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)


@dataclass(frozen=True)
class Task:
    """This process as a task of a Slurm step."""

    rank: int
    """SLURM_PROCID: global over every component of a het step."""
    world: int
    """Tasks in the step (all components)."""
    local_rank: int
    """SLURM_LOCALID: this task's index on its node."""
    node: str
    """SLURMD_NODENAME."""
    gpus_on_node: int | None
    """SLURM_GPUS_ON_NODE: GPUs the step has on this node; None when the job asked for none."""


@dataclass(frozen=True)
class SlurmJob:
    """The job's allocation, and this task when the process is one."""

    job_id: int
    components: tuple[Component, ...]
    task: Task | None

    @property
    def tasks(self) -> int:
        return sum(c.tasks for c in self.components)

    def component_of(self, rank: int) -> Component | None:
        """The component holding global task ``rank`` (tasks are numbered component by component)."""
        first = 0
        for comp in self.components:
            if rank < first + comp.tasks:
                return comp
            first += comp.tasks
        return None

    @property
    def master(self) -> str:
        """The first node of the first component: where task 0 and the batch script run."""
        return self.components[0].nodes[0]


@dataclass(frozen=True)
class Island:
    """What the layout needs of one component: a node group of the cluster spec."""

    name: str
    vendor: str
    gpu: str
    nodes: int
    gpus_per_node: int

    def describe(self) -> str:
        return f"node group {self.name!r} ({self.nodes} x {self.gpus_per_node} {self.vendor} {self.gpu})"


def expand_hostlist(expr: str, variable: str = "the node list") -> list[str]:
    """``"gpu[01-03,07],amd5"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "amd5"]`` (Slurm's hostlist syntax;
    several bracket groups in one name multiply, ``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2)."""
    names: list[str] = []
    for part in _split_top(expr, variable):
        names += _expand_one(part, variable)
    if not names:
        raise SlurmEnvError(f"{variable}={expr!r} names no node.")
    return names


def _split_top(expr: str, variable: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SlurmEnvError(f"{variable}={expr!r} is not a Slurm node list.")
        if ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"{variable}={expr!r} is not a Slurm node list.")
    parts.append(expr[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str, variable: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", name)
    if not m:
        if "]" in name:
            raise SlurmEnvError(f"{variable} holds {name!r}, not a Slurm node name.")
        return [name]
    prefix, ranges, rest = m.groups()
    tails = _expand_one(rest, variable) if rest else [""]
    out = []
    for item in ranges.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise SlurmEnvError(f"{variable} holds the range [{ranges}], not a Slurm node range.")
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out += [f"{prefix}{n:0{len(lo)}d}{tail}" for tail in tails]
    return out


def expand_counts(expr: str, variable: str) -> list[int]:
    """Slurm's per-node counts: ``"8(x2),4"`` -> ``[8, 8, 4]``."""
    counts: list[int] = []
    for item in expr.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise SlurmEnvError(f"{variable}={expr!r} is not a list of per-node counts like 8(x2),4.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _need(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise SlurmEnvError(f"Slurm's environment has no {name}; run the ranks as tasks of a Slurm job step (srun).")
    return value


def _int(env: Mapping[str, str], name: str) -> int:
    raw = _need(env, name)
    try:
        return int(raw)
    except ValueError:
        raise SlurmEnvError(f"{name}={raw!r} is not an integer.") from None


def read_job(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The Slurm job this process belongs to (None outside Slurm), with this task when inside a step."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    size = int(env["SLURM_HET_SIZE"]) if env.get("SLURM_HET_SIZE", "").isdigit() else 0
    components = []
    for k in range(max(size, 1)):
        suffix = f"_HET_GROUP_{k}" if size else ""
        # A plain job's step rewrites SLURM_TASKS_PER_NODE for the step; a het job's per-group variables stay the job's.
        job_level = bool(size) or "SLURM_STEP_ID" not in env
        tasks_var = f"SLURM_TASKS_PER_NODE{suffix}" if job_level else "SLURM_STEP_TASKS_PER_NODE"
        nodes_var = f"SLURM_JOB_NODELIST{suffix}" if job_level else "SLURM_STEP_NODELIST"
        nodes = expand_hostlist(_need(env, nodes_var), nodes_var)
        tasks = expand_counts(_need(env, tasks_var), tasks_var)
        if len(tasks) != len(nodes):
            raise SlurmEnvError(f"{tasks_var}={env[tasks_var]!r} counts {len(tasks)} nodes but {nodes_var} names "
                                f"{len(nodes)}.")
        partition = env.get(f"SLURM_JOB_PARTITION{suffix}", "")
        components.append(Component(k, partition, tuple(nodes), tuple(tasks)))
    task = None
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        gpus = env.get("SLURM_GPUS_ON_NODE", "")
        world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        task = Task(rank=_int(env, "SLURM_PROCID"), world=world, local_rank=_int(env, "SLURM_LOCALID"),
                    node=env.get("SLURMD_NODENAME", ""), gpus_on_node=int(gpus) if gpus.isdigit() else None)
    return SlurmJob(job_id=_int(env, "SLURM_JOB_ID"), components=tuple(components), task=task)


def torchrun_env(job: SlurmJob, env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables for this task; MASTER_ADDR/MASTER_PORT only where ``env`` lacks them."""
    task = job.task
    if task is None:
        raise SlurmEnvError("this process is not a task of a Slurm step (no SLURM_STEP_ID); start it with srun.")
    out = {"RANK": str(task.rank), "WORLD_SIZE": str(task.world), "LOCAL_RANK": str(task.local_rank)}
    comp = job.component_of(task.rank) if task.world == job.tasks else None
    if comp is not None and task.node in comp.nodes:
        out["LOCAL_WORLD_SIZE"] = str(comp.tasks_per_node[comp.nodes.index(task.node)])
    if not env.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = job.master
    if not env.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(PORT_BASE + job.job_id % PORT_SPAN)
    if task.node and not env.get(HOST_ENV):
        out[HOST_ENV] = task.node
    return out


def adopt(env: MutableMapping[str, str] | None = None) -> SlurmJob | None:
    """In a task of a Slurm step of several tasks, where no launcher set RANK: set the torchrun variables from
    Slurm's and return the job; otherwise return None, changing nothing but the host name of a rank that torchrun
    started in a Slurm step (``BIMETAL_HOST``: the Slurm node, as for a task).

    A step of one task (``srun --pty bash``, a one-GPU job) is left alone: one process needs no rendezvous, and a
    ``bimetal train --simulate`` typed inside it must still start its own ranks.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "SLURM_STEP_ID" in env and env.get("SLURMD_NODENAME") and not env.get(HOST_ENV):
        # torchrun under srun (``bimetal slurm --elastic``) numbered the ranks; the node is still Slurm's
        env[HOST_ENV] = env["SLURMD_NODENAME"]
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    job = read_job(env)
    if job is None or job.task is None or job.task.world < 2:
        return None
    env.update(torchrun_env(job, env))
    return job


def check_allocation(islands: Sequence[Island], job: SlurmJob, source: str, vendor: str | None = None,
                     agents: bool = False) -> None:
    """Refuse, in one sentence, an allocation that does not have the shape ``islands`` (in component order) need.
    ``agents``: an elastic job's, one task per node (its torchrun agent) in place of one per GPU.

    ``source`` names where the islands come from (the cluster spec). With a task: also the step's task count,
    the GPUs Slurm gave this task's node and, when ``vendor`` is given, the vendor this task found itself on.
    """
    fix = "submit the script `bimetal slurm` writes for this config, or fix the cluster spec"
    comps = job.components
    if len(comps) != len(islands):
        names = ", ".join(i.name for i in islands)
        raise UserError(f"the Slurm job has {len(comps)} component(s) but {source} lays the job out on "
                        f"{len(islands)} ({names}), one hetjob component each in this order; {fix}.")
    for comp, isl in zip(comps, islands):
        where = f"hetjob component {comp.index}" + (f" (partition {comp.partition})" if comp.partition else "")
        if len(comp.nodes) != isl.nodes:
            few = "too few" if len(comp.nodes) < isl.nodes else "too many"
            raise UserError(f"{where} has {len(comp.nodes)} node(s), {few} for {isl.describe()} of {source}; "
                            f"ask for --nodes={isl.nodes} there, or {fix}.")
        for node, count in zip(comp.nodes, comp.tasks_per_node):
            if agents and count != 1:
                raise UserError(f"{where} runs {count} task(s) on node {node} but an elastic job runs one torchrun "
                                f"agent per node; ask for --ntasks-per-node=1, or {fix}.")
            if not agents and count != isl.gpus_per_node:
                raise UserError(f"{where} runs {count} task(s) on node {node} but {isl.describe()} of {source} "
                                f"needs one rank per GPU, {isl.gpus_per_node} per node; ask for "
                                f"--ntasks-per-node={isl.gpus_per_node}, or {fix}.")
    task = job.task
    if task is None:
        return
    need = sum(i.nodes * i.gpus_per_node for i in islands)
    if task.world != need:
        raise UserError(f"this Slurm step runs {task.world} tasks but {source} needs {need} ranks (one per GPU); "
                        f"start the step over every component (srun --het-group=0,...) without -n.")
    mine = job.component_of(task.rank)
    if mine is None:
        return
    isl = islands[mine.index]
    if task.gpus_on_node is not None and task.gpus_on_node != isl.gpus_per_node:
        raise UserError(f"node {task.node} of hetjob component {mine.index} has {task.gpus_on_node} GPU(s) in this "
                        f"job but {isl.describe()} of {source} says {isl.gpus_per_node} per node; ask for "
                        f"--gpus-per-node={isl.gpus_per_node}, or correct gpus_per_node in the spec.")
    if vendor == "cpu" and isl.vendor in ("nvidia", "amd"):
        raise UserError(f"rank {task.rank} on node {task.node} (hetjob component {mine.index}) finds no GPU with its "
                        f"torch build, but {source} puts {isl.describe()} there; run that component with the Python "
                        f"of the {isl.vendor} torch build (bimetal slurm --python {isl.vendor}=PATH).")
    if vendor is not None and isl.vendor in ("nvidia", "amd") and vendor != isl.vendor:
        raise UserError(f"rank {task.rank} on node {task.node} (hetjob component {mine.index}"
                        f"{', partition ' + mine.partition if mine.partition else ''}) runs on {vendor} but "
                        f"{source} puts {isl.describe()} there; give that component the partition of the "
                        f"{isl.vendor} nodes.")
