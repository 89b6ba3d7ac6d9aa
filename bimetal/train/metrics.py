"""Per-step metrics: loss, tokens/s, MFU, cross-vendor communication time and bytes.

Rank 0 appends one JSON object per step to ``<run_dir>/metrics.jsonl``; a resumed run first cuts the file back
to its checkpoint's step, so replayed steps replace their records. A run from step 0 keeps an earlier run's file
as ``metrics.N.jsonl`` (N the first free from 1) and says so: a record is never deleted. The rank the trainer
gives a ``console`` prints the step line (``bimetal.train.console``).
MFU needs the device's peak from ``bimetal.topology.devices``; an unknown device (CPU simulation
included) gives ``None``, printed as ``unknown`` - never a guessed number.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bimetal.outputs import write_text
from bimetal.topology import devices


def peak_flops(device_name: str | None) -> float | None:
    """Peak bf16 FLOP/s of a named device, or None when the table does not know it."""
    if not device_name:
        return None
    spec = devices.lookup(device_name)
    return spec.peak_bf16_flops if spec else None


def cluster_peak_flops(device_names: list[str]) -> float | None:
    """Summed peak of every rank's device; None if any one is unknown (a partial sum would overstate MFU)."""
    peaks = [peak_flops(n) for n in device_names]
    if not peaks or any(p is None for p in peaks):
        return None
    return float(sum(p for p in peaks if p is not None))


def _set_aside(path: Path) -> Path | None:
    """Move an earlier run's ``metrics.jsonl`` (one with records) to ``metrics.N.jsonl``, N the first free from 1;
    returns where it went, or None where there was nothing to keep."""
    try:
        if path.stat().st_size == 0:
            path.unlink()
            return None
    except FileNotFoundError:
        return None
    n = 1
    while (target := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(target)
    return target


class StepMetrics:
    """Collects per-step records; writes JSONL and the console line on rank 0."""

    def __init__(self, run_dir: str | Path, rank: int, flops_per_token: float, peak: float | None,
                 log_every: int = 1, tensorboard: bool = False, start_step: int = 0) -> None:
        """``peak`` is the summed peak FLOP/s of all devices of the job (None: unknown, MFU not shown).

        ``start_step`` 0 starts ``metrics.jsonl`` anew. A resumed or restarted run passes the step of its
        checkpoint: the file keeps the records up to that step (the run's history, which the summary includes)
        and drops later ones, which this run replays, so no step is logged twice.
        """
        self.rank, self.flops_per_token, self.peak, self.log_every = rank, flops_per_token, peak, log_every
        self.records: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console: Any = None
        """Where the step line goes (a ``bimetal.train.console.StepConsole``); the trainer sets it on one rank."""
        self._tb = None
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step == 0:
                kept = _set_aside(self.path)
                if kept is not None:  # an earlier run's record, not this run's: kept, never deleted
                    print(f"bimetal train: {self.path} of an earlier run in this folder is kept as {kept.name}; "
                          "this run starts a new one.", flush=True)
            else:
                self.history = _keep_until(self.path, start_step)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.path.parent / "tb"))
                except ImportError:  # optional: only when tensorboard is installed
                    self._tb = None

    def log(self, step: int, loss: float, tokens: int, seconds: float, lr: float, grad_norm: float,
            comm_s: float, comm_bytes: int, transport: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record one step; ``tokens`` are the job's (all replicas), ``comm_*`` the cross-vendor ones;
        ``transport``: the bimetal transports' counters of the step (``bimetal.comm.meter``), all ranks."""
        tps = tokens / seconds if seconds > 0 else 0.0
        mfu = (tps * self.flops_per_token / self.peak) if self.peak else None
        rec: dict[str, Any] = {
            "step": step, "loss": loss, "tokens_per_s": tps, "mfu": mfu, "lr": lr, "grad_norm": grad_norm,
            "step_s": seconds, "xvendor_comm_s": comm_s, "xvendor_bytes": comm_bytes, "time": time.time()}
        if transport is not None:
            rec["transport"] = transport
        self.records.append(rec)
        if self.rank == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            if self._tb is not None:
                for k in ("loss", "tokens_per_s", "lr", "grad_norm"):
                    self._tb.add_scalar(k, rec[k], step)
        if self.console is not None:
            self.console.show(rec)
        return rec

    def summary(self, transport: str, xvendor_source: str = "none", dp_transport: str = "none",
                fallback: str = "") -> dict[str, Any]:
        """Loss start/end/max, tokens/s median and spread (the first step is warm-up when there are more);
        ``fallback``: why the pp group runs on cpu-forward although device-direct was asked for."""
        if not self.records:
            return {}
        # The whole run: the steps before a resume or restart and this attempt's. Each attempt's first step
        # is warm-up, left out of the speed figures when there are others.
        records = self.history + self.records
        warm = [r for r in records if r is not records[0] and r is not self.records[0]]
        tps = [r["tokens_per_s"] for r in (warm or records)]
        losses = [r["loss"] for r in records]
        mfus = [r["mfu"] for r in records if r["mfu"] is not None]
        out = {"steps": len(records), "first_step": records[0]["step"], "loss_start": losses[0],
               "loss_end": losses[-1], "loss_max": max(losses),
               "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
               "tokens_per_s_max": max(tps), "tokens_per_s_stdev": statistics.pstdev(tps),
               "mfu_median": statistics.median(mfus) if mfus else None, "pp_transport": transport,
               "pp_transport_fallback": fallback or None,
               "dp_cross_vendor_transport": dp_transport,
               "xvendor_bytes": sum(r["xvendor_bytes"] for r in records),
               "xvendor_comm_s": sum(r["xvendor_comm_s"] for r in records), "xvendor_source": xvendor_source,
               "run_dir": str(self.path.parent)}
        steps = [r["transport"] for r in self.records if "transport" in r]
        if steps:  # summed over the steps (stripes_dead: at the end); after_first: pool growth past warm-up
            out["transport"] = {k: sum(t[k] for t in steps) for k in ("bytes_staged", "pool_buffers_allocated",
                                                                      "failovers")}
            out["transport"]["pool_buffers_allocated_after_first_step"] = sum(
                t["pool_buffers_allocated"] for t in steps[1:])
            out["transport"]["stripes_dead"] = steps[-1]["stripes_dead"]
            out["transport"]["bytes_per_stripe"] = [sum(col) for col in zip(*(t["bytes_per_stripe"] for t in steps))]
        if self.rank == 0:
            write_text(self.path.parent / "summary.json", json.dumps(out, indent=1))  # whole, or the old one
            if self._tb is not None:
                self._tb.close()
        return out


def _keep_until(path: Path, step: int) -> list[dict[str, Any]]:
    """Rewrite ``path`` with its records of steps up to ``step`` (one per step, the last written) and return them.

    A line cut short by a killed process is dropped with the rest of what is replayed.
    """
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                by_step[rec["step"]] = rec
    kept = [by_step[s] for s in sorted(by_step)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def format_summary(s: dict[str, Any]) -> str:
    """The final summary as a few aligned lines for the console."""
    mfu = f"{s['mfu_median'] * 100:.1f}% median" if s.get("mfu_median") is not None else \
        "unknown (device not in bimetal.topology.devices)"
    rows = [
        ("steps", f"{s['first_step']}..{s['first_step'] + s['steps'] - 1}"),
        ("loss", f"{s['loss_start']:.4f} -> {s['loss_end']:.4f} (max {s['loss_max']:.4f})"),
        ("tokens/s", f"{s['tokens_per_s_median']:.0f} median, {s['tokens_per_s_min']:.0f}..{s['tokens_per_s_max']:.0f}"
                     f" range, {s['tokens_per_s_stdev']:.0f} stdev"),
        ("mfu", mfu),
        ("pp transport", s["pp_transport"] + (f" (device-direct fell back: {s['pp_transport_fallback']})"
                                               if s.get("pp_transport_fallback") else "")),
        *([("dp transport", s["dp_cross_vendor_transport"] + ", across vendors")]
          if s.get("dp_cross_vendor_transport", "none") != "none" else []),
        ("cross-vendor", f"{s['xvendor_bytes'] / 1e6:.1f} MB moved (all ranks, {s['xvendor_source']}), "
                         f"{s['xvendor_comm_s']:.2f} s in cross-vendor comm (per rank, waits included)"),
        *([("transport", _transport_line(s["transport"]))] if s.get("transport") else []),
        ("run folder", f"{s['run_dir']} (metrics.jsonl, summary.json, checkpoints/)"),
    ]
    return "summary:\n" + "\n".join(f"  {k:<13} {v}" for k, v in rows)


def _transport_line(t: dict[str, Any]) -> str:
    stripes = "/".join(f"{b / 1e6:.1f}" for b in t["bytes_per_stripe"])
    return (f"{t['bytes_staged'] / 1e6:.1f} MB staged, {t['pool_buffers_allocated']} pool buffers allocated "
            f"({t['pool_buffers_allocated_after_first_step']} after step 1), {t['failovers']} failovers, "
            f"{t['stripes_dead']} stripes down; MB sent per stripe {stripes} (all ranks)")
