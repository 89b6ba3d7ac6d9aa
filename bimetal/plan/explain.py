"""Step-time breakdown of one plan, and the warning when a single-vendor run would be faster."""

from __future__ import annotations

from bimetal.plan.hops import format_hops
from bimetal.plan.search import Plan


def breakdown(p: Plan) -> dict[str, float]:
    """Seconds per step: compute of the slowest stage, bubble, exposed communication per group."""
    j = max(range(p.pp), key=lambda i: p.stage_compute[i] + p.stage_comm[i])
    slot = p.stage_compute[j] + p.stage_comm[j] + p.tp_comm
    out = {f"compute stage {i} ({p.stage_groups[i]}, {p.layer_split[i]} layers)": c * p.microbatches
           for i, c in enumerate(p.stage_compute)}
    out["pipeline bubble"] = (p.pp - 1) * slot
    out[f"pp boundary exposed (stage {j})"] = p.stage_comm[j] * p.microbatches
    out["tp all-reduce"] = p.tp_comm * p.microbatches
    out["dp all-reduce"] = p.dp_allreduce
    out["step"] = p.step_seconds
    return out


def explain(p: Plan, single_vendor_best: dict[str, float]) -> str:
    """Human-readable breakdown; warns when a homogeneous run of the same size is predicted faster."""
    lines = [f"plan pp={p.pp} dp={p.dp} dp_shard={p.dp_shard} tp={p.tp} activation_checkpoint={p.ac} "
             f"micro_batch={p.micro_batch} microbatches={p.microbatches} transport={p.transport} split={p.layer_split}"]
    for k, v in breakdown(p).items():
        lines.append(f"  {k:<48} {v * 1e3:10.1f} ms")
    if p.hops:
        lines += ["  pipeline hops, each on its own link:", *format_hops(p.hops, p.microbatches)]
    for vendor, tps in single_vendor_best.items():
        if tps > p.tokens_per_s:
            lines.append(f"WARNING: an all-{vendor} cluster of the same size is predicted faster "
                         f"({tps:,.0f} vs {p.tokens_per_s:,.0f} tokens/s).")
    return "\n".join(lines)
