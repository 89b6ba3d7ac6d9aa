"""From the command line of ``bimetal train`` to a job that can start: the one path the run and the dry-run share.

``prepare`` reads the options and the environment, loads the config, applies the layout ``--simulate`` chooses
when the command line gives none, and runs every check that needs no process group: options that need another,
the environment (a GPU asked for and absent), the layout against the simulated world, the stage split, tp
against the model, the transports, the model and tokenizer, the data, every output folder (run folder,
checkpoint folder, export folder: ``bimetal.outputs``; an export folder that holds or lies in the run's folders)
and the checkpoint folder (``bimetal.train.ckpt_files``): on a resume the checkpoint against the config, read as
the ranks read it, and a refusal where none is usable; otherwise a refusal where checkpoints already are.
``bimetal train`` then starts the ranks or trains; ``--dry-run`` prints its memory report of the same config.
So no command passes the dry-run and is refused by the run before a rank starts, or the other way round.

One difference is by design: a dry-run without ``--simulate`` of a layout of several ranks describes a torchrun
job, whose ranks run elsewhere. It checks everything above but the files those ranks read and write on their
nodes (data, tokenizer file, output folders, the checkpoint of a resume); each rank checks those at its start,
before step 1 (the same ``check_outputs``). A refusal that names a key set in the ``--config`` file names the
file too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field

from bimetal.config import TrainConfig, blame_file, load_config, parse_overrides, parse_value
from bimetal.env import check_environment, check_needs, unknown_warning
from bimetal.errors import UserError
from bimetal.outputs import check_folder
from bimetal.supervisor import REPORT_ENV
from bimetal.topology.vendor import is_simulated, parse_simulate
from bimetal.train.preflight import (
    check_data,
    check_layout,
    check_model,
    check_world,
    choose_layout,
    describe_layout,
)
from bimetal.transports import TRANSPORTS

_log = logging.getLogger(__name__)


@dataclass
class Job:
    """A training command that passed every check before ranks: its config and where its ranks run."""

    cfg: TrainConfig
    vendors: list[str] = field(default_factory=list)
    """Vendor of each simulated rank (``--simulate``); empty without it."""
    auto: list[str] = field(default_factory=list)
    """The layout overrides chosen from ``--simulate`` (empty when the command line or the config gives one)."""
    note: str = ""
    """The sentence that says which layout was chosen, printed when the job starts."""
    local: bool = True
    """Its ranks run on this machine (or it is one rank): the files they read and write were checked here."""
    device_type: str = "cuda"
    """What its ranks compute on: ``cpu`` or ``cuda`` (``ranks_device_type``)."""
    keep: frozenset[str] = frozenset()
    """With ``parallel.layout = "auto"``: the layout keys the ranks' pick keeps (``config.auto_layout``)."""


def ranks_device_type(simulate: str | None, local: bool) -> str:
    """What the ranks of a job compute on: a simulated job's (the CPU, or GPU 0 with
    ``BIMETAL_SIMULATE_DEVICE=cuda``) or this machine's for one process here, by the trainer's own rule
    (``bimetal.topology.local_device.rank_device``); a GPU for a torchrun job whose ranks run elsewhere."""
    if not local:
        return "cuda"
    from bimetal.topology.local_device import rank_device
    from bimetal.topology.vendor import SIMULATE_ENV

    return rank_device({**os.environ, **({SIMULATE_ENV: simulate} if simulate else {})}).type


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``bimetal train`` besides the ``--section.key=value`` overrides."""
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--simulate", help="simulate vendors on this machine, e.g. nvidia:2,amd:2")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--resume-changed", action="store_true",
                        help="with --resume: accept a config that changes what the checkpoint's loss trajectory "
                             "depends on (each change is logged); without it such a resume is refused")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --simulate: restart the ranks this often after a failure; they resume by themselves")
    parser.add_argument("--dry-run", action="store_true",
                        help="start nothing: run every check of the run, print each stage's memory per GPU against "
                             "its device and exit")
    parser.add_argument("--json", action="store_true", help="with --dry-run: the report as JSON")


def _check_options(ns: argparse.Namespace, in_rank: bool) -> None:
    if ns.json and not ns.dry_run:
        raise UserError("--json formats the --dry-run report; add --dry-run or drop --json.")
    if ns.max_restarts < 0:
        raise UserError(f"--max-restarts={ns.max_restarts} must be zero or more.")
    if ns.max_restarts and not ns.simulate and not in_rank:
        raise UserError("--max-restarts needs --simulate (under torchrun, give torchrun's own --max-restarts).")


def _check_transports(cfg: TrainConfig) -> None:
    """Refuse a transport this build lacks before any rank starts (else every rank dies in group creation)."""
    for key in ("pp_transport", "dp_transport"):
        name = getattr(cfg.parallel, key)
        module = TRANSPORTS[name].module if name in TRANSPORTS else None
        if module is None:
            continue
        try:
            ok = hasattr(importlib.import_module(module), "create_process_group")
        except ImportError:
            ok = False
        if not ok:
            raise UserError(f"parallel.{key}={name!r} is not available in this build ({module} is missing); "
                            f"choose another transport, e.g. --parallel.{key}=gloo.")


def _check_tp_divides_model(cfg: TrainConfig) -> None:
    """Refuse a ``parallel.tp`` that does not divide the model's heads, kv heads, MLP width or vocabulary."""
    tps = dict.fromkeys(tp for tp, _, _ in cfg.stage_shapes())
    if max(tps) > 1:  # the model's shapes must split by tp; refused here rather than on every rank
        from bimetal.models import flavour_args
        from bimetal.train.tp import check_tp

        m = cfg.model
        for s, tp in enumerate(tp for tp, _, _ in cfg.stage_shapes()):
            try:
                check_tp(flavour_args(m.family, m.flavour), tp, f"{m.family}/{m.flavour}")
            except UserError as exc:
                if not cfg.per_stage:
                    raise
                named = str(exc).replace(f"parallel.tp={tp}", f"parallel.tp_per_stage[{s}]={tp}", 1)
                raise UserError(f"stage {s}: {named}") from None


def _auto_layout(ns: argparse.Namespace, overrides: list[str], vendors: list[str]) -> tuple[list[str], str]:
    """With no config and no layout on the command line: the layout from the simulated world (chosen before
    ``parallel.layers_per_stage`` is checked against it), and the sentence saying so."""
    given = parse_overrides(overrides)
    if ns.config or {"parallel.pp", "parallel.dp", "parallel.tp", "parallel.tp_per_stage", "parallel.dp_per_stage",
                     "parallel.dp_shard_per_stage", "parallel.layout"} & set(given):
        return [], ""
    from bimetal.models import flavour_args

    split_text = given.pop("parallel.layers_per_stage", None)
    m = load_config(None, given).model
    pp, dp = choose_layout(vendors, flavour_args(m.family, m.flavour).n_layers)
    split = parse_value("parallel.layers_per_stage", split_text) if split_text is not None else []
    if split and len(split) != pp:
        raise UserError(f"parallel.layers_per_stage={split} has {len(split)} entries but the layout chosen from the "
                        f"{len(vendors)} simulated ranks has pp={pp} stages; give one count per stage, or choose "
                        "the layout with --parallel.pp and --parallel.dp.")
    chosen = [f"--parallel.pp={pp}", f"--parallel.dp={dp}"]
    note = (f"bimetal train: no --config; layout chosen from the {len(vendors)} simulated ranks: pp={pp} x dp={dp} "
            f"({'stages of one vendor each' if pp > 1 else 'data parallel only'}; {' '.join(chosen)})")
    return chosen, note


def check_start(cfg: TrainConfig, continues: bool) -> None:
    """The start check of a rank under an agent (torchrun's, or bimetal's launcher), made by the trainer once its
    round's world is formed: a round that neither ``continues`` its job (``Job.continues``, the one "same job"
    decision, which also makes the round resume) nor says ``--resume`` is a start, refused where checkpoints are.
    A user's second job on the same folders has agents of its own and is refused in every round; so is every
    round of a job whose start was refused (it wrote no record)."""
    if not cfg.checkpoint.resume and not continues:
        from bimetal.train.ckpt_files import check_fresh

        check_fresh(checkpoint_folder(cfg), _checkpoint_key(cfg))


def checkpoint_folder(cfg: TrainConfig) -> str:
    """Where the run's checkpoints go: ``checkpoint.folder``, else ``<run_dir>/checkpoints``."""
    return cfg.checkpoint.folder or os.path.join(cfg.metrics.run_dir, "checkpoints")


def _checkpoint_key(cfg: TrainConfig) -> str:
    return "checkpoint.folder" if cfg.checkpoint.folder else "checkpoint.folder (default <run_dir>/checkpoints)"


def _check_export_place(cfg: TrainConfig) -> None:
    """Refuse an export folder that is, holds or lies in a folder the run works in: the export replaces its folder
    whole (``bimetal.models.hf_write``), which would take the run's records or checkpoints with it."""
    def real(path: str) -> str:
        return os.path.realpath(os.path.expanduser(path))

    export = real(cfg.checkpoint.export_hf)
    # A folder under the working directory is where exports usually go; the directory itself is not.
    places = [(f"the working directory {os.getcwd()}", os.getcwd(), False),
              (f"metrics.run_dir={cfg.metrics.run_dir!r}", cfg.metrics.run_dir, True),
              (f"{_checkpoint_key(cfg)}={checkpoint_folder(cfg)!r}", checkpoint_folder(cfg), True)]
    for shown, folder, inside_too in places:
        where = real(folder)
        if export == where:
            how = f"is {shown}"
        elif where.startswith(export.rstrip(os.sep) + os.sep):
            how = f"holds {shown}"
        elif inside_too and export.startswith(where.rstrip(os.sep) + os.sep):
            how = f"lies inside {shown}"
        else:
            continue
        raise UserError(f"checkpoint.export_hf={cfg.checkpoint.export_hf!r} {how}; an export replaces its folder "
                        "whole, which would take what the run writes there with it: export to a folder of its own, "
                        "outside the run's folders.")


def check_outputs(cfg: TrainConfig) -> None:
    """Every folder the run writes can be created and written (and the export folder holds no other weights and
    none of the run's folders); run before any rank starts and again by each rank, before step 1. Writes
    nothing."""
    from bimetal.models.hf_write import check_export

    if not cfg.metrics.run_dir.strip():
        raise UserError("metrics.run_dir is empty; give the folder the run writes its metrics to.")
    check_folder("metrics.run_dir", cfg.metrics.run_dir)
    check_folder(_checkpoint_key(cfg), checkpoint_folder(cfg))
    if cfg.checkpoint.export_hf:
        _check_export_place(cfg)
        check_export("checkpoint.export_hf", cfg.checkpoint.export_hf)


def check_checkpoints(cfg: TrainConfig) -> None:
    """What the checkpoint folder holds against what the run will do with it. A run that is not a resume: no
    checkpoints there (its saves would replace them). A resume: the newest usable checkpoint, read as the ranks
    read it (``ckpt_files.scan``, here every file against its checksum) and checked against the config (the model;
    the layout for a checkpoint written before global keys, any layout being fine for one keyed by global names;
    the settings its trajectory depends on unless ``checkpoint.resume_changed``); where the folder holds
    checkpoints but none is usable, refused, naming each and why. The ranks read the folder again (and log a
    move to a new layout)."""
    from bimetal.train.ckpt_files import check_fresh, check_meta, run_meta, scan

    folder = checkpoint_folder(cfg)
    if not cfg.checkpoint.resume:
        check_fresh(folder, _checkpoint_key(cfg))
        return
    found = scan(folder, verify=True)
    refusal = found.refusal()
    if refusal is not None:
        raise UserError(refusal)
    if found.found is not None:
        from bimetal.models import flavour_args

        layers = flavour_args(cfg.model.family, cfg.model.flavour).n_layers
        check_meta(found.found, run_meta(cfg, cfg.stage_split(layers)), cfg.checkpoint.resume_changed)


def prepare(ns: argparse.Namespace, rest: list[str]) -> Job:
    """The job of this command line, every check before ranks passed; ``UserError`` (one sentence) otherwise."""
    in_rank = "RANK" in os.environ
    _check_options(ns, in_rank)
    unknown = check_environment()
    if unknown and (not in_rank or (os.environ.get("RANK") == "0" and REPORT_ENV not in os.environ)):
        _log.warning("bimetal train: warning: %s", unknown_warning(unknown))
    vendors = parse_simulate(ns.simulate) if ns.simulate else []  # SimulationSpecError: one sentence
    check_needs(simulated=bool(vendors) or is_simulated())
    overrides = list(rest) + (["--checkpoint.resume=true"] if ns.resume else []) + \
        (["--checkpoint.resume_changed=true"] if ns.resume_changed else [])
    try:
        auto, note = _auto_layout(ns, overrides, vendors) if vendors and not in_rank else ([], "")
        notes: list[str] = []  # a per-stage list on the command line over the file's uniform key, said once
        keep: set[str] = set()
        cfg = load_config(ns.config, overrides + auto, notes, keep)  # names the file for a bad value set there
        if not in_rank or (os.environ.get("RANK") == "0" and REPORT_ENV not in os.environ):  # said once per job
            note = "\n".join([note] * bool(note) + [f"bimetal train: {n}." for n in notes])
        if cfg.parallel.layout == "auto" and not in_rank:  # the pick the ranks will make, checked as theirs
            cfg, said = _pick_here(ns, cfg, vendors, frozenset(keep))
            note = "\n".join([note] * bool(note) + [said] * bool(said))
        job = _checked(ns, cfg, vendors, in_rank, auto, note)
        job.keep = frozenset(keep)
        return job
    except UserError as exc:
        raise blame_file(exc, ns.config, overrides) from None


def _pick_here(ns: argparse.Namespace, cfg: TrainConfig, vendors: list[str],
               keep: frozenset[str]) -> tuple[TrainConfig, str]:
    """The layout ``parallel.layout = "auto"`` picks, as far as this process can see the ranks' world: the ranks
    of ``--simulate``, this one process, or (a dry-run of a torchrun job) the GPUs of ``parallel.cluster``. The
    ranks pick again for the world they find; the line is shown here by a dry-run only (rank 0 logs it)."""
    from bimetal.plan.auto_layout import World, pick_layout

    if vendors:
        world = World.simulated(vendors)
    elif ns.dry_run and cfg.parallel.cluster:
        world = World.from_spec(cfg.parallel.cluster)
    elif ns.dry_run:
        raise UserError("parallel.layout='auto' is picked for the ranks the job finds, which a dry-run without "
                        "--simulate cannot see; add --simulate (e.g. --simulate nvidia:2,amd:2) or "
                        "parallel.cluster (a cluster spec) to check the layout the ranks would pick.")
    else:
        from bimetal.topology.vendor import detect_vendor

        world = World.simulated([detect_vendor(0)])
    pick = pick_layout(cfg, world, keep)
    return pick.cfg, pick.line if ns.dry_run else ""


def _checked(ns: argparse.Namespace, cfg: TrainConfig, vendors: list[str], in_rank: bool, auto: list[str],
             note: str) -> Job:
    world = cfg.world_size
    if cfg.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("metrics.tensorboard=true needs the tensorboard package, which is not installed; "
                        "pip install tensorboard, or drop the setting.")
    _check_tp_divides_model(cfg)
    if world > 1:
        _check_transports(cfg)
    if in_rank:
        if cfg.parallel.layout != "auto":  # else the ranks pick the layout for the world they have
            check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        check_outputs(cfg)  # this rank's view of the folders (another node's disks under torchrun)
        # Whether this is a start, refused where checkpoints are, is decided with the round's world (a restarted
        # round of a started job resumes, and which job it is depends on every rank's agent): check_start.
        return Job(cfg, vendors, note=note)  # rank 0 of a torchrun job says the notes (none under bimetal's launcher)
    check_model(cfg, tokenizer=False)  # the model and its stage split: the config alone
    if vendors:
        check_layout(cfg, vendors)
    elif world > 1 and not ns.dry_run:
        raise UserError(f"{describe_layout(cfg)} needs {world} ranks but this is one "
                        "process outside torchrun (world size 1); add --simulate (e.g. --simulate nvidia:2,amd:2) or "
                        "start it with torchrun.")
    local = bool(vendors) or world == 1
    if local:
        check_model(cfg)  # and the tokenizer file, read here
    if cfg.parallel.cluster:  # what the dry-run sizes against; a spec that does not fit is wrong for the run too
        from bimetal.train.dryrun import stage_devices

        stage_devices(cfg)
    if local:  # the ranks run here: what they read and write is checked here
        check_data(cfg)
        check_outputs(cfg)
        check_checkpoints(cfg)
    return Job(cfg, vendors, auto, note, local, ranks_device_type(ns.simulate, local))
