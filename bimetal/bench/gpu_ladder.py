"""``bimetal bench gpu-ladder``: one model trained on one GPU five ways, side by side, in interleaved rounds.

    (a) one process, the whole model: the one-vendor reference;
    (b) pp=2 over two processes sharing the GPU, boundary on ``bimetal_ideal``: the schedule's order and
        blocking kept, no activation byte moved (what a perfect link gives; NCCL refuses two ranks on one GPU);
    (c) pp=2 with the boundary on cpu-forward; (d) on device-direct (Mooncake over TCP here);
    (e) pp=2 on ``bimetal_host_copy``: copy to host, stock Gloo, copy back (the compatibility baseline).

Default model: Llama-3.2-1B's shape, untied (``llama3.2-1b-untied``, 1.50B parameters), bf16 autocast, seq
2048, 16 microbatches of one sequence: the boundary moves 16 MiB per microbatch each way (float32 activations
forward, their gradients back), 512 MiB per step. Rounds run a b c d e, a b c d e, ...; every run starts
from the same weights on the same batches and times ``--steps`` steps after ``--warmup``. The table: tokens/s
(per round and their median), exposed communication per step (the step time beyond (b)'s: what the boundary
costs over a perfect link), boundary bytes per step (what the schedule hands the group, and what the group put
on the wire), final loss; the ratios (b)/(a), (c)/(b), (d)/(b), (e)/(b), (c)/(e); the planner's prediction of
(c)/(b) from the link measured in the same run; per rank the dry-run's memory against the measured peak.
``--profile`` adds a profiled run of (c) and (d) per rank (``bimetal.bench.thread_profile``). Writes
``gpu_ladder.json`` and ``gpu_ladder.md`` to ``--out``; ``--cpu`` runs the same code on a tiny model on the
CPU (every configuration; ratios printed, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.bench.gpu_ladder_report import CONFIGS, build, markdown
from bimetal.bench.steps import Stopped, run_step
from bimetal.errors import UserError
from bimetal.outputs import check_folder

GPU: dict[str, Any] = {"flavour": "llama3.2-1b-untied", "seq": 2048, "mb_size": 1, "microbatches": 16, "warmup": 2,
                       "steps": 4, "rounds": 3, "lr": 3e-4, "dtype": "bfloat16", "threads": 4, "timeout_s": 300,
                       "group_timeout_s": 120}
CPU: dict[str, Any] = {"flavour": "debug", "seq": 64, "mb_size": 2, "microbatches": 4, "warmup": 1, "steps": 2,
                       "rounds": 1, "lr": 1e-3, "dtype": "float32", "threads": 1, "timeout_s": 120,
                       "group_timeout_s": 60}


def _env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        env.pop(key, None)
    if cpu:
        env["BIMETAL_CF_FORCE_STAGING"] = "1"  # cpu-forward takes its staged path, as with device tensors
    else:
        env["BIMETAL_SIMULATE_DEVICE"] = "cuda"
    return env


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings (``settings.json``, read by both ranks): the mode's defaults, then the options given."""
    s = dict(CPU if args.cpu else GPU)
    for key in ("flavour", "seq", "mb_size", "microbatches", "warmup", "steps", "rounds", "lr"):
        value = getattr(args, key)
        if value is not None:
            s[key] = value
    for key in ("seq", "mb_size", "microbatches", "steps", "rounds"):
        if s[key] < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, not {s[key]}.")
    if s["warmup"] < 0 or s["lr"] <= 0:
        raise UserError(f"--warmup must be 0 or more and --lr positive (got {s['warmup']} and {s['lr']}).")
    from bimetal.models import FLAVOURS

    if s["flavour"] not in FLAVOURS["llama3"]:
        known = ", ".join(FLAVOURS["llama3"])
        raise UserError(f"--flavour {s['flavour']!r} is not a LLaMA-3 flavour; use one of {known}.")
    layers = FLAVOURS["llama3"][s["flavour"]].n_layers
    if layers < 2:
        raise UserError(f"flavour {s['flavour']} has {layers} layer; pp=2 needs at least 2.")
    configs = "".join(c for c in CONFIGS if c in args.configs)
    if set(args.configs) - set(CONFIGS) or not configs:
        raise UserError(f"--configs {args.configs!r}: give letters from {CONFIGS} (e.g. abcde or abc).")
    profile = "".join(c for c in args.profile if c in configs) if args.profile else ""
    if args.profile and (set(args.profile) - set(CONFIGS[1:])):
        raise UserError(f"--profile {args.profile!r}: give pipelined configurations from bcde (e.g. cd).")
    s.update(device="cpu" if args.cpu else "cuda", split=[layers // 2, layers - layers // 2], configs=configs,
             profile=profile, seed=1234)
    return s


def launch(out: Path, s: dict[str, Any], cpu: bool, timeout: float) -> str | None:
    """Run both ranks; None when they exited 0, else why not in a few words (a hang is killed at ``timeout``)."""
    path = out / "settings.json"
    path.write_text(json.dumps(s, indent=1))
    cmd = [sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "nvidia:1,amd:1", "--",
           "-m", "bimetal.bench.gpu_ladder_rank", str(path)]
    try:
        rc = run_step(cmd, out / "ladder.log", timeout, env=_env(cpu))  # a hang: ended with every rank's process
    except Stopped as exc:  # a timeout around the whole run: the ranks are ended, the rows they wrote kept
        return f"{exc} while the ranks ran (output: {out / 'ladder.log'})"
    if rc is None:
        return f"the ranks did not finish within {timeout:.0f} s (output: {out / 'ladder.log'})"
    if rc == 0:
        return None
    lines = [ln for ln in (out / "ladder.log").read_text(errors="replace").splitlines() if ln.strip()]
    return f"the ranks exited with status {rc}: {lines[-1][:240] if lines else 'no output'} (output: ladder.log)"


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="bimetal bench gpu-ladder", description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny model on the CPU, same code (CI)")
    p.add_argument("--out", default="runs/gpu-ladder", help="folder for gpu_ladder.json/.md and the logs")
    p.add_argument("--configs", default=CONFIGS, help="which configurations (default abcde; (b) is the reference "
                                                      "of the transport ratios)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (GPU 3, CPU 1)")
    p.add_argument("--steps", type=int, help="timed steps per run (GPU 4, CPU 2)")
    p.add_argument("--warmup", type=int, help="untimed steps before them in every run (GPU 2, CPU 1)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (GPU 16, CPU 4)")
    p.add_argument("--mb-size", dest="mb_size", type=int, help="sequences per microbatch (GPU 1, CPU 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (GPU 2048, CPU 64)")
    p.add_argument("--flavour", help="LLaMA-3 flavour (GPU llama3.2-1b-untied, CPU debug)")
    p.add_argument("--lr", type=float, help="AdamW learning rate, constant (GPU 3e-4, CPU 1e-3)")
    p.add_argument("--profile", nargs="?", const="cd", default="",
                   help="one more run of these configurations per rank with the thread profile (default cd)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="seconds before the ranks are killed (default 330 on a GPU, 150 on the CPU)")
    args = p.parse_args(argv)
    s = settings(args)
    if args.timeout < 0:
        raise UserError(f"--timeout must be positive, not {args.timeout:g}")
    timeout = args.timeout or (150.0 if args.cpu else 330.0)
    check_folder("--out", args.out)  # before the minutes of the ladder
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise UserError("no GPU visible to torch; run with --cpu for the CPU version")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    t0 = time.monotonic()
    failed = launch(out, s, args.cpu, timeout)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    report = build(s, ranks, failed, time.monotonic() - t0)
    text = markdown(report)
    (out / "gpu_ladder.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_ladder.md").write_text(text + "\n")
    print(text)
    print(f"(JSON: {out / 'gpu_ladder.json'}; log: {out / 'ladder.log'})")
    return 0 if report["ok"] else 1
