"""``bimetal bench train``: replicated vs sharded data parallel vs sharded with full activation checkpointing.

Trains the same job three ways with ``bimetal train`` on the simulated cluster (default: ``configs/demo.toml``,
pp=2 x dp=2 over ``nvidia:2,amd:2``): dp_shard=1 (replicated), dp_shard=dp (FSDP2), and FSDP2 with
``activation_checkpoint.mode=full``. Variants run one after the other in each round and rounds repeat, so
machine noise hits them alike; the median tokens/s over the steps after the first few of every run is
reported, with the parameter, gradient and optimizer bytes the trainer read from its tensors on each rank
(largest rank shown), and the ratios against the replicated run, side by side. Writes ``bench_train.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.outputs import check_folder

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 3


def _variants(dp: int) -> dict[str, list[str]]:
    return {
        "replicated": ["--parallel.dp_shard=1", "--activation_checkpoint.mode=none"],
        "sharded": [f"--parallel.dp_shard={dp}", "--activation_checkpoint.mode=none"],
        "sharded+ac": [f"--parallel.dp_shard={dp}", "--activation_checkpoint.mode=full"],
    }


def _run(args: argparse.Namespace, extra: list[str], run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bimetal.cli", "train", "--config", args.config, "--simulate", args.simulate,
           f"--training.steps={args.steps}", f"--data.seq_len={args.seq_len}", "--checkpoint.every=0",
           f"--checkpoint.folder={run_dir / 'ckpt'}", f"--metrics.run_dir={run_dir}", "--metrics.log_every=1000",
           *args.overrides, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"bimetal train {' '.join(extra)} failed (exit {r.returncode}): {tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    memory = [json.loads(p.read_text()) for p in sorted(run_dir.glob("memory-rank*.json"))]
    return {"tokens_per_s": [r["tokens_per_s"] for r in rows[WARMUP:]],
            "memory": {k: max(m[k] for m in memory) for k in ("params", "grads", "optim")}}


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="bimetal bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"), help="training config (pp=2 x dp=2)")
    p.add_argument("--simulate", default="nvidia:2,amd:2", help="simulated vendors, as for bimetal train")
    p.add_argument("--steps", type=int, default=30, help=f"steps per run (the first {WARMUP} are not timed)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    p.add_argument("--dp", type=int, default=2, help="the config's parallel.dp: the shard degree of the sharded runs")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, interleaved")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one training run may take")
    p.add_argument("--out", default="runs/bench_train", help="folder for bench_train.json")
    p.add_argument("overrides", nargs="*", help="extra --section.key=value overrides for every run")
    args = p.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1:
        raise UserError(f"--steps must exceed {WARMUP} and --rounds be at least 1.")
    check_folder("--out", args.out)
    variants = _variants(args.dp)
    results: dict[str, dict[str, Any]] = {name: {"tokens_per_s": []} for name in variants}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        for rnd in range(args.rounds):
            for name, extra in variants.items():
                got = _run(args, extra, Path(tmp) / f"{name}-{rnd}")
                results[name]["tokens_per_s"] += got["tokens_per_s"]
                results[name]["memory"] = got["memory"]
                print(f"round {rnd + 1}/{args.rounds} {name}: {statistics.median(got['tokens_per_s']):.0f} tokens/s",
                      flush=True)
    base = results["replicated"]
    base_tps = statistics.median(base["tokens_per_s"])
    print(f"\npp x dp on {args.simulate}, seq {args.seq_len}, {args.steps} steps x {args.rounds} rounds "
          "(median tokens/s; bytes on the largest rank)")
    print(f"{'variant':<12} {'tokens/s':>9} {'ratio':>6} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} "
          f"{'optim ratio':>11}")
    for name, res in results.items():
        tps = statistics.median(res["tokens_per_s"])
        mem = res["memory"]
        res.update(median_tokens_per_s=tps, tokens_per_s_ratio=tps / base_tps,
                   optim_ratio=mem["optim"] / base["memory"]["optim"])
        print(f"{name:<12} {tps:>9.0f} {tps / base_tps:>6.2f} {mem['params'] / 2**20:>10.2f} "
              f"{mem['grads'] / 2**20:>9.2f} {mem['optim'] / 2**20:>9.2f} {res['optim_ratio']:>11.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0
