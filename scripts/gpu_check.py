"""The GPU check: is cpu-forward's GPU path right and fast, on one machine with one GPU (NVIDIA or AMD).

``scripts/gpu_check.sh [--cpu] [--out DIR] [--timeout S]`` (or ``make gpu-check``) launches two processes sharing
the GPU, one simulated as each vendor (``bimetal launch --simulate nvidia:1,amd:1``), runs ``gpu_check_rank.py`` (every
collective and point-to-point on device tensors against Gloo, bandwidth, overlap, pool allocations,
device-direct over Mooncake TCP), then the demo trainer for 50 steps in bf16 on the GPU, prints one table and
writes it as ``DIR/gpu_check.json``, each step's output beside it (``transport.log``, ``train.log``). Exit status
0 when every judged row passes, 1 otherwise.

``--cpu``: the same code with CPU tensors and ``BIMETAL_CF_FORCE_STAGING=1`` (the staged paths, with the CPU
copy double), small sizes and a short training run, so that CI runs it end to end without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        env.pop(key, None)
    if cpu:
        env["BIMETAL_CF_FORCE_STAGING"] = "1"
    else:
        env["BIMETAL_SIMULATE_DEVICE"] = "cuda"  # simulated vendors train on the one GPU (trainer._device)
    return env


def step(args: list[str], cpu: bool, log: Path, timeout: float) -> str | None:
    """Run one step of the check in its own process group, its output (stdout and stderr) kept in ``log``.
    None when it exited 0; else why not, in a few words (a step that outlives ``timeout`` is killed with all
    its ranks and reported, so a hang is a failing row and the table still prints)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(args, env=_env(cpu), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
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
    sizes = ["4", "8"] if cpu else ["64", "256"]
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


def table(rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows)
    mark = {True: "pass", False: "FAIL", None: "info"}
    return "\n".join(f"{r['check']:<{width}}  {mark[r['pass']]:<4}  {r['value']}" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, staging forced, small sizes (CI)")
    ap.add_argument("--out", default="", help="folder for gpu_check.json (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=220.0,
                    help="seconds each of the two steps may take before it is killed and reported (default 220)")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        print(f"gpu_check: --timeout must be positive, not {args.timeout:g}", file=sys.stderr)
        return 2
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
    report = {"device": device, "date": time.strftime("%Y-%m-%d", time.gmtime()), "mode": "cpu" if args.cpu else "gpu",
              "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"bimetal GPU check on {device}, {report['date']}, {report['seconds']} s")
    print(table(rows))
    print(f"(JSON: {out / 'gpu_check.json'})")
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
