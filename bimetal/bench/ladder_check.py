"""`bimetal plan ladder-check`: the cost model fed the lab's own figures against a measured `bimetal bench ladder`.

The lab ladder trains the debug model with pp = 2 across two emulated nodes and dp = 2 inside each (two
pipelines side by side), every NIC rate-limited. Each rung is priced with the planner's host-path terms
(``bimetal.plan.hostpath``) on node groups built from the lab's figures: two ranks and two NICs per node at
the ladder's line rate and latency, staging copies at the profile's memcpy rate, TCP ceilings and message
latency from ``bimetal plan fit`` (a bench comm JSON). Compute comes from a ``bimetal profile`` of the
ladder's microbatch shape on this CPU. The rungs map to the planner's transports and NIC choices:

(a) native groups (the simulated native back-end is Gloo), local rank i on NIC i: gloo, per-gpu;
(b) all groups on Gloo over NIC 0: gloo, shared;  (c) cpu-forward over NIC 0: cpu-forward, shared;
(d) cpu-forward, NIC per rank: cpu-forward, per-gpu; (e) device-direct, NIC per rank: device-direct, per-gpu.

The pipeline time is the replay of the trainer's 1F1B schedule (``bimetal.plan.schedule``); the slower
node's data-parallel all-reduce (Gloo over loopback) and optimizer update follow. Nothing is fitted to
the ladder's own measurements; the check compares each rung's tokens/s ratio to rung (a).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.plan import cost, hostpath
from bimetal.plan.fit import fit_bench_comm
from bimetal.plan.schedule import StageTimes, one_f_one_b
from bimetal.plan.spec import NodeGroup

RUNG_TRANSPORTS = {"a": ("gloo", "per-gpu"), "b": ("gloo", "shared"), "c": ("cpu-forward", "shared"),
                   "d": ("cpu-forward", "per-gpu"), "e": ("device-direct", "per-gpu")}


def lab_group(name: str, vendor: str, rate_mbit: float, latency_ms: float, copy_gbps: float,
              host: dict[str, float]) -> NodeGroup:
    """One lab node (2 ranks, 2 NICs) as a planner node group."""
    return NodeGroup(name=name, count=1, vendor=vendor, gpu="cpu", gpus_per_node=2, peak_flops=1.0,
                     memory_bytes=16 * 10**9, efficiency=1.0, nics_per_node=2, nic_gbps=rate_mbit / 1000,
                     h2d_gbps=copy_gbps, intra_gbps=host["tcp_conn_gbps"], gpudirect=True,
                     tcp_conn_gbps=host["tcp_conn_gbps"], tcp_iface_gbps=host["tcp_iface_gbps"],
                     host_copy_gbps=copy_gbps, msg_latency_us=host["msg_latency_us"] + latency_ms * 1e3)


def predict_rungs(profile: dict[str, Any], host: dict[str, float], rate_mbit: float, latency_ms: float,
                  split: list[int], microbatches: int) -> dict[str, float]:
    """Predicted seconds per step of each rung."""
    parts, copy = profile["parts"], float(profile["copy_gbps"])
    n0 = lab_group("n0", "nvidia", rate_mbit, latency_ms, copy, host)
    n1 = lab_group("n1", "amd", rate_mbit, latency_ms, copy, host)
    nbytes = float(profile["boundary_bytes"])

    def total(j: int, key: str) -> float:
        t = split[j] * parts["layer"][key] + (parts["embed"][key] if j == 0 else 0.0)
        return t + (parts["head"][key] if j == len(split) - 1 else 0.0)

    m = cost.model_dims(str(profile["model"]))
    params = [split[0] * m.layer_params + m.embed_params, split[1] * m.layer_params + m.head_params]
    out = {}
    for key, (transport, nics) in RUNG_TRANSPORTS.items():
        send = hostpath.pair_transfer_seconds(nbytes, transport, n0, n1, nics, pairs=2)
        stages = [StageTimes(total(0, "fwd_s"), total(0, "bwd_s"), send), StageTimes(total(1, "fwd_s"),
                                                                                  total(1, "bwd_s"))]
        pipeline, _ = one_f_one_b(stages, microbatches)
        grads = [4.0 * p for p in params]  # float32 gradients, a 2-rank Gloo ring over loopback per node
        dp = max(hostpath.gloo_allreduce_seconds(g, n0, 2, 2, spans_nodes=False) for g in grads)
        out[key] = pipeline + dp + max(total(0, "optim_s"), total(1, "optim_s"))
    return out


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="bimetal plan ladder-check", description=__doc__.splitlines()[0])
    ap.add_argument("--ladder", required=True, help="ladder.json from `bimetal bench ladder`")
    ap.add_argument("--profile", required=True, help="`bimetal profile` JSON at the ladder's microbatch shape")
    ap.add_argument("--bench-comm", required=True, help="bench_comm.json (TCP ceilings, message latency)")
    ap.add_argument("--split", default="3,1", help="layers per stage of the ladder's config (default 3,1)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--dp", type=int, default=2, help="pipelines side by side (default 2)")
    ap.add_argument("--tolerance", type=float, default=0.2, help="largest relative error of a ratio (0.2)")
    a = ap.parse_args(argv)
    try:
        lad = json.loads(Path(a.ladder).read_text())
        profile = json.loads(Path(a.profile).read_text())
        rate, latency = float(lad["args"]["rate_mbit"]), float(lad["args"]["latency_ms"])
        measured = {k: (row["ratio_median"], row["tokens_per_s_median"]) for k, row in lad["table"].items()
                    if row.get("ratio_median")}
        tokens = int(profile["seq"]) * int(profile["micro_batch"]) * a.microbatches * a.dp
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--ladder {a.ladder} or --profile {a.profile} is not readable ({e}).") from None
    split = [int(x) for x in a.split.split(",")]
    steps = predict_rungs(profile, fit_bench_comm(a.bench_comm), rate, latency, split, a.microbatches)
    worst = 0.0
    print(f"{'rung':<6} {'tokens/s':>8} {'measured':>8} {'error':>6} {'ratio':>6} {'measured':>8} {'error':>6}")
    for key, step in steps.items():
        ratio, tps = steps["a"] / step, tokens / step
        got_ratio, got_tps = measured.get(key, (float("nan"), float("nan")))
        err_ratio, err_tps = abs(ratio - got_ratio) / got_ratio, abs(tps - got_tps) / got_tps
        if key in measured:
            worst = max(worst, err_ratio, err_tps)
        print(f"({key})   {tps:8.0f} {got_tps:8.0f} {err_tps:6.1%} {ratio:6.2f} {got_ratio:8.2f} {err_ratio:6.1%}")
    print(f"largest error {worst:.1%} (tolerance {a.tolerance:.0%})")
    return 0 if worst <= a.tolerance else 1
