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

Each row is appended to ``gpu_check.md`` (``--md``: elsewhere) as it finishes. ``--timeout`` (per step,
``--limits part=seconds`` per part) and ``--budget`` (the whole check) bound the time; a step past either is
ended with every process it started (``bimetal.bench.steps``) and is a failing row; SIGTERM ends the running
step and keeps the rows. ``--only`` picks parts (transport, trainer, parity).

``--cpu``: the same code with CPU tensors and ``BIMETAL_CF_FORCE_STAGING=1`` (the staged paths, with the CPU
copy double), small sizes and short training runs in float32, so that CI runs it end to end without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bimetal from this checkout

from bimetal.args import ArgumentParser  # noqa: E402
from bimetal.bench.steps import Stopped, run_step  # noqa: E402
from bimetal.entry import run_command  # noqa: E402
from bimetal.errors import UserError  # noqa: E402
from bimetal.outputs import scratch_run_folder  # noqa: E402
from bimetal.rank_fork import fork_wanted, preload  # noqa: E402

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


class Run:
    """One run of the check: where it writes, its mode, each step's time limit inside the whole budget, the
    table written row by row (``gpu_check.md`` appended and flushed as each row is known, ``gpu_check.json``
    rewritten), and the step made to hang (``--test-hang``, for the check's own test)."""

    def __init__(self, out: Path, cpu: bool, timeout: float, budget: float, hang: str, device: str,
                 md: Path | None = None, limits: dict[str, float] | None = None) -> None:
        self.out, self.cpu, self.timeout, self.hang = out, cpu, timeout, hang
        self.limits = limits or {}
        # On the CPU every step's launcher is a fork of this process, which imports the launcher and the trainer
        # once (as the launcher forks its simulated ranks: bimetal.rank_fork), not a new interpreter per step that
        # pays those imports again (~4 s of CPU each); on a GPU each step is a new interpreter, as a user runs it.
        self.fork = cpu and fork_wanted(_env(cpu, simulated=True), simulated=True)
        if self.fork:
            preload(["-m", "bimetal.train"])
            for name in ("bimetal.cli", "bimetal.launch", "bimetal.supervisor", "bimetal.train.cli"):
                importlib.import_module(name)
        self.md = md or out / "gpu_check.md"
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget if budget > 0 else float("inf")
        self.report = {"device": device, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                       "mode": "cpu" if cpu else "gpu", "seconds": None, "complete": False, "rows": []}
        with open(self.md, "w") as f:
            f.write(f"bimetal GPU check on {device}, {self.report['date']} ({self.report['mode']} mode)\n\n"
                    "| check | result | rank 0 (nvidia) / rank 1 (amd) |\n|---|---|---|\n")
        self._save()

    def step(self, name: str, args: list[str], log: Path) -> str | None:
        """Run step ``name`` (its command ``args``, output in ``log``) under its time limit: its part's in
        ``--limits``, else ``--timeout``, or what is left of the budget if less. None when it exited 0, else why
        not in a few words (a step that outlives its limit is ended with every process it started, so a hang is
        a failing row)."""
        left = self.deadline - time.monotonic()
        if left < 1:
            return "not run: the check's budget was spent (output: none)"
        limit = min(self.limits.get(name.split("-")[0], self.timeout), left)
        if name == self.hang:
            args = [sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "nvidia:1,amd:1", "--",
                    str(Path(__file__).resolve()), "--hang-rank", str(self.out)]
        rc = run_step(args, log, limit, env=_env(self.cpu, "--simulate" in args), cwd=ROOT, fork=self.fork)
        if rc is None:
            return f"timed out after {limit:.0f} s (output: {log.name})"
        if rc == 0:
            return None
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return f"exit status {rc}: {last[0][:200] if last else 'no output'} (output: {log.name})"

    def add(self, rows: list[dict]) -> None:
        """Rows as they are known: appended to the table file and flushed to disk, the JSON rewritten."""
        self.report["rows"].extend(rows)  # type: ignore[attr-defined]
        with open(self.md, "a") as f:
            f.writelines(markdown_row(r) for r in rows)
            f.flush()
            os.fsync(f.fileno())
        self._save()
        for r in rows:
            print(table([r]), flush=True)

    def finish(self, stopped: str = "") -> dict:
        self.report.update(seconds=round(time.monotonic() - self.t0, 1), complete=not stopped)
        with open(self.md, "a") as f:
            f.write(f"\n{'Stopped (' + stopped + ')' if stopped else 'Finished'} after {self.report['seconds']} s.\n")
        self._save()
        return self.report

    def _save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1))
        tmp.replace(self.out / "gpu_check.json")


def transport_rows(run: Run) -> list[dict]:
    out, cpu = run.out, run.cpu
    sizes = ["4", "8", "8", "2"] if cpu else ["64", "256", "64", "16"]
    failed = run.step("transport", [sys.executable, "-m", "bimetal.cli", "launch", "--simulate", "nvidia:1,amd:1",
                                    "--", str(ROOT / "scripts" / "gpu_check_rank.py"), str(out),
                                    "cpu" if cpu else "cuda", *sizes], out / "transport.log")
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


def trainer_row(run: Run) -> dict:
    out, cpu = run.out, run.cpu
    steps = 8 if cpu else 50
    run_dir = scratch_run_folder(out / "train")
    args = [sys.executable, "-m", "bimetal.cli", "train", "--config", str(ROOT / "configs" / "demo.toml"),
            "--simulate", "nvidia:1,amd:1", "--parallel.dp=1", f"--training.steps={steps}",
            f"--training.dtype={'float32' if cpu else 'bfloat16'}", f"--metrics.run_dir={run_dir}",
            "--metrics.log_every=1", "--checkpoint.every=0", "--optim.warmup_steps=2", "--optim.lr=3e-3"]
    if cpu:
        args += ["--data.seq_len=32", "--data.batch_size=4"]
    failed = run.step("trainer", args, out / "train.log")
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


def parity_rows(run: Run) -> Iterator[dict]:
    """One process, then each layout of ``PARITY`` on simulated ranks sharing the device; per row (as each is
    known) the largest relative loss difference over the steps, and whether the native groups ran on the staged
    path."""
    out, cpu = run.out, run.cpu
    steps = PARITY_STEPS[cpu]
    common = [sys.executable, "-m", "bimetal.cli", "train", "--config", str(ROOT / "configs" / "demo.toml"),
              "--parallel.pp=1", "--parallel.layers_per_stage=[]", f"--training.steps={steps}",
              f"--training.dtype={'float32' if cpu else 'bfloat16'}", "--metrics.log_every=1", "--checkpoint.every=0",
              "--optim.warmup_steps=2", "--optim.lr=3e-3", *(["--data.seq_len=32"] if cpu else [])]
    single = scratch_run_folder(out / "parity-single")
    failed = run.step("parity-single", [*common, *SINGLE, f"--metrics.run_dir={single}"], out / "parity-single.log")
    ref = _losses(single)
    if failed or len(ref) != steps:
        yield from ({"check": f"parity: {name}", "pass": False,
                     "value": f"one-process reference: {failed or 'no losses'}"} for name, _, _ in PARITY)
        return
    for i, (name, simulate, layout) in enumerate(PARITY):
        folder = scratch_run_folder(out / f"parity-{i}")
        log = out / f"parity-{i}.log"
        failed = run.step(f"parity-{i}", [*common, *layout, "--simulate", simulate, f"--metrics.run_dir={folder}"],
                          log)
        got = _losses(folder)
        if failed or len(got) != steps:
            yield {"check": f"parity: {name}", "pass": False, "value": failed or f"{len(got)} of {steps} steps"}
            continue
        worst = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ref)
        staged = "bimetal_sim_native (staged: device tensors)" in log.read_text(errors="replace")
        path = "on the staged path" if staged else "NOT staged"
        yield {"check": f"parity: {name} ({simulate})", "pass": worst <= PARITY_RTOL[cpu] and staged,
               "value": f"max |loss - one process| / loss over {steps} steps {worst:.1e} (tol {PARITY_RTOL[cpu]:g}); "
                        f"native groups {path}"}


MARK = {True: "pass", False: "FAIL", None: "info"}


def markdown_row(r: dict) -> str:
    """One row of ``gpu_check.md``."""
    return f"| {r['check']} | {MARK[r['pass']]} | {r['value'].replace('|', '/')} |\n"


def table(rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows)
    return "\n".join(f"{r['check']:<{width}}  {MARK[r['pass']]:<4}  {r['value']}" for r in rows)


PARTS = ("transport", "trainer", "parity")


def hang_rank(out: Path) -> None:
    """``--hang-rank``: a rank that never ends (the check's test makes a step hang with it). It notes its pid and
    that of a child in a session of its own (as a rank's helper process may be), and ignores SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    (out / f"hang-{os.environ.get('RANK', '0')}.pids").write_text(f"{os.getpid()} {child.pid}\n")
    while True:
        time.sleep(60)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, staging forced, small sizes (CI)")
    ap.add_argument("--out", default="", help="folder for gpu_check.json (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=220.0,
                    help="seconds each step may take before it is ended and reported (default 220)")
    ap.add_argument("--md", default="", help="where the markdown table goes, row by row (default OUT/gpu_check.md)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds the whole check may take: a step gets --timeout or what is left, if less, and "
                         "steps past the budget are rows that say so (default 0: no budget)")
    ap.add_argument("--limits", default="", help="seconds per part where not --timeout, e.g. transport=150,parity=60")
    ap.add_argument("--only", default=",".join(PARTS), help=f"which parts, of {','.join(PARTS)} (default all)")
    ap.add_argument("--test-hang", default="", help=argparse.SUPPRESS)  # test only: this step's ranks hang
    ap.add_argument("--hang-rank", default="", help=argparse.SUPPRESS)  # test only: the rank program it runs
    args = ap.parse_args(argv)
    if args.hang_rank:
        hang_rank(Path(args.hang_rank))
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    try:
        limits = {k.strip(): float(v) for k, v in (item.split("=") for item in args.limits.split(",") if item)}
    except ValueError:
        limits = {"": -1.0}
    if (args.timeout <= 0 or args.budget < 0 or not parts or set(parts) - set(PARTS) or set(limits) - set(PARTS)
            or min(limits.values(), default=1) <= 0):
        raise UserError(f"--timeout must be positive, --budget 0 or more, --only parts of {','.join(PARTS)} and "
                        f"--limits part=seconds (got {args.timeout:g}, {args.budget:g}, {args.only!r}, "
                        f"{args.limits!r})")
    out = Path(args.out or tempfile.mkdtemp(prefix="bimetal-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.cpu:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no GPU visible to torch; use --cpu for the CPU run", file=sys.stderr)
            return 2
        device = torch.cuda.get_device_name(0)
    else:
        device = "cpu (staging forced, copy double)"
    run = Run(out, args.cpu, args.timeout, args.budget, args.test_hang, device, Path(args.md) if args.md else None,
              limits)
    print(f"bimetal GPU check on {device}, {run.report['date']} (rows as they finish)", flush=True)
    stopped = ""
    try:
        if "transport" in parts:
            run.add(transport_rows(run))
        if "trainer" in parts:
            run.add([trainer_row(run)])
        if "parity" in parts:
            for row in parity_rows(run):
                run.add([row])
    except Stopped as exc:  # a timeout around the whole check: the step's processes are ended, the rows kept
        stopped = str(exc)
        run.add([{"check": "the check", "pass": False, "value": f"{stopped} during a step; the rows above are "
                                                                 "all it finished"}])
    report = run.finish(stopped)
    print(f"bimetal GPU check: {report['seconds']} s; table {run.md}, JSON {out / 'gpu_check.json'}")
    return 0 if all(r["pass"] is not False for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(run_command("gpu-check", main, sys.argv[1:]))
