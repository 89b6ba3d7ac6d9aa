"""``bimetal train``: load the config, relaunch as ranks under ``--simulate``, run the loop."""

from __future__ import annotations

import argparse
import os
import sys

from bimetal.train.config import load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bimetal train", description="Train across vendors.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--simulate", help="simulate vendors on this machine, e.g. nvidia:2,amd:2")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    ns, rest = parser.parse_known_args(argv)
    overrides = list(rest) + (["--checkpoint.resume=true"] if ns.resume else [])
    cfg = load_config(ns.config, overrides)  # UserError -> one sentence, exit 2 (bimetal.cli)
    if ns.simulate and "RANK" not in os.environ:
        from bimetal.launch import launch

        n = sum(int(part.split(":")[1]) for part in ns.simulate.split(","))
        return launch(["-m", "bimetal.train", *argv], simulate=ns.simulate, nproc_per_node=n)
    from bimetal.train.trainer import train

    summary = train(cfg)
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
