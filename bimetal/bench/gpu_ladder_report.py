"""The GPU ladder's figures from its two ranks' records: per configuration and round, the ratios, the planner's
prediction, memory against the dry-run, the thread profiles; and the markdown table of them.

Definitions (also in ``docs/performance-gpu.md``):

* step time: per step, the slower of the two ranks (device synchronized at each step's end); a run's figure is
  the median of its timed steps, a configuration's the median of its rounds' figures;
* tokens/s: the step's tokens (microbatches x sequences x sequence length) over the step time;
* exposed communication per step: the configuration's step time less (b)'s, i.e. what its boundary costs
  beyond a link that moves nothing (0 for (b) by definition, not shown for (a));
* boundary bytes per step: what the schedule handed the group to send, both ranks together; wire bytes: what
  the group itself counted as sent (for (b): the tokens);
* ratios: of the configurations' median tokens/s; the range is over the rounds' paired ratios;
* prediction of (c)/(b): the planner's transfer time for one boundary message over cpu-forward
  (``plan.hostpath.pair_transfer_seconds`` with this run's measured wire, copy and latency figures) in the
  planner's 1F1B replay with both stages on one device (``plan.schedule.one_f_one_b_on``, stage times measured
  with the device to each rank alone); the predicted exposed time is added to (b)'s measured step;
* memory: the allocator's peak during a run less what the rank keeps resident for other configurations,
  against ``bimetal train --dry-run``'s total for that stage (same model, batch, schedule and dtype).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

CONFIGS = "abcde"
LABELS = {"a": "one process, whole model", "b": "pp=2, ideal boundary", "c": "pp=2, cpu-forward",
          "d": "pp=2, device-direct (Mooncake TCP)", "e": "pp=2, host copy + Gloo"}
MiB = 2**20
RATIOS = (("b", "a"), ("c", "b"), ("d", "b"), ("e", "b"), ("c", "e"))
TARGETS = {("c", "b"): 0.95, ("c", "e"): 1.05}
LOSS_RTOL = 1e-2
"""Final losses of (c), (d), (e) against (a) on the GPU (bf16 autocast: about three significant digits)."""
MEMORY_RTOL = 0.10


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _round_row(s: dict[str, Any], key: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in runs if r.get("error")]
    active = [r for r in runs if not r.get("idle")]
    if errors or not active or not active[0].get("step_s"):
        return {"error": errors[0] if errors else "no result from the ranks"}
    w = s["warmup"]
    times = [max(ts) for ts in zip(*(r["step_s"] for r in active))][w:]
    step = statistics.median(times)
    tokens = s["mb_size"] * s["microbatches"] * s["seq"]
    sent = sum(statistics.mean(r["sent_bytes"][w:]) for r in active if r.get("sent_bytes"))
    wire = sum(r.get("wire_bytes", 0) for r in active) / s["steps"]
    return {"step_s": step, "tokens_per_s": tokens / step, "loss": active[0]["losses"][-1],
            "boundary_bytes": sent if key != "a" else 0, "wire_bytes": wire if key != "a" else 0,
            "peak_bytes": {r["rank"]: r.get("peak_bytes") for r in active}}


def _configs(s: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    runs = [r for rank in ranks for r in rank.get("runs", [])]
    out: dict[str, Any] = {}
    for key in s["configs"]:
        rows = [_round_row(s, key, [r for r in runs if r["config"] == key and r["round"] == rnd])
                for rnd in range(s["rounds"])]
        good = [r for r in rows if "error" not in r]
        out[key] = {"label": LABELS[key], "rounds": rows, "ok": len(good) == len(rows),
                    "tokens_per_s": _median([r["tokens_per_s"] for r in good]),
                    "step_s": _median([r["step_s"] for r in good]),
                    "loss": _median([r["loss"] for r in good]),
                    "boundary_bytes": _median([r["boundary_bytes"] for r in good]),
                    "wire_bytes": _median([r["wire_bytes"] for r in good])}
    base = out.get("b", {}).get("step_s")
    for key, c in out.items():
        c["exposed_s"] = c["step_s"] - base if key != "a" and base and c["step_s"] else None
    return out


def _ratios(s: dict[str, Any], cfg: dict[str, Any], judged: bool) -> dict[str, Any]:
    out = {}
    for num, den in RATIOS:
        if num not in cfg or den not in cfg or not cfg[num]["tokens_per_s"] or not cfg[den]["tokens_per_s"]:
            continue
        paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(cfg[num]["rounds"], cfg[den]["rounds"])
                  if "error" not in a and "error" not in b]
        value = cfg[num]["tokens_per_s"] / cfg[den]["tokens_per_s"]
        target = TARGETS.get((num, den))
        out[f"{num}/{den}"] = {"value": value, "min": min(paired, default=None), "max": max(paired, default=None),
                               "target": target, "meets": (value >= target) if judged and target else None}
    return out


def _prediction(s: dict[str, Any], ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any] | None:
    from bimetal.plan.hostpath import pair_transfer_seconds
    from bimetal.plan.schedule import StageTimes, one_f_one_b_on
    from bimetal.plan.spec import NodeGroup

    cal = {r["rank"]: r.get("calibration") or {} for r in ranks}
    if set(cal) != {0, 1} or "fwd_s" not in cal[0] or "fwd_s" not in cal[1] or not cfg.get("b", {}).get("step_s"):
        return None
    nbytes = cal[0]["boundary_bytes"]
    wire_s = max(1e-6, max(c["wire_s"] for c in cal.values()))
    copy_s = max(1e-6, max(max(c["d2h_s"], c["h2d_s"]) for c in cal.values()))
    latency_us = max(c["latency_s"] for c in cal.values()) * 1e6
    link = NodeGroup(name="this machine", count=1, vendor="nvidia", gpu="measured", gpus_per_node=2, peak_flops=0.0,
                     memory_bytes=0, efficiency=1.0, nics_per_node=1, nic_gbps=8e4, h2d_gbps=nbytes / copy_s / 1e9,
                     intra_gbps=0.0, gpudirect=False, tcp_conn_gbps=nbytes / wire_s / 1e9,
                     host_copy_gbps=math.inf, msg_latency_us=latency_us)
    transfer = pair_transfer_seconds(nbytes, "cpu-forward", link, link, "shared", 1)
    free = [StageTimes(cal[j]["fwd_s"], cal[j]["bwd_s"]) for j in (0, 1)]
    linked = [StageTimes(cal[0]["fwd_s"], cal[0]["bwd_s"], transfer), free[1]]
    exposed = one_f_one_b_on(linked, s["microbatches"]) - one_f_one_b_on(free, s["microbatches"])
    base = cfg["b"]["step_s"]
    measured = [float(c["cf_message_s"]) for c in cal.values() if c.get("cf_message_s") is not None]
    return {"message_bytes": nbytes, "wire_gbps": link.tcp_conn_gbps, "copy_gbps": link.h2d_gbps,
            "latency_us": latency_us, "cf_message_s_predicted": transfer,
            "cf_message_s_measured": max(measured) if measured else None,
            "stage_s": [{"fwd": cal[j]["fwd_s"], "bwd": cal[j]["bwd_s"]} for j in (0, 1)],
            "schedule_s_ideal": one_f_one_b_on(free, s["microbatches"]), "exposed_s": exposed,
            "c_over_b": base / (base + exposed),
            "c_over_b_measured": (cfg["c"]["tokens_per_s"] / cfg["b"]["tokens_per_s"])
            if cfg.get("c", {}).get("tokens_per_s") and cfg["b"].get("tokens_per_s") else None}


def _memory(s: dict[str, Any], cfg: dict[str, Any], judged: bool) -> list[dict[str, Any]]:
    from bimetal.bench.gpu_ladder_rank import train_config
    from bimetal.train.dryrun import stage_memory

    rows = []
    whole = stage_memory(train_config(s, 1), 0) if "a" in cfg else None
    stages = [stage_memory(train_config(s, 2), j) for j in (0, 1)]
    for key, c in cfg.items():
        for rank in ((0,) if key == "a" else (0, 1)):
            dry = whole if key == "a" else stages[rank]
            peaks = [r["peak_bytes"].get(rank) for r in c["rounds"] if "error" not in r]
            peaks = [p for p in peaks if p is not None]
            peak = max(peaks) if peaks else None
            ratio = peak / dry.total if peak and dry is not None and dry.total else None
            rows.append({"config": key, "rank": rank, "dry_run_total": dry.total if dry else None,
                         "dry_run_terms": {k: v for k, v in vars(dry).items() if isinstance(v, int) and k not in
                                           ("stage", "layers", "in_flight", "capacity")} if dry else None,
                         "peak": peak, "peak_over_dry_run": ratio,
                         "within": (abs(ratio - 1) <= MEMORY_RTOL) if judged and ratio else None})
    return rows


def build(s: dict[str, Any], ranks: list[dict[str, Any]], launch_error: str | None, wall_s: float) -> dict[str, Any]:
    """The report (``gpu_ladder.json``): settings, per configuration and round, ratios, prediction, memory."""
    judged = s["device"] == "cuda"
    cfg = _configs(s, ranks)
    base_loss = cfg.get("a", {}).get("loss")
    for key in "cde":
        if key in cfg and base_loss and cfg[key]["loss"] is not None:
            d = abs(cfg[key]["loss"] - base_loss) / abs(base_loss)
            cfg[key]["loss_rel_diff"] = d
            cfg[key]["loss_within"] = d <= LOSS_RTOL if judged else None
    profiles = [{"rank": r["rank"], **p} for r in ranks for p in r.get("profiles", [])]
    first = ranks[0] if ranks else {}
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": first.get("device"),
            "torch": first.get("torch"), "mode": "gpu" if judged else "cpu", "wall_s": round(wall_s, 1), "settings": s,
            "launch_error": launch_error, "phases": [r.get("phases") for r in ranks],
            "configs": cfg, "ratios": _ratios(s, cfg, judged), "prediction": _prediction(s, ranks, cfg),
            "memory": _memory(s, cfg, judged) if judged else [], "profiles": profiles,
            "partial": any(r.get("partial") for r in ranks),
            "ok": launch_error is None and len(ranks) == 2 and all(c["ok"] for c in cfg.values())}


def _f(v: float | None, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _ms(v: float | None) -> str:
    return _f(v * 1e3 if v is not None else None, ".1f")


def _gb(v: int | None) -> str:
    return _f(v / 1e9 if v is not None else None, ".2f")


def markdown(rep: dict[str, Any]) -> str:
    """The tables: configurations, ratios, prediction, memory, profiles."""
    s = rep["settings"]
    tokens = s["mb_size"] * s["microbatches"] * s["seq"]
    out = [f"bimetal GPU ladder on {rep['device'] or 'unknown device'} (torch {rep['torch']}), {rep['date']}, "
           f"{rep['wall_s']} s: llama3/{s['flavour']} {s['dtype']}, seq {s['seq']}, {s['microbatches']} "
           f"microbatches x {s['mb_size']} ({tokens} tokens/step), {s['warmup']} + {s['steps']} steps per run, "
           f"{s['rounds']} round(s) of {s['configs']}" + ("" if rep["mode"] == "gpu" else " [CPU: ratios not judged]")]
    if rep["launch_error"]:
        out.append(f"\nFAILED: {rep['launch_error']}")
    out += ["", "| config | tokens/s | per round | step s | exposed s/step | boundary MiB/step | wire MiB/step "
                "| final loss | vs (a) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, c in rep["configs"].items():
        rounds = " ".join(_f(r.get("tokens_per_s"), ".0f", "FAIL") for r in c["rounds"])
        loss = "(not meaningful)" if key == "b" else _f(c["loss"], ".4f")
        diff = _f(c.get("loss_rel_diff"), ".2%") + {True: " ok", False: " OFF", None: ""}[c.get("loss_within")]
        out.append(f"| ({key}) {c['label']} | {_f(c['tokens_per_s'], '.0f')} | {rounds} | {_f(c['step_s'], '.3f')} | "
                   f"{_f(c['exposed_s'], '.3f')} | {_f(c['boundary_bytes'] and c['boundary_bytes'] / MiB, '.4g')} | "
                   f"{_f(c['wire_bytes'] and c['wire_bytes'] / MiB, '.3g')} | {loss} | "
                   f"{diff if key in 'cde' else ''} |")
        errors = [r["error"] for r in c["rounds"] if "error" in r]
        if errors:
            out.append(f"|  ({key}) failed: {errors[0][:200]} |||||||||")
    out += ["", "| ratio | value | range over rounds | target |", "|---|---|---|---|"]
    for name, r in rep["ratios"].items():
        verdict = {True: " (met)", False: " (SHORT)", None: ""}[r["meets"]]
        out.append(f"| ({name[0]})/({name[2]}) | {r['value']:.3f} | {_f(r['min'], '.3f')}-{_f(r['max'], '.3f')} | "
                   f"{_f(r['target'], '>=.2f', '')}{verdict} |")
    pr = rep["prediction"]
    if pr:
        out += ["", f"planner: one {pr['message_bytes'] / MiB:.4g} MiB boundary message over cpu-forward predicted "
                    f"{pr['cf_message_s_predicted'] * 1e3:.1f} ms (measured {_ms(pr['cf_message_s_measured'])} ms; "
                    f"link measured here: Gloo {pr['wire_gbps']:.2f} GB/s, copies {pr['copy_gbps']:.2f} GB/s, "
                    f"{pr['latency_us']:.0f} us per message); stages alone fwd/bwd per microbatch "
                    + ", ".join(f"{st['fwd'] * 1e3:.1f}/{st['bwd'] * 1e3:.1f} ms" for st in pr["stage_s"])
                    + f"; predicted exposed {pr['exposed_s']:.3f} s/step, (c)/(b) predicted {pr['c_over_b']:.3f}, "
                    f"measured {_f(pr['c_over_b_measured'], '.3f')}"]
    if rep["memory"]:
        out += ["", "| config | rank | dry-run GB | its terms, GB | measured peak GB | peak / dry-run |",
                "|---|---|---|---|---|---|"]
        for m in rep["memory"]:
            verdict = {True: " ok", False: " OFF", None: ""}[m["within"]]
            terms = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in (m["dry_run_terms"] or {}).items() if v)
            out.append(f"| ({m['config']}) | {m['rank']} | {_gb(m['dry_run_total'])} | {terms} | {_gb(m['peak'])} | "
                       f"{_f(m['peak_over_dry_run'], '.3f')}{verdict} |")
    if rep["profiles"]:
        out += ["", "| profiled run | rank | CPU share: training / transport / other threads | transport CPU s/step "
                    "| transport threads' top functions |", "|---|---|---|---|---|"]
        for p in rep["profiles"]:
            prof = p.get("profile")
            if not prof:
                out.append(f"| ({p['config']}) | {p['rank']} | failed: {p.get('error')} | | |")
                continue
            share = prof["cpu_share"]
            tops = [f"{fn} {n:.0%}" for t in prof["threads"] if t["group"] == "transport" for fn, n in t["top"][:2]]
            out.append(f"| ({p['config']}) | {p['rank']} | {_f(share.get('training'), '.0%')} / "
                       f"{_f(share.get('transport'), '.0%')} / {_f(share.get('other'), '.0%')} | "
                       f"{_f(prof['cpu_s_per_step'].get('transport'), '.3f')} | {'; '.join(tops[:4])} |")
        out.append("(CPU share = thread CPU seconds / wall seconds of the profiled steps; a transport thread's CPU "
                   "time includes C code that released the interpreter, so its share bounds the time it holds it)")
    return "\n".join(out)
