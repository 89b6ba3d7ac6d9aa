"""The GPU check: is cpu-forward's GPU path right and fast, on one machine with one GPU (NVIDIA or AMD).

``scripts/gpu_check.sh [--cpu] [--out DIR] [--timeout S]`` (or ``make gpu-check``) launches two processes sharing
the GPU, one simulated as each vendor (``bimetal launch --simulate nvidia:1,amd:1``), runs ``gpu_check_rank.py`` (every
collective and point-to-point on device tensors against Gloo, bandwidth, overlap, pool allocations, traffic both
ways at once, device-direct over Mooncake TCP at 4 MiB and at 64 MiB, its large-message path, and both ways),
then the demo trainer for 50 steps in bf16 on the GPU, then the parity rows: FSDP with activation checkpointing,
HSDP, tensor parallelism and the hierarchical all-reduce, each trained on the GPU by simulated ranks whose
native groups run cpu-forward's staged path (``BIMETAL_SIMULATE_DEVICE=cuda``), each step's loss held against
one process training the same global batch. Prints one table and writes it as ``DIR/gpu_check.json``, each
step's output beside it (``transport.log``, ``train.log``, ``parity-<name>.log``). Exit status 0 when every
judged row passes, 1 otherwise.

``--cpu``: the same code with CPU tensors and ``BIMETAL_CF_FORCE_STAGING=1`` (the staged paths, with the CPU
copy double), small sizes and short training runs in float32, so that CI runs it end to end without a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bimetal.args import ArgumentParser
from bimetal.entry import run_command
from bimetal.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _env(cpu: bool, simulated: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE",
                "BIMETAL_SIMULATE_DEVICE"):
        env.pop(key, None)
    if cpu:
        env["BIMETAL_CF_FORCE_STAGING"] = "1"
    # Simulated vendors train on the one GPU (local_device.rank_device) and their native groups take cpu-forward's
    # staged path (comm.registry.staged_native); without a GPU, `cpu-staged` runs that path on CPU tensors. The
    # one-process reference is not simulated: it takes the GPU (or the CPU) by itself, and the variable is refused.
    if simulated:
        env["BIMETAL_SIMULATE_DEVICE"] = "cpu-staged" if cpu else "cuda"
    return env


def step(args: list[str], cpu: bool, log: Path, timeout: float) -> str | None:
    """Run one step of the check in its own process group, its output (stdout and stderr) kept in ``log``.
    None when it exited 0; else why not, in a few words (a step that outlives ``timeout`` is killed with all
    its ranks and reported, so a hang is a failing row and the table still prints)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(args, env=_env(cpu, "--simulate" in args), stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:.0f} s (output: {log.name})"
    if rc == 0:
        return None
    last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    return f"exit status {rc}: {last[0][:200] if last else 'no output'} (output: {log.name})"


def transport_rows(out: Path, cpu: bool, timeout: float) -> list[dict]:
    sizes = ["4", "8", "8", "2"] if cpu else ["64", "256", "64", "16"]
    failed = step([sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "nvidia:1,amd:1", "--",
                   str(ROOT / "scripts" / "gpu_check_rank.py"), str(out), "cpu" if cpu else "cuda", *sizes],
                  cpu, out / "transport.log", timeout)
    files = sorted(out.glob("rank*.json"))
    if failed or len(files) != 2:
        return [{"check": "transport checks ran", "pass": False,
                 "value": failed or f"{len(files)} of 2 ranks wrote their rows"}]
    per_rank = [json.loads(f.read_text()) for f in files]
    rows = []
    for i, row in enumerate(per_rank[0]):
        others = [r[i] for r in per_rank]
        verdicts = [r["pass"] for r in others]
        passed = None if all(v is None for v in verdicts) else all(v is not False for v in verdicts)
        rows.append({"check": row["check"], "pass": passed, "value": " | ".join(r["value"] for r in others)})
    return rows


def trainer_row(out: Path, cpu: bool, timeout: float) -> dict:
    steps = 8 if cpu else 50
    run_dir = out / "train"
    args = [sys.executable, "-m", "bimetal.cli", "train", "--config", str(ROOT / "configs" / "demo.toml"),
            "--simulate", "nvidia:1,amd:1", "--parallel.dp=1", f"--training.steps={steps}",
            f"--training.dtype={'float32' if cpu else 'bfloat16'}", f"--metrics.run_dir={run_dir}",
            "--metrics.log_every=1", "--checkpoint.every=0", "--optim.warmup_steps=2", "--optim.lr=3e-3"]
    if cpu:
        args += ["--data.seq_len=32", "--data.batch_size=4"]
    failed = step(args, cpu, out / "train.log", timeout)
    name = f"demo trainer {steps} steps {'f32 on CPU' if cpu else 'bf16 on the GPU'}"
    summary = run_dir / "summary.json"
    if failed or not summary.exists():
        return {"check": name, "pass": False, "value": failed or "no summary.json"}
    s = json.loads(summary.read_text())
    return {"check": name, "pass": s["steps"] == steps and s["loss_end"] < s["loss_start"],
            "value": f"loss {s['loss_start']:.3f} -> {s['loss_end']:.3f} over {s['steps']} steps"}


PARITY_STEPS = {True: 3, False: 20}
PARITY_RTOL = {True: 1e-4, False: 2e-2}
"""Largest relative loss difference from one process at any step: float32 on the CPU; bf16 on the GPU (autocast,
FSDP's bf16 parameters)."""
SINGLE = ["--parallel.dp=1", "--data.batch_size=16", "--parallel.microbatches=8"]
PARITY = [  # (row, --simulate, layout): each the same global batch of 16 rows in microbatches of 2 as SINGLE
    ("FSDP dp_shard=2 + full activation checkpointing", "nvidia:2",
     ["--parallel.dp=2", "--parallel.dp_shard=2", "--activation_checkpoint.mode=full", "--data.batch_size=8",
      "--parallel.microbatches=4"]),
    ("HSDP replicate 2 x shard 2", "nvidia:4",
     ["--parallel.dp=4", "--parallel.dp_shard=2", "--data.batch_size=4", "--parallel.microbatches=2"]),
    ("tensor parallel tp=2", "nvidia:2", ["--parallel.dp=1", "--parallel.tp=2", "--data.batch_size=16",
                                          "--parallel.microbatches=8"]),
    ("hierarchical all-reduce dp=4 over 2 vendors", "nvidia:2,amd:2",
     ["--parallel.dp=4", "--parallel.allow_cross_vendor_dp=true", "--parallel.dp_transport=cpu-forward",
      "--data.batch_size=4", "--parallel.microbatches=2"]),
]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, filter(None, lines))}


def parity_rows(out: Path, cpu: bool, timeout: float) -> list[dict]:
    """One process, then each layout of ``PARITY`` on simulated ranks sharing the device; per row the largest
    relative loss difference over the steps, and whether the native groups ran on the staged path."""
    steps = PARITY_STEPS[cpu]
    common = [sys.executable, "-m", "bimetal.cli", "train", "--config", str(ROOT / "configs" / "demo.toml"),
              "--parallel.pp=1", "--parallel.layers_per_stage=[]", f"--training.steps={steps}",
              f"--training.dtype={'float32' if cpu else 'bfloat16'}", "--metrics.log_every=1", "--checkpoint.every=0",
              "--optim.warmup_steps=2", "--optim.lr=3e-3", *(["--data.seq_len=32"] if cpu else [])]
    single = out / "parity-single"
    failed = step([*common, *SINGLE, f"--metrics.run_dir={single}"], cpu, out / "parity-single.log", timeout)
    ref = _losses(single)
    if failed or len(ref) != steps:
        return [{"check": f"parity: {name}", "pass": False, "value": f"one-process reference: {failed or 'no losses'}"}
                for name, _, _ in PARITY]
    rows = []
    for i, (name, simulate, layout) in enumerate(PARITY):
        run = out / f"parity-{i}"
        log = out / f"parity-{i}.log"
        failed = step([*common, *layout, "--simulate", simulate, f"--metrics.run_dir={run}"], cpu, log, timeout)
        got = _losses(run)
        if failed or len(got) != steps:
            rows.append({"check": f"parity: {name}", "pass": False, "value": failed or f"{len(got)} of {steps} steps"})
            continue
        worst = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ref)
        staged = "bimetal_sim_native (staged: device tensors)" in log.read_text(errors="replace")
        path = "on the staged path" if staged else "NOT staged"
        rows.append({"check": f"parity: {name} ({simulate})", "pass": worst <= PARITY_RTOL[cpu] and staged,
                     "value": f"max |loss - one process| / loss over {steps} steps {worst:.1e} (tol "
                              f"{PARITY_RTOL[cpu]:g}); native groups {path}"})
    return rows


def markdown(report: dict) -> str:
    """The table as markdown, for the docs (``gpu_check.md``)."""
    mark = {True: "pass", False: "FAIL", None: "info"}
    out = [f"bimetal GPU check on {report['device']}, {report['date']}, {report['seconds']} s ({report['mode']} mode)",
           "", "| check | result | rank 0 (nvidia) / rank 1 (amd) |", "|---|---|---|"]
    out += [f"| {r['check']} | {mark[r['pass']]} | {r['value'].replace('|', '/')} |" for r in report["rows"]]
    return "\n".join(out) + "\n"


def table(rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows)
    mark = {True: "pass", False: "FAIL", None: "info"}
    return "\n".join(f"{r['check']:<{width}}  {mark[r['pass']]:<4}  {r['value']}" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, staging forced, small sizes (CI)")
    ap.add_argument("--out", default="", help="folder for gpu_check.json (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=220.0,
                    help="seconds each of the two steps may take before it is killed and reported (default 220)")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        raise UserError(f"--timeout must be positive, not {args.timeout:g}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bimetal-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if not args.cpu:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no GPU visible to torch; use --cpu for the CPU run", file=sys.stderr)
            return 2
        device = torch.cuda.get_device_name(0)
    else:
        device = "cpu (staging forced, copy double)"
    rows = transport_rows(out, args.cpu, args.timeout) + [trainer_row(out, args.cpu, args.timeout)]
    rows += parity_rows(out, args.cpu, args.timeout)
    report = {"device": device, "date": time.strftime("%Y-%m-%d", time.gmtime()), "mode": "cpu" if args.cpu else "gpu",
              "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"bimetal GPU check on {device}, {report['date']}, {report['seconds']} s")
    print(table(rows))
    print(f"(JSON: {out / 'gpu_check.json'})")
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_command("gpu-check", main, sys.argv[1:]))
