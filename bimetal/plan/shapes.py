"""Per-stage shapes: each vendor island picks its own tp, dp, dp_shard and activation checkpointing.

One pipeline stage per node group of the spec (file order), on all of that group's GPUs. A global microbatch of
``rows`` samples crosses every stage; stage ``j`` splits it over its ``dp_j`` replicas (micro-batch
``rows / dp_j``) and each replica over ``tp_j`` GPUs, so its compute per microbatch does not depend on the shape:
the shape decides what it pays around the compute - tensor-parallel all-reduces (4 per block of its micro-batch,
on the node fabric), FSDP's exposed all-gathers, recomputation, and memory. The layer split balances the stages'
compute (it depends on the islands only). The boundary between stages carries ``rows x seq x dim`` each way per
microbatch whatever the shapes (``bimetal.parallel.boundary``), priced like the uniform planner's hops with
``min(GPUs)`` pairs at once.

For each ``rows`` each stage takes the shape with the smallest time of its own (``slots x slot + its gradient
reduction``, over memory refused); the step is the 1F1B estimate of ``search.evaluate``: ``(m + p - 1)`` slots of
the slowest stage plus the slowest island's exposed reduction. Everything here is pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bimetal.plan import cost
from bimetal.plan.hops import HopCost, hop_costs
from bimetal.plan.search import AC_MODES, MEMORY_RESERVE
from bimetal.plan.spec import ClusterSpec, NodeGroup

TPS = (1, 2, 4, 8)


@dataclass
class StageShape:
    """One stage's shape and its predicted costs per microbatch (seconds) and memory (bytes per GPU)."""

    group: str
    gpu: str
    tp: int
    dp: int
    dp_shard: int
    ac: str
    micro_batch: int
    layers: int
    compute: float = 0.0
    """fwd + bwd (+ recomputation) per microbatch."""
    tp_comm: float = 0.0
    fsdp: float = 0.0
    """Exposed FSDP all-gather per microbatch."""
    boundary: float = 0.0
    dp_reduce: float = 0.0
    """Gradient reduction inside the island, once per step."""
    memory: int = 0
    rejected: str = ""

    @property
    def slot(self) -> float:
        return self.compute + self.tp_comm + self.fsdp + self.boundary

    def describe(self) -> str:
        return f"tp={self.tp} dp={self.dp} dp_shard={self.dp_shard} ac={self.ac} micro_batch={self.micro_batch}"


@dataclass
class ShapedPlan:
    """Every stage's shape; the step estimate as ``search.Plan``'s."""

    model: str
    seq: int
    global_batch: int
    rows: int
    """Samples per global microbatch (each stage splits them over its dp)."""
    microbatches: int
    transport: str
    stages: list[StageShape]
    hops: list[HopCost] = field(default_factory=list)
    step_seconds: float = 0.0
    tokens_per_s: float = 0.0
    alternatives: list[list[StageShape]] = field(default_factory=list)
    """Per stage: every shape priced, best first (over memory last), for ``--explain``."""

    @property
    def layer_split(self) -> list[int]:
        return [s.layers for s in self.stages]

    @property
    def uniform(self) -> bool:
        return len({(s.tp, s.dp) for s in self.stages}) == 1


def _split(m: cost.ModelDims, groups: tuple[NodeGroup, ...], tokens: int, seq: int) -> list[int]:
    """Contiguous layer split minimising the slowest stage, each stage on all of its group's GPUs."""
    def t(j: int, n: int) -> float:
        flops = n * cost.layer_flops_per_token(m, seq) + (cost.head_flops_per_token(m) if j == len(groups) - 1 else 0)
        return flops * tokens / (groups[j].achieved_flops * groups[j].gpus)

    p, n_layers = len(groups), m.layers
    best = [[math.inf] * (n_layers + 1) for _ in range(p + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for j in range(1, p + 1):
        for k in range(j, n_layers - (p - j) + 1):
            for i in range(j - 1, k):
                v = max(best[j - 1][i], t(j - 1, k - i))
                if v < best[j][k]:
                    best[j][k], cut[j][k] = v, i
    out, k = [], n_layers
    for j in range(p, 0, -1):
        out.append(k - cut[j][k])
        k = cut[j][k]
    return out[::-1]


def _shards(g: NodeGroup, dp: int, tp: int) -> list[int]:
    """FSDP degrees worth trying inside the island: none, all of dp, one node's worth."""
    return sorted({d for d in (1, dp, g.gpus_per_node // tp) if 1 <= d <= dp and dp % d == 0})


def _price(m: cost.ModelDims, g: NodeGroup, j: int, pp: int, layers: int, tp: int, dp: int, shard: int, ac: str,
           rows: int, seq: int, mbs: int, boundary: float, bf16: bool = True) -> StageShape:
    b = rows // dp
    first, last = j == 0, j == pp - 1
    s = StageShape(g.name, g.gpu, tp, dp, shard, ac, b, layers)
    tokens = b * seq
    flops = layers * cost.layer_flops_per_token(m, seq) + (cost.head_flops_per_token(m) if last else 0.0)
    s.compute = flops * tokens / (g.achieved_flops * tp)
    ckpt = cost.checkpointed_blocks(layers, ac, 2)
    s.compute += ckpt * cost.layer_flops_per_token(m, seq) * tokens / (g.achieved_flops * tp) / 3
    if tp > 1:  # Megatron: 4 all-reduces of the micro-batch's activations per block, on the node fabric
        s.tp_comm = 4 * layers * cost.ring_allreduce_seconds(cost.activation_bytes(b, seq, m.dim, 2), tp, g.intra_gbps)
    params = layers * m.layer_params + (m.embed_params if first else 0) + (m.head_params if last else 0)
    grad_bytes = 2 * params / tp
    inside = dp * tp <= g.gpus_per_node
    bw = g.intra_gbps if inside else g.nic_gbps / 8 * g.nics_per_node
    if shard > 1:
        gather = 2 * grad_bytes * (shard - 1) / shard / (bw * 1e9)
        s.fsdp = max(0.0, gather - s.compute)
        s.dp_reduce = cost.ring_allreduce_seconds(grad_bytes, shard, bw) / 2 + \
            cost.ring_allreduce_seconds(grad_bytes / shard, dp // shard, bw)
    else:
        s.dp_reduce = cost.ring_allreduce_seconds(grad_bytes, dp, bw)
    s.boundary = boundary
    s.memory = cost.stage_memory_bytes(m, layers, first, last, tp, b, seq, min(mbs, pp - j), shard, ac, 2, bf16,
                                       pipelined=pp > 1, backwards=mbs)
    if s.memory > g.memory_bytes * MEMORY_RESERVE:
        s.rejected = (f"needs {s.memory / 1e9:.1f} GB per GPU, over {MEMORY_RESERVE:.0%} of the "
                      f"{g.memory_bytes / 1e9:.0f} GB of a {g.gpu}")
    return s


def _candidates(m: cost.ModelDims, g: NodeGroup, rows: int, tp_only: int | None = None) -> list[tuple[int, int]]:
    out = []
    for tp in [tp_only] if tp_only else TPS:
        if g.gpus_per_node % tp or m.heads % tp or m.kv_heads % tp or m.ffn % tp or m.vocab % tp:
            continue
        dp = g.gpus // tp
        if rows % dp == 0:
            out.append((tp, dp))
    return out


def evaluate_rows(spec: ClusterSpec, model: str, seq: int, global_batch: int, rows: int,
                  transport: str = "device-direct", tp: int | None = None) -> ShapedPlan | None:
    """The best per-stage plan for global microbatches of ``rows`` samples; None when a stage has no shape
    that fits (or ``rows`` does not divide the batch). ``tp``: every stage that tp (the equal-shapes reference,
    priced by the same model; each stage still picks its FSDP degree and checkpointing)."""
    m = cost.model_dims(model)
    groups, tp_only = spec.groups, tp
    pp = len(groups)
    if pp < 2 or pp > m.layers or global_batch % rows:
        return None
    mbs = global_batch // rows
    split = _split(m, groups, rows * seq, seq)
    width = min(g.gpus for g in groups)
    total = cost.activation_bytes(rows, seq, m.dim, 2)
    hops = [h for j in range(pp - 1) for h in hop_costs([groups[j], groups[j + 1]], width, total / width, transport)]
    hops = [HopCost((j, j + 1), h.groups, h.cross_vendor, h.link, h.priced_as, h.nbytes, h.seconds)
            for j, h in enumerate(hops)]
    plan = ShapedPlan(model, seq, global_batch, rows, mbs, transport, [], hops)
    for j, g in enumerate(groups):
        boundary = sum(2 * h.seconds for h in hops if j in h.stages)
        priced = [_price(m, g, j, pp, split[j], tp, dp, shard, ac, rows, seq, mbs, boundary)
                  for tp, dp in _candidates(m, g, rows, tp_only) for shard in _shards(g, dp, tp) for ac in AC_MODES]
        priced.sort(key=lambda s: (bool(s.rejected), (mbs + pp - 1) * s.slot + s.dp_reduce))
        if not priced or priced[0].rejected:
            return None
        plan.stages.append(priced[0])
        plan.alternatives.append(priced)
    slot = max(s.slot for s in plan.stages)
    plan.step_seconds = (mbs + pp - 1) * slot + max(s.dp_reduce for s in plan.stages)
    plan.tokens_per_s = global_batch * seq / plan.step_seconds
    return plan


def search_shapes(spec: ClusterSpec, model: str, seq: int, global_batch: int, equal: bool = False
                  ) -> list[ShapedPlan]:
    """Per-stage plans over the global-microbatch sizes, best first; [] when the cluster is one island or nothing
    fits. ``equal``: only plans whose stages share tp and dp (the reference the gain is measured against)."""
    if len(spec.groups) < 2:
        return []
    out = []
    for rows in (1, 2, 4, 8, 16, 32, 64):  # a stage's dp must divide the rows: small rows force a larger tp
        for tr in ("cpu-forward", "device-direct"):
            for tp in TPS if equal else [None]:
                p = evaluate_rows(spec, model, seq, global_batch, rows, tr, tp)
                if p is not None and (not equal or p.uniform):
                    out.append(p)
    out.sort(key=lambda p: -p.tokens_per_s)
    return out


def plan_to_config(p: ShapedPlan, spec: ClusterSpec) -> dict[str, object]:
    """The `bimetal train` config of a per-stage plan (``parallel.*_per_stage``, ``data.global_batch_size``,
    ``activation_checkpoint.mode_per_stage``); ``spec`` becomes ``parallel.cluster``."""
    m = cost.model_dims(p.model)
    return {"model": {"family": m.family, "flavour": m.flavour},
            "parallel": {"pp": len(p.stages), "tp_per_stage": [s.tp for s in p.stages],
                         "dp_per_stage": [s.dp for s in p.stages],
                         "dp_shard_per_stage": [s.dp_shard for s in p.stages], "layers_per_stage": p.layer_split,
                         "schedule": "1f1b", "microbatches": p.microbatches, "pp_transport": p.transport,
                         "cluster": spec.path},
            "data": {"seq_len": p.seq, "global_batch_size": p.global_batch},
            "activation_checkpoint": {"mode_per_stage": [s.ac for s in p.stages], "every": 2},
            "training": {"dtype": "bfloat16"}}


def explain_shapes(p: ShapedPlan, equal: ShapedPlan | None, uniform_step: float | None, uniform_desc: str,
                   searched: list[ShapedPlan] | None = None) -> str:
    """Why each island got its shape (the alternatives it beat, those over memory, the tp degrees whose dp does
    not divide the rows), the best plan at each other microbatch size (``searched``), and the step against the
    best plan of equal shapes priced the same way (``equal``) and the search's best uniform plan."""
    lines = [f"per-stage plan: {p.microbatches} global microbatches of {p.rows} samples, transport {p.transport}, "
             f"split {p.layer_split}"]
    for j, (s, alts) in enumerate(zip(p.stages, p.alternatives)):
        lines.append(f"  stage {j} ({s.group}, {s.gpu}): {s.describe()}: slot {s.slot * 1e3:.1f} ms per "
                     f"microbatch (compute {s.compute * 1e3:.1f}, tp all-reduce {s.tp_comm * 1e3:.1f}, FSDP "
                     f"{s.fsdp * 1e3:.1f}, boundary {s.boundary * 1e3:.1f}), gradient reduction "
                     f"{s.dp_reduce * 1e3:.1f} ms, {s.memory / 1e9:.0f} GB per GPU")
        seen = {(s.tp, s.dp_shard, s.ac)}
        for a in alts[1:]:
            if a.tp in {x[0] for x in seen} and not a.rejected:
                continue  # one line per other tp degree: the best of it, and why not
            seen.add((a.tp, a.dp_shard, a.ac))
            why = a.rejected or (f"slot {a.slot * 1e3:.1f} ms (tp all-reduce {a.tp_comm * 1e3:.1f}, recompute and "
                                 f"FSDP {(a.compute - s.compute + a.fsdp) * 1e3:+.1f} against the chosen)")
            lines.append(f"    not {a.describe()}: {why}")
            if len(seen) > 4:
                break
        for tp in TPS:
            dp = s.dp * s.tp // tp
            if tp not in {a.tp for a in alts} and dp >= 1 and s.dp * s.tp % tp == 0 and p.rows % dp:
                lines.append(f"    not tp={tp} dp={dp}: dp={dp} does not divide the {p.rows} rows of a global "
                             "microbatch")
    best_at: dict[int, ShapedPlan] = {}
    for q in searched or []:
        if q.rows != p.rows and (q.rows not in best_at or q.step_seconds < best_at[q.rows].step_seconds):
            best_at[q.rows] = q
    for rows, q in sorted(best_at.items()):
        shapes = " | ".join(f"tp={s.tp} dp={s.dp} ac={s.ac}" for s in q.stages)
        lines.append(f"  with {rows} rows per global microbatch instead: {shapes}: step {q.step_seconds * 1e3:.1f} ms")
    lines.append(f"  best per-stage plan: step {p.step_seconds * 1e3:.1f} ms, {p.tokens_per_s:,.0f} tokens/s")
    if equal is not None:
        gain = equal.step_seconds / p.step_seconds - 1
        shape = equal.stages[0]
        lines.append(f"  best plan of equal shapes priced the same way (tp={shape.tp} dp={shape.dp}, "
                     f"{equal.microbatches} microbatches of {equal.rows}): step {equal.step_seconds * 1e3:.1f} ms; "
                     f"predicted gain of per-stage shapes {gain:+.1%}"
                     + ("" if gain > 1e-9 else " (none: every island's best shape is the same)"))
    if uniform_step:
        gain = uniform_step / p.step_seconds - 1
        lines.append(f"  best uniform plan of the search ({uniform_desc}): step {uniform_step * 1e3:.1f} ms "
                     f"(its model prices tp on stage 0's fabric for every stage); per-stage against it {gain:+.1%}")
    if not p.uniform:
        return "\n".join(lines)
    lines.append("  why no gain: one global microbatch crosses every stage, so each island's dp must divide its rows; "
                 "the shape an island would prefer alone needs more rows, and more rows per replica put a smaller "
                 "island over memory (see the refusals above)")
    return "\n".join(lines)
