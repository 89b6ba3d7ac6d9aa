"""Search over pp/dp/tp degrees, uneven layer splits, microbatching and transports.

Stages are vendor-homogeneous: stage j runs on dp*tp GPUs of one node group, groups fill stages in
file order. With pp = 1, data parallelism spans all groups (hierarchical all-reduce across vendors).
The step time is the 1F1B estimate: (m + p - 1) slots of the slowest stage, plus the exposed DP
all-reduce (not overlapped with backward, a conservative choice). Each layout is also tried with FSDP
(``dp_shard``: the whole dp group, or one node's worth of it, never across a vendor boundary) and with
activation checkpointing (selective every 2nd block, or full): recomputation adds a third of the forward
and backward time of the recomputed blocks, FSDP an all-gather of the stage's bf16 weights in the forward
and again in the backward of every microbatch (exposed where longer than the compute it overlaps) and a
reduce-scatter in place of the all-reduce. Boundary transfers (an activation and a gradient per microbatch
and neighbour) are priced hop by hop on each hop's own link (``bimetal.plan.hops``: the vendor library inside an
island, the transport between islands), with ``bimetal.plan.hostpath``; the search tries cpu-forward and device-direct,
``evaluate`` also prices stock Gloo on the cross-vendor groups and on the one-vendor ones (the ladder).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from bimetal.plan import cost, hostpath
from bimetal.plan.hops import HopCost, hop_costs, usable
from bimetal.plan.spec import ClusterSpec, NodeGroup
from bimetal.transports import BIMETAL

MEMORY_RESERVE = 0.9
"""Fraction of device memory the planner lets a stage use (allocator fragmentation, workspaces)."""


@dataclass
class Plan:
    """One candidate layout and its predicted costs."""

    model: str
    seq: int
    pp: int
    dp: int
    tp: int
    micro_batch: int
    microbatches: int
    transport: str
    layer_split: list[int]
    stage_groups: list[str]
    stage_compute: list[float] = field(default_factory=list)
    """Seconds of fwd+bwd compute per microbatch, per stage."""
    stage_comm: list[float] = field(default_factory=list)
    """Exposed boundary-transfer seconds per microbatch, per stage."""
    tp_comm: float = 0.0
    dp_allreduce: float = 0.0
    step_seconds: float = 0.0
    tokens_per_s: float = 0.0
    tflops_per_gpu: float = 0.0
    memory: list[int] = field(default_factory=list)
    rejected: str = ""
    bottleneck: str = ""
    dp_shard: int = 1
    """FSDP shard degree inside dp (1 = replicated); dp / dp_shard replicas (HSDP)."""
    ac: str = "none"
    """Activation checkpointing: none, selective (every ``ac_every``-th block) or full."""
    ac_every: int = 2
    dp_transport: str = ""
    """Transport of the cross-vendor parts of data-parallel groups; empty: the pipeline ``transport``."""
    homogeneous: str = "native"
    """Back-end of one-vendor groups: ``native`` (NCCL/RCCL) or ``gloo`` (with gloo transports: all Gloo)."""
    nics: str = "per-gpu"
    """NICs a boundary pair's TCP or RDMA traffic uses: ``shared``, ``per-gpu`` or ``striped``."""
    hops: list[HopCost] = field(default_factory=list)
    """Each pipeline hop on its own link (``bimetal.plan.hops``): native inside an island, the transport across."""

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp


def _stage_time(m: cost.ModelDims, g: NodeGroup, layers: int, last: bool, tp: int, tokens: int, seq: int) -> float:
    flops = layers * cost.layer_flops_per_token(m, seq) + (cost.head_flops_per_token(m) if last else 0.0)
    return flops * tokens / (g.achieved_flops * tp)


def balance_layers(m: cost.ModelDims, groups: list[NodeGroup], tp: int, tokens: int, seq: int) -> list[int]:
    """Contiguous split of m.layers over the stages minimising the slowest stage (exact DP).

    Every stage gets at least one layer; the last stage also carries the output head.
    """
    p, L = len(groups), m.layers
    inf = float("inf")
    # best[j][k]: minimal max stage time placing the first k layers on the first j stages
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    cut = [[0] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for j in range(1, p + 1):
        for k in range(j, L - (p - j) + 1):
            for i in range(j - 1, k):
                t = _stage_time(m, groups[j - 1], k - i, j == p, tp, tokens, seq)
                v = max(best[j - 1][i], t)
                if v < best[j][k]:
                    best[j][k], cut[j][k] = v, i
    split, k = [], L
    for j in range(p, 0, -1):
        i = cut[j][k]
        split.append(k - i)
        k = i
    return split[::-1]


@functools.lru_cache(maxsize=4096)
def _balanced(m: cost.ModelDims, groups: tuple[NodeGroup, ...], tp: int, tokens: int, seq: int) -> tuple[int, ...]:
    # The split does not depend on transport, FSDP or checkpointing, which the search varies around it.
    return tuple(balance_layers(m, list(groups), tp, tokens, seq))


def _net_gbps(g: NodeGroup, ranks_per_node: int) -> float:
    # Each boundary rank gets its share of the node's NICs (at least one, shared if fewer NICs than ranks).
    nics = max(1.0, g.nics_per_node / ranks_per_node)
    share = min(1.0, g.nics_per_node / ranks_per_node)
    return nics * share * g.nic_gbps / 8


def evaluate(spec: ClusterSpec, model: str, seq: int, global_batch: int, pp: int, dp: int, tp: int,
             micro_batch: int, transport: str, split: list[int] | None = None, dp_shard: int = 1,
             ac: str = "none", bf16: bool = True, dp_transport: str = "", homogeneous: str = "native",
             nics: str = "per-gpu", boundary: str = "compute") -> Plan | None:
    """Predict one layout; None when the degrees do not tile the cluster. A plan over memory is returned
    with ``rejected`` set. ``bf16``: autocast compute (what plans are written for); False sizes float32.
    ``boundary``: the trainer's ``parallel.pp_boundary_dtype`` (``compute``: bf16 activations and gradients
    cross stages when ``bf16``; ``float32``), for the transfer times and the receive buffers.

    ``transport`` carries cross-vendor pipeline boundaries, ``dp_transport`` (default: the same) the
    cross-vendor parts of data-parallel groups; ``homogeneous="gloo"`` puts one-vendor pp and dp groups
    on stock Gloo too (tp groups stay native). ``nics``: see ``bimetal.plan.hostpath``."""
    m = cost.model_dims(model)
    if pp > m.layers or global_batch % (dp * micro_batch) or dp % dp_shard:
        return None
    if m.heads % tp or m.kv_heads % tp or m.ffn % tp or m.vocab % tp:  # tp splits heads, MLP width, vocabulary
        return None
    width = dp * tp
    stage_groups: list[NodeGroup] = []
    for g in spec.groups:
        if tp > g.gpus_per_node or g.gpus_per_node % tp:
            return None
        if pp == 1:
            continue
        if g.gpus % width:
            return None
        stage_groups += [g] * (g.gpus // width)
    if pp == 1:
        if width != spec.total_gpus:
            return None
        # Mixed-vendor data parallelism: every replica waits for the slowest device.
        slow = min(spec.groups, key=lambda x: x.achieved_flops)
        small = min(spec.groups, key=lambda x: x.memory_bytes)
        stage_groups = [replace(slow, memory_bytes=small.memory_bytes, gpu=f"{slow.gpu}/{small.gpu}")]
    elif len(stage_groups) != pp:
        return None
    mbs = global_batch // (dp * micro_batch)
    tokens = micro_batch * seq
    layers = split or list(_balanced(m, tuple(stage_groups), tp, tokens, seq))
    plan = Plan(model, seq, pp, dp, tp, micro_batch, mbs, transport, layers, [g.name for g in stage_groups],
                dp_shard=dp_shard, ac=ac, dp_transport=dp_transport or transport, homogeneous=homogeneous,
                nics=nics)
    bsize = 2 if bf16 and boundary == "compute" else 4
    act = cost.activation_bytes(micro_batch, seq, m.dim, bsize) / tp
    plan.hops = hop_costs(stage_groups, width, act, transport, homogeneous, nics)
    for j, g in enumerate(stage_groups):
        compute = _stage_time(m, g, layers[j], j == pp - 1, tp, tokens, seq)
        ckpt = cost.checkpointed_blocks(layers[j], ac, plan.ac_every)
        compute += _stage_time(m, g, ckpt, False, tp, tokens, seq) / 3  # recompute: one more forward
        plan.stage_compute.append(compute)
        comm = _fsdp_gather_seconds(m, g, plan, j, compute)
        # per microbatch and neighbour: an activation and a gradient, one each way, each hop on its own link
        comm += sum(2 * h.seconds for h in plan.hops if j in h.stages)
        plan.stage_comm.append(comm)
        in_flight = min(mbs, pp - j)
        mem = cost.stage_memory_bytes(m, layers[j], j == 0, j == pp - 1, tp, micro_batch, seq, in_flight,
                                      dp_shard, ac, plan.ac_every, bf16, pipelined=pp > 1, backwards=mbs,
                                      boundary_size=bsize)
        plan.memory.append(mem)
        if mem > g.memory_bytes * MEMORY_RESERVE and not plan.rejected:
            plan.rejected = (f"stage {j} needs {mem / 1e9:.1f} GB per GPU, over {MEMORY_RESERVE:.0%} of the "
                             f"{g.memory_bytes / 1e9:.0f} GB of a {g.gpu}")
    if tp > 1:
        g0 = stage_groups[0]
        # Megatron TP: 4 all-reduces of b*s*h per layer (2 forward, 2 backward).
        full = cost.activation_bytes(micro_batch, seq, m.dim, 2 if bf16 else 4)  # autocast's matmul outputs
        per_layer = 4 * cost.ring_allreduce_seconds(full, tp, g0.intra_gbps)
        plan.tp_comm = per_layer * max(layers)
    slot = max(c + x for c, x in zip(plan.stage_compute, plan.stage_comm)) + plan.tp_comm
    plan.dp_allreduce = _dp_allreduce(spec, m, plan, stage_groups)
    plan.step_seconds = (mbs + pp - 1) * slot + plan.dp_allreduce
    plan.tokens_per_s = global_batch * seq / plan.step_seconds
    plan.tflops_per_gpu = plan.tokens_per_s * cost.flops_per_token(m, seq) / plan.gpus / 1e12
    plan.bottleneck = _bottleneck(plan)
    return plan


def _stage_params(m: cost.ModelDims, plan: Plan, j: int) -> int:
    params = plan.layer_split[j] * m.layer_params + (m.embed_params if j == 0 else 0)
    return params + (m.head_params if j == plan.pp - 1 else 0)


def _dp_bw(g: NodeGroup, plan: Plan, ranks: int) -> float:
    inside = ranks * plan.tp <= g.gpus_per_node
    return g.intra_gbps if inside else _net_gbps(g, g.gpus_per_node) * g.gpus_per_node


def _fsdp_gather_seconds(m: cost.ModelDims, g: NodeGroup, plan: Plan, j: int, compute: float) -> float:
    """Exposed FSDP all-gather per microbatch: the stage's bf16 weights, forward and backward."""
    if plan.dp_shard == 1:
        return 0.0
    nbytes = 2 * _stage_params(m, plan, j) / plan.tp
    n = plan.dp_shard
    if plan.homogeneous == "gloo":  # an all-gather is half a Gloo all-reduce, forward and backward: one whole
        return max(0.0, hostpath.gloo_allreduce_seconds(nbytes, g, n, g.gpus_per_node // plan.tp,
                                                        n * plan.tp > g.gpus_per_node) - compute)
    gather = 2 * nbytes * (n - 1) / n / (_dp_bw(g, plan, n) * 1e9)
    return max(0.0, gather - compute)


def _dp_allreduce(spec: ClusterSpec, m: cost.ModelDims, plan: Plan, groups: list[NodeGroup]) -> float:
    if plan.dp == 1:
        return 0.0
    gloo = plan.homogeneous == "gloo"
    if plan.pp == 1:  # hierarchical across vendor groups, gradients in bf16
        nbytes = 2 * m.params / plan.tp
        local = min(g.gpus // plan.tp for g in spec.groups)
        if len(spec.groups) == 1 and gloo:
            g = spec.groups[0]
            return hostpath.gloo_allreduce_seconds(nbytes, g, plan.dp, g.gpus_per_node // plan.tp, g.count > 1)
        if len(spec.groups) == 1:  # one island: the ring inside it (the planner's homogeneous reference)
            return cost.ring_allreduce_seconds(nbytes, local, spec.groups[0].intra_gbps)
        slow = min(spec.groups, key=lambda g: g.intra_gbps)
        if gloo:
            inner = max(hostpath.gloo_allreduce_seconds(nbytes, g, local, g.gpus_per_node, g.count > 1)
                        for g in spec.groups)
        else:
            inner = cost.ring_allreduce_seconds(nbytes, local, slow.intra_gbps)
        # Cross step: island rank i exchanges its 1/local shard with rank i of the other islands, all at once.
        a, b = spec.groups[0], spec.groups[1]
        cross_bytes = nbytes / local * 2 * (len(spec.groups) - 1) / len(spec.groups)
        pairs = min(a.gpus_per_node, b.gpus_per_node, local)
        tr = usable(plan.dp_transport, a, b)
        return inner + hostpath.pair_transfer_seconds(cross_bytes, tr, a, b, plan.nics, pairs)
    worst = 0.0
    for j, g in enumerate(groups):
        nbytes = 2 * _stage_params(m, plan, j) / plan.tp
        if gloo:  # stock Gloo: copy to host, ring over TCP, copy back (FSDP's collectives move the same bytes)
            t = hostpath.gloo_allreduce_seconds(nbytes, g, plan.dp, g.gpus_per_node // plan.tp,
                                                plan.dp * plan.tp > g.gpus_per_node)
        elif plan.dp_shard == 1:
            t = cost.ring_allreduce_seconds(nbytes, plan.dp, _dp_bw(g, plan, plan.dp))
        else:  # reduce-scatter (half a ring all-reduce) in the shard group, all-reduce of a shard over replicas
            t = cost.ring_allreduce_seconds(nbytes, plan.dp_shard, _dp_bw(g, plan, plan.dp_shard)) / 2
            t += cost.ring_allreduce_seconds(nbytes / plan.dp_shard, plan.dp // plan.dp_shard,
                                             _dp_bw(g, plan, plan.dp))
        worst = max(worst, t)
    return worst


def _bottleneck(p: Plan) -> str:
    j = max(range(p.pp), key=lambda i: p.stage_compute[i] + p.stage_comm[i])
    terms = {f"compute stage {j} ({p.stage_groups[j]})": p.stage_compute[j] * p.microbatches,
             f"boundary transfer stage {j}": p.stage_comm[j] * p.microbatches,
             "pipeline bubble": (p.pp - 1) * (p.stage_compute[j] + p.stage_comm[j]),
             "dp all-reduce": p.dp_allreduce, "tp all-reduce": p.tp_comm * p.microbatches}
    return max(terms, key=lambda k: terms[k])


AC_MODES = ("none", "selective", "full")


def shard_degrees(spec: ClusterSpec, pp: int, dp: int, tp: int) -> list[int]:
    """FSDP degrees worth trying: none, the whole dp group, and one node's worth (HSDP across nodes).

    A shard group never crosses a vendor boundary: with pp = 1 on a mixed cluster it stays inside the
    smallest island and the replicas cross vendors.
    """
    if dp == 1:
        return [1]
    limit = min(g.gpus for g in spec.groups) // tp if pp == 1 and len(spec.groups) > 1 else dp
    node = min(g.gpus_per_node for g in spec.groups) // tp
    return sorted({d for d in (dp, node, limit) if 1 < d <= limit and dp % d == 0 and limit % d == 0} | {1})


def search(spec: ClusterSpec, model: str, seq: int, global_batch: int) -> tuple[list[Plan], list[Plan]]:
    """All feasible plans, best first, and the rejected ones (over memory)."""
    n = spec.total_gpus
    ok: list[Plan] = []
    rejected: list[Plan] = []
    for tp in (1, 2, 4, 8):
        for pp in range(1, n // tp + 1):
            if (n // tp) % pp:
                continue
            dp = n // tp // pp
            for b in (1, 2, 4):
                for tr in BIMETAL:  # the cross-vendor transports a plan may choose
                    for shard in shard_degrees(spec, pp, dp, tp):
                        for ac in AC_MODES:
                            p = evaluate(spec, model, seq, global_batch, pp, dp, tp, b, tr, dp_shard=shard, ac=ac)
                            # (gloo and homogeneous="gloo" are priced by evaluate but never searched: never faster)
                            if p is None:
                                continue
                            (rejected if p.rejected else ok).append(p)
    ok.sort(key=lambda p: -p.tokens_per_s)
    return ok, rejected


def homogeneous(spec: ClusterSpec, vendor: str) -> ClusterSpec | None:
    """The same number of GPUs, all of the first group of ``vendor``; None if the cluster has none."""
    src = next((g for g in spec.groups if g.vendor == vendor), None)
    if src is None:
        return None
    count = -(-spec.total_gpus // src.gpus_per_node)
    return ClusterSpec(spec.path, (replace(src, count=count),))
