"""Checks of a training launch that need no process group, run before any rank starts.

Everything a user can get wrong and that the launcher can see is refused here in one sentence: the model and
tokenizer, the stage split, the data file (missing, not text, too short, or token ids the model cannot
embed), and - under ``--simulate``, where the vendors of every rank are known - the layout against the
world size and the vendor islands. Without a config, ``choose_layout`` picks the layout from the world.
"""

from __future__ import annotations

import math
from functools import reduce
from pathlib import Path

import numpy as np

from bimetal.config import TrainConfig
from bimetal.errors import UserError
from bimetal.topology.slurm import SlurmJob

_SAMPLE_TOKENS = 1 << 24  # token ids checked up front in a .bin shard; the ranks check every batch they read


def choose_layout(vendors: list[str], n_layers: int) -> tuple[int, int]:
    """(pp, dp) for a job of these simulated vendors: dp is the largest size that divides every vendor's rank
    count, so every stage is one vendor and cross-vendor traffic stays on the pipeline axis."""
    counts = [vendors.count(v) for v in dict.fromkeys(vendors)]
    dp = reduce(math.gcd, counts)
    pp = len(vendors) // dp
    if pp > n_layers:
        raise UserError(f"the {len(vendors)} simulated ranks ({_summary(vendors)}) need {pp} pipeline stages, more "
                        f"than the model's {n_layers} layers; give a --config with parallel.pp and parallel.dp.")
    return pp, dp


def _summary(vendors: list[str]) -> str:
    return ", ".join(f"{v}:{vendors.count(v)}" for v in dict.fromkeys(vendors))


def describe_layout(cfg: TrainConfig) -> str:
    """The layout keys as the user wrote them, for a sentence."""
    p = cfg.parallel
    if cfg.per_stage:
        return (f"the per-stage layout (dp x tp per stage: "
                f"{' + '.join(f'{d}x{t}' for t, d, _ in cfg.stage_shapes())})")
    return f"the layout parallel.pp={p.pp} x parallel.dp={p.dp} x parallel.tp={p.tp}"


def check_layout(cfg: TrainConfig, vendors: list[str]) -> None:
    """The layout of ``cfg`` on a simulated cluster of ``vendors`` (one host), refused as the ranks would."""
    from bimetal.parallel.groups import plan_groups
    from bimetal.parallel.layout import ParallelDims, plan_layout
    from bimetal.parallel.mesh import plan_dp_mesh_groups
    from bimetal.topology.records import ClusterView, RankRecord

    p = cfg.parallel
    world = cfg.world_size
    if world != len(vendors):
        raise UserError(f"{describe_layout(cfg)} needs {world} ranks but --simulate gives {len(vendors)} "
                        f"({_summary(vendors)}); change one to match.")
    view = ClusterView([RankRecord(r, r, "localhost", v, "cpu", 0) for r, v in enumerate(vendors)])
    layout = plan_layout(view, ParallelDims.from_config(cfg))
    plan_groups(view, layout, {"pp": p.pp_transport, "dp": p.dp_transport}, simulated=True)
    if cfg.per_stage:
        plan_dp_mesh_groups(view, layout, [sh for _, _, sh in cfg.stage_shapes()], {"dp": p.dp_transport})


def check_world(cfg: TrainConfig, world: int) -> None:
    """A rank's own check of the layout against ``WORLD_SIZE`` (torchrun, or a launcher)."""
    need = cfg.world_size
    if need != world:
        raise UserError(f"{describe_layout(cfg)} needs {need} ranks but this job has WORLD_SIZE={world}; start "
                        f"{need} ranks or change the layout.")


def check_slurm(cfg: TrainConfig, job: SlurmJob) -> None:
    """A rank started by srun: the job's allocation against the layout of ``parallel.cluster`` (components, nodes,
    one task per GPU, GPUs per node, this rank's vendor); without a cluster spec only the world size is known."""
    if not cfg.parallel.cluster:
        return
    from bimetal.plan.sbatch import islands
    from bimetal.plan.spec import load_spec
    from bimetal.topology.slurm import check_allocation
    from bimetal.topology.vendor import detect_vendor

    vendor = detect_vendor(job.task.rank if job.task else None)
    check_allocation(islands(load_spec(cfg.parallel.cluster)), job, f"cluster spec {cfg.parallel.cluster}",
                     vendor=vendor)


def check_model(cfg: TrainConfig, tokenizer: bool = True) -> None:
    """Model, stage split and (``tokenizer``: its file is here) tokenizer, as every rank would check them."""
    from bimetal.models import flavour_args
    from bimetal.train.tokenizer import build_tokenizer

    args = flavour_args(cfg.model.family, cfg.model.flavour)
    cfg.stage_split(args.n_layers)
    if not tokenizer:
        return
    tok = build_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > args.vocab_size:
        raise UserError(f"tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} tokens but model "
                        f"{cfg.model.family}/{cfg.model.flavour} has only {args.vocab_size}; match them.")


def check_data(cfg: TrainConfig) -> None:
    """The data file: readable, long enough for one step of every replica, and token ids the model embeds."""
    from bimetal.models import flavour_args
    from bimetal.train.data import load_tokens
    from bimetal.train.tokenizer import build_tokenizer

    args = flavour_args(cfg.model.family, cfg.model.flavour)
    tokens = load_tokens(cfg.data.path, build_tokenizer(cfg.data.tokenizer), cfg.data.bin_dtype)
    dp = cfg.parallel.dp
    need = cfg.global_batch * cfg.data.seq_len + 1
    if len(tokens) < need:
        what = (f"a global batch of {cfg.global_batch}" if cfg.per_stage
                else f"{dp} replicas x batch {cfg.data.batch_size}")
        raise UserError(f"the data has {len(tokens)} tokens, too few for {what} x seq_len {cfg.data.seq_len}; use "
                        "more data or smaller data.seq_len/data.batch_size.")
    head = np.asarray(tokens[:_SAMPLE_TOKENS])
    if head.size and int(head.max()) >= args.vocab_size:
        where = Path(cfg.data.path) if cfg.data.path else "the shipped corpus"
        raise UserError(f"{where} holds token id {int(head.max())} but model {cfg.model.family}/"
                        f"{cfg.model.flavour} has {args.vocab_size} tokens; it is not a token file for this model "
                        "(check data.path and data.bin_dtype).")
