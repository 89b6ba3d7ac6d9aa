"""``bimetal slurm``: the sbatch script of a `bimetal train` config (or a `bimetal titan` run) on a Slurm cluster
whose vendors live in separate partitions; ``bimetal slurm check``: this job's allocation against the layout.

    bimetal slurm --config configs/llama3-8b-h100-mi300x.toml --partition nvidia=gpu-h100 \\
        --partition amd=gpu-mi300 --out job.sbatch
    bimetal slurm --titan --plan titan.toml --cluster configs/clusters/h100_mi300x.toml \\
        --partition nvidia=gpu-h100 --partition amd=gpu-mi300 -- --module llama3 --config llama3_8b

The node groups come from the cluster spec (``parallel.cluster`` of the config, or ``--cluster``): one hetjob
component per group, ``count`` nodes of ``gpus_per_node`` tasks each. A command of its own rather than a flag of
``bimetal plan``: it starts from a train config (or a torchtitan plan), not from a plan search, and it serves both
trainers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tomllib
from pathlib import Path

from bimetal.args import ArgumentParser
from bimetal.config import TrainConfig
from bimetal.errors import UserError
from bimetal.outputs import check_file, write_text
from bimetal.plan.sbatch import Component, SbatchJob, islands, rank_ranges, render
from bimetal.plan.spec import ClusterSpec, load_spec
from bimetal.topology.slurm import Island, check_allocation, read_job

# The c10d rendezvous settings torch 2.13 reads (torch/distributed/elastic/rendezvous: dynamic_rendezvous's
# create_handler, c10d_rendezvous_backend) that hold for every agent alike, all whole seconds or counts; is_host is
# per node (torchrun decides it by the endpoint's host) and store_type is not a timing.
RDZV_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
             "keep_alive_max_attempt", "read_timeout")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="bimetal slurm", description=__doc__.splitlines()[0],
                                epilog="Other arguments: --section.key=value overrides of the train config, or "
                                       "(with --titan) torchtitan's arguments after --.")
    p.add_argument("--config", help="the `bimetal train` config TOML")
    p.add_argument("--titan", action="store_true", help="run torchtitan's trainer (`bimetal titan`) instead")
    p.add_argument("--plan", help="with --titan: a `bimetal plan --write-titan` file (its stage groups order the "
                                  "components)")
    p.add_argument("--cluster", help="cluster spec TOML (default: the config's parallel.cluster)")
    p.add_argument("--partition", action="append", default=[], metavar="VENDOR|GROUP=PARTITION",
                   help="partition of a vendor's (or one node group's) nodes, e.g. nvidia=gpu-h100; repeatable")
    p.add_argument("--python", action="append", default=[], metavar="VENDOR|GROUP=PATH",
                   help="interpreter with that vendor's torch build on its nodes (default: this one)")
    p.add_argument("--simulate", action="store_true",
                   help="ranks play their component's vendor on CPU (BIMETAL_VENDOR); no GPUs are requested")
    p.add_argument("--out", help="write the script here (default: print it)")
    p.add_argument("--job-name", help="default: bimetal-<config name>")
    p.add_argument("--output", default="bimetal-%j.out", help="sbatch --output pattern (default: %(default)s)")
    p.add_argument("--time", help="sbatch --time of every component, e.g. 04:00:00")
    p.add_argument("--account", help="sbatch --account")
    p.add_argument("--cpus-per-task", type=int, help="sbatch --cpus-per-task of every component")
    p.add_argument("--master-port", type=int, help="rendezvous port on the first node (default: from the job id)")
    p.add_argument("--elastic", type=int, metavar="MIN_NODES",
                   help="run elastically: torchrun per node (--nnodes MIN_NODES:all, c10d rendezvous), restarted on "
                        "the nodes left when some fail; needs parallel.layout = \"auto\"")
    p.add_argument("--max-restarts", type=int, help="with --elastic: torchrun's --max-restarts (default 3)")
    p.add_argument("--rdzv-conf", metavar="KEY=SECONDS,...",
                   help="with --elastic: torchrun's --rdzv-conf for every agent, e.g. last_call_timeout=5 (torch's "
                        "defaults: a restart on fewer nodes waits keep_alive_interval=5 x keep_alive_max_attempt=3 "
                        "for the lost node, then last_call_timeout=30 for late ones); keys: "
                        + ", ".join(RDZV_KEYS))
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="a further #SBATCH option for every component, e.g. --sbatch=--exclusive; repeatable")
    return p


def rdzv_conf(text: str) -> str:
    """``--rdzv-conf`` checked: KEY=N pairs of RDZV_KEYS, each once, N a whole number of at least 1."""
    seen: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if key not in RDZV_KEYS or not sep:
            raise UserError(f"--rdzv-conf {text!r}: {item.strip()!r} is not KEY=N with KEY one of "
                            f"{', '.join(RDZV_KEYS)}.")
        if not value.isdigit() or int(value) < 1 or key in seen:
            raise UserError(f"--rdzv-conf {text!r}: {key} must be given once, as a whole number of at least 1 "
                            f"(seconds, or a count for keep_alive_max_attempt).")
        seen[key] = int(value)
    return ",".join(f"{k}={v}" for k, v in seen.items())


def _pairs(items: list[str], flag: str, keys: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UserError(f"{flag} {item!r} must be KEY=VALUE with KEY a vendor or node group, e.g. nvidia=gpu-h100.")
        if key not in keys:
            raise UserError(f"{flag} {item!r}: {key!r} is neither a vendor nor a node group of the cluster spec "
                            f"({', '.join(sorted(keys))}).")
        out[key] = value
    return out


def _pick(table: dict[str, str], isl: Island) -> str | None:
    return table.get(isl.name, table.get(isl.vendor))  # a group's own entry wins over its vendor's


def _stages(cfg: TrainConfig, parts: list[Island], spec: ClusterSpec) -> list[str]:
    """Each component's stages; refuses (one sentence) a layout the spec's nodes cannot hold (per-stage shapes
    included: each stage on its own island)."""
    from bimetal.parallel.layout import ParallelDims
    from bimetal.plan.layout_check import check_on_spec

    p = cfg.parallel
    what = ("the per-stage layout" if cfg.per_stage
            else f"the layout parallel.pp={p.pp} x parallel.dp={p.dp} x parallel.tp={p.tp}")
    need, have = cfg.world_size, sum(i.nodes * i.gpus_per_node for i in parts)
    if need != have:
        raise UserError(f"{what} needs {need} ranks but {spec.path} has {have} GPUs; one rank runs per GPU, so make "
                        "them match.")
    layout = check_on_spec(ParallelDims.from_config(cfg), spec, parts)
    out = []
    for ranks in rank_ranges(parts):
        held = sorted({layout.coords(r)[0] for r in ranks})
        out.append(f"stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}")
    return out


def main(argv: list[str]) -> int:
    a, rest = build_parser().parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if a.cpus_per_task is not None and a.cpus_per_task < 1:
        raise UserError(f"--cpus-per-task {a.cpus_per_task} must be at least 1.")
    if a.master_port is not None and not 0 < a.master_port < 65536:
        raise UserError(f"--master-port {a.master_port} is not a TCP port; give one from 1 to 65535.")
    if a.max_restarts is not None and a.elastic is None:
        raise UserError("--max-restarts goes with --elastic (a job of srun tasks is not restarted); add --elastic "
                        "MIN_NODES or drop it.")
    if a.rdzv_conf is not None and a.elastic is None:
        raise UserError("--rdzv-conf sets the rendezvous of an elastic job's torchrun agents; add --elastic "
                        "MIN_NODES or drop it.")
    rdzv = None if a.rdzv_conf is None else rdzv_conf(a.rdzv_conf)
    if a.max_restarts is not None and a.max_restarts < 0:
        raise UserError(f"--max-restarts {a.max_restarts} must be zero or more.")
    if a.elastic is not None and a.titan:
        raise UserError("--elastic restarts `bimetal train` on the nodes left, picking its layout for them; "
                        "torchtitan's trainer keeps a fixed layout, so a --titan job cannot run elastically.")
    if a.out:
        check_file("--out", a.out)  # before the spec and config are read: the one output, checked first
    cwd = Path.cwd()
    if a.titan:
        if a.config:
            raise UserError("--config is a `bimetal train` config; with --titan give --plan and torchtitan's own "
                            "--config after --.")
        if a.simulate:
            raise UserError("--simulate with --titan is not supported: torchtitan's CPU stand-ins need assets "
                            "written on the node; run `bimetal titan --simulate ...` on one machine instead.")
        if not a.cluster:
            raise UserError("--titan needs --cluster SPEC: the node groups the job runs on.")
        spec = load_spec(a.cluster)
        plan = _read_plan(a.plan) if a.plan else {}
        order = plan.get("bimetal", {}).get("stage_groups")
        parts = islands(spec, order)
        stages = [""] * len(parts)
        rank_args = ["-m", "bimetal.integrations.torchtitan", f"--cluster={Path(a.cluster).resolve()}"]
        rank_args += [f"--plan={Path(a.plan).resolve()}"] if a.plan else []
        rank_args += rest
        name = "bimetal-titan"
    else:
        from bimetal.config import load_config

        if not a.config:
            raise UserError("give --config TRAIN.toml (the layout to run), or --titan for torchtitan's trainer.")
        if a.plan:
            raise UserError("--plan is a torchtitan plan and goes with --titan; a train config carries its layout.")
        keep: set[str] = set()
        cfg = load_config(a.config, rest, keep=keep)
        cluster = a.cluster or cfg.parallel.cluster
        if not cluster:
            raise UserError(f"{a.config} names no cluster spec (parallel.cluster); add --cluster SPEC so the script "
                            "knows each vendor's nodes and GPUs per node.")
        spec = load_spec(cluster)
        parts = islands(spec)
        if a.elastic is not None:
            nodes = sum(i.nodes for i in parts)
            if cfg.parallel.layout != "auto":
                raise UserError(f"--elastic needs parallel.layout = \"auto\" (a restart on fewer nodes picks the "
                                f"layout for them), but {a.config} has a fixed layout; add --parallel.layout=auto.")
            if not 1 <= a.elastic <= nodes:
                raise UserError(f"--elastic {a.elastic} must be from 1 to the {nodes} node(s) of {spec.path}.")
        if cfg.parallel.layout == "auto":  # the script places the layout the ranks will pick on these nodes
            from bimetal.plan.auto_layout import World, pick_layout

            pick = pick_layout(cfg, World.from_spec(cluster), frozenset(keep))
            cfg = pick.cfg
            print(pick.line.replace("bimetal train:", "bimetal slurm:", 1), file=sys.stderr)
        stages = _stages(cfg, parts, spec)
        rank_args = ["-m", "bimetal.train", f"--config={Path(a.config).resolve()}",
                     f"--parallel.cluster={Path(cluster).resolve()}", *rest]
        name = f"bimetal-{Path(a.config).stem}"
    keys = {g.name for g in spec.groups} | {g.vendor for g in spec.groups}
    partitions, pythons = _pairs(a.partition, "--partition", keys), _pairs(a.python, "--python", keys)
    if a.simulate and any(i.vendor == "cpu" for i in parts):
        raise UserError(f"--simulate plays nvidia or amd on CPU; {spec.path} has a cpu node group.")
    comps = []
    for isl, st in zip(parts, stages):
        part = _pick(partitions, isl)
        if part is None:
            raise UserError(f"no partition for {isl.describe()}; add --partition {isl.vendor}=NAME (or "
                            f"{isl.name}=NAME).")
        comps.append(Component(isl, part, _pick(pythons, isl) or sys.executable, st))
    if not a.simulate and len({c.island.vendor for c in comps}) > 1 and len({c.python for c in comps}) == 1:
        print(f"bimetal slurm: note: every component runs {comps[0].python}; a mixed cluster needs each vendor's "
              "torch build (--python amd=PATH), else the ranks of the other vendor refuse to start.", file=sys.stderr)
    group_order = ",".join(i.name for i in parts)
    job = SbatchJob(
        job_name=a.job_name or name, components=tuple(comps), rank_args=tuple(rank_args),
        check_args=("-m", "bimetal.cli", "slurm", "check", f"--cluster={Path(spec.path).resolve()}",
                    f"--groups={group_order}", *(["--elastic"] if a.elastic is not None else [])),
        chdir=str(cwd), output=a.output, source=spec.path, command=shlex.join(["bimetal", "slurm", *argv]),
        simulate=a.simulate, master_port=a.master_port, cpus_per_task=a.cpus_per_task, time=a.time,
        account=a.account, extra=tuple(a.sbatch), elastic=a.elastic,
        max_restarts=3 if a.max_restarts is None else a.max_restarts, rdzv_conf=rdzv)
    text = render(job)
    if not a.out:
        sys.stdout.write(text)
        return 0
    out = write_text(a.out, text)  # whole: beside it, then renamed over it
    out.chmod(out.stat().st_mode | 0o111)
    print(f"bimetal slurm: {len(comps)} component(s) ({group_order}) written to {out}; submit with: sbatch {out}")
    return 0


def _read_plan(path: str) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"cannot read the plan file {path!r}: {exc}") from None


def check_main(argv: list[str]) -> int:
    """``bimetal slurm check --cluster SPEC [--groups a,b]``: inside a job, its allocation against the spec."""
    p = ArgumentParser(prog="bimetal slurm check", description=check_main.__doc__)
    p.add_argument("--cluster", required=True, help="cluster spec TOML")
    p.add_argument("--groups", help="node groups in component order (default: the trainer's order)")
    p.add_argument("--elastic", action="store_true", help="an elastic job: one task (torchrun agent) per node")
    a = p.parse_args(argv)
    job = read_job(os.environ)
    if job is None:
        raise UserError("bimetal slurm check runs inside a Slurm job (no SLURM_JOB_ID here); the script "
                        "`bimetal slurm` writes runs it first.")
    spec = load_spec(a.cluster)
    check_allocation(islands(spec, a.groups.split(",") if a.groups else None), job, f"cluster spec {a.cluster}",
                     agents=a.elastic)
    print(f"bimetal slurm check: job {job.job_id} has the {len(job.components)} component(s) {a.cluster} needs.",
          flush=True)
    return 0
