"""``bimetal train``: load and check the config, relaunch as ranks under ``--simulate``, run the loop.

Outside a rank every check that needs no process group runs first (environment, config, layout against the
simulated world, model and data: ``bimetal.train.preflight``), so a mistake is one sentence before any rank
starts. Inside a rank (``RANK`` set, by torchrun or bimetal's launcher; or a task of an srun step, whose Slurm
variables become torchrun's, see ``bimetal.topology.slurm``) only the cheap ones run again, plus, under srun, the
allocation against the cluster spec.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from bimetal.config import TrainConfig, load_config, parse_overrides
from bimetal.env import check_environment, unknown_warning
from bimetal.errors import UserError
from bimetal.log import rank_logging
from bimetal.supervisor import REPORT_ENV
from bimetal.topology import slurm
from bimetal.topology.vendor import parse_simulate
from bimetal.train.metrics import format_summary
from bimetal.train.preflight import check_data, check_layout, check_model, check_slurm, check_world
from bimetal.transports import TRANSPORTS

_log = logging.getLogger(__name__)


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
    p = cfg.parallel
    if p.tp > 1:  # the model's shapes must split by tp; refused here rather than on every rank
        from bimetal.train.tp import check_tp
        from bimetal.train.trainer import _model_args

        check_tp(_model_args(cfg), p.tp, f"{cfg.model.family}/{cfg.model.flavour}")


def _auto_layout(ns: argparse.Namespace, cfg: TrainConfig, rest: list[str], vendors: list[str]) -> list[str]:
    """With no config and no layout on the command line: the layout from the world, printed; its overrides."""
    if ns.config or {"parallel.pp", "parallel.dp", "parallel.tp"} & set(parse_overrides(rest)):
        return []
    from bimetal.train.preflight import choose_layout
    from bimetal.train.trainer import _model_args

    pp, dp = choose_layout(vendors, _model_args(cfg).n_layers)
    chosen = [f"--parallel.pp={pp}", f"--parallel.dp={dp}"]
    print(f"bimetal train: no --config; layout chosen from the {len(vendors)} simulated ranks: pp={pp} x dp={dp} "
          f"({'stages of one vendor each' if pp > 1 else 'data parallel only'}; {' '.join(chosen)})", flush=True)
    return chosen


def main(argv: list[str]) -> int:
    from bimetal.train.keys import format_keys

    parser = argparse.ArgumentParser(prog="bimetal train", description="Train across vendors.",
                                     epilog=format_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--simulate", help="simulate vendors on this machine, e.g. nvidia:2,amd:2")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --simulate: restart the ranks this often after a failure; they resume by themselves")
    parser.add_argument("--dry-run", action="store_true",
                        help="start nothing: print each stage's memory per GPU against its device and exit")
    parser.add_argument("--json", action="store_true", help="with --dry-run: the report as JSON")
    ns, rest = parser.parse_known_args(argv)
    # A task of an srun step is a rank: Slurm's variables become torchrun's (not under --simulate, which starts
    # its own ranks, nor under torchrun, which set RANK already).
    slurm_job = None if ns.simulate else slurm.adopt()
    unknown = check_environment()
    in_rank = "RANK" in os.environ
    if unknown and (not in_rank or (os.environ.get("RANK") == "0" and REPORT_ENV not in os.environ)):
        _log.warning("bimetal train: warning: %s", unknown_warning(unknown))
    vendors = parse_simulate(ns.simulate) if ns.simulate else []  # SimulationSpecError: one sentence
    if ns.max_restarts < 0:
        raise UserError(f"--max-restarts={ns.max_restarts} must be zero or more.")
    overrides = list(rest) + (["--checkpoint.resume=true"] if ns.resume else [])
    cfg = load_config(ns.config, overrides)  # UserError -> one sentence, exit 2 (bimetal.cli)
    if ns.dry_run:
        from bimetal.train.dryrun import dry_run

        return dry_run(cfg, ns.json)
    auto = _auto_layout(ns, cfg, rest, vendors) if vendors and not in_rank else []
    if auto:
        cfg = load_config(ns.config, overrides + auto)
    _check_tp_divides_model(cfg)
    if cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp > 1:
        _check_transports(cfg)
    if in_rank:
        if slurm_job is not None:
            check_slurm(cfg, slurm_job)
        check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        rank_logging(int(os.environ["RANK"]))
    else:
        check_model(cfg)
        if vendors:
            check_layout(cfg, vendors)
            check_data(cfg)  # else every rank would find the same mistake (a single process: train does)
        elif cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp > 1:
            p = cfg.parallel
            raise UserError(f"the layout parallel.pp={p.pp} x parallel.dp={p.dp} needs {p.pp * p.dp * p.tp} ranks but "
                            "this is one process outside torchrun (world size 1); add --simulate (e.g. --simulate "
                            "nvidia:2,amd:2) or start it with torchrun.")
        if ns.max_restarts and not vendors:
            raise UserError("--max-restarts needs --simulate (under torchrun, give torchrun's own --max-restarts).")
    if vendors and not in_rank:
        from bimetal.launch import launch

        return launch(["-m", "bimetal.train", *argv, *auto], simulate=ns.simulate, nproc_per_node=len(vendors),
                      max_restarts=ns.max_restarts, name="bimetal train")
    from bimetal.train.trainer import train

    summary = train(cfg)
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
