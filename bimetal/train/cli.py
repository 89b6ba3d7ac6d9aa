"""``bimetal train``: load the config, relaunch as ranks under ``--simulate``, run the loop."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bimetal.errors import UserError
from bimetal.train.config import TrainConfig, load_config
from bimetal.train.metrics import format_summary

_TRANSPORT_MODULES = {"cpu-forward": "bimetal.comm.cpu_forward", "device-direct": "bimetal.comm.device_direct"}


def _check_transports(cfg: TrainConfig) -> None:
    """Refuse a transport this build lacks before any rank starts (else every rank dies in group creation)."""
    for key in ("pp_transport", "dp_transport"):
        name = getattr(cfg.parallel, key)
        module = _TRANSPORT_MODULES.get(name)
        if module is None:
            continue
        try:
            ok = hasattr(importlib.import_module(module), "create_process_group")
        except ImportError:
            ok = False
        if not ok:
            raise UserError(f"parallel.{key}={name!r} is not available in this build ({module} is missing); "
                            f"choose another transport, e.g. --parallel.{key}=gloo.")


def _check_implemented(cfg: TrainConfig) -> None:
    """Refuse layout keys this build of the trainer does not run yet, before any rank starts."""
    p = cfg.parallel
    if p.tp > 1:
        raise UserError(f"parallel.tp={p.tp}: this build of the trainer runs only tp=1; set --parallel.tp=1.")
    if p.tp > 1 and p.dp_shard > 1:
        raise UserError(f"parallel.dp_shard={p.dp_shard} with parallel.tp={p.tp}: the trainer does not shard "
                        "tensor-parallel stages yet; set --parallel.dp_shard=1 or --parallel.tp=1.")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bimetal train", description="Train across vendors.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--simulate", help="simulate vendors on this machine, e.g. nvidia:2,amd:2")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --simulate: restart the ranks this often after a failure; they resume by themselves")
    ns, rest = parser.parse_known_args(argv)
    overrides = list(rest) + (["--checkpoint.resume=true"] if ns.resume else [])
    cfg = load_config(ns.config, overrides)  # UserError -> one sentence, exit 2 (bimetal.cli)
    _check_implemented(cfg)
    if cfg.parallel.pp * cfg.parallel.dp > 1:
        _check_transports(cfg)
    if ns.simulate and "RANK" not in os.environ:
        from bimetal.launch import launch

        n = sum(int(part.split(":")[1]) for part in ns.simulate.split(","))
        return launch(["-m", "bimetal.train", *argv], simulate=ns.simulate, nproc_per_node=n,
                      max_restarts=ns.max_restarts)
    from bimetal.train.trainer import train

    summary = train(cfg)
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
