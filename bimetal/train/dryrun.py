"""``bimetal train --config F --dry-run``: per-stage memory per GPU against each stage's device, nothing run.

No rank starts, no GPU is touched and nothing is written. The config reported is the one the run would use,
after every check the run makes before its ranks start (``bimetal.train.prepare``: ``--simulate``'s layout
applied and checked, outputs, data, resume). Each stage of the layout is the trainer's own
module on the meta device; its bytes come from ``bimetal.train.memory`` (parameters counted, activations
measured on fake tensors; the assumptions are listed there). The device of each stage comes from the
cluster spec named by ``parallel.cluster``: stages take the spec's GPUs in file order, ``pp*dp*tp`` of them,
as ``bimetal plan`` lays them out. A stage fits when its total is within ``MEMORY_RESERVE`` of the device's
memory, the same margin the planner leaves. Exit status 0 when every stage fits, 1 when one does not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from bimetal.config import TrainConfig
from bimetal.errors import UserError
from bimetal.plan.hops import HopCost, format_hops, hop_costs
from bimetal.plan.search import MEMORY_RESERVE


@dataclass
class StageMemory:
    """Bytes per GPU of one pipeline stage, by part, and the device it must fit."""

    stage: int
    layers: int
    in_flight: int
    device: str
    capacity: int
    """Device memory in bytes, 0 when no cluster spec names it."""
    params: int
    grads: int
    optimizer: int
    weight_copies: int
    """bf16 copies of weights autocast keeps per microbatch in flight (0 under FSDP or float32)."""
    gathered: int
    """FSDP with a pipeline: the stage's unsharded parameters, gathered in the compute dtype for the whole step."""
    unsharded_grads: int
    """FSDP: float32 unsharded gradients accumulated between microbatches until the last backward reduces them."""
    recv_buffers: int
    """torch's pipeline stage: one receive buffer per microbatch for activations (stage > 0) and for gradients
    (stages before the last), in the boundary dtype (``parallel.pp_boundary_dtype``), each this tp rank's
    share, allocated once and kept. Stages of different tp or dp (bimetal's runner): the gathered input of each
    microbatch in flight."""
    activations: int
    transient: int
    """The largest short-lived buffers: logits gradient, one recomputed block, FSDP's gather/reduce buffers."""
    held_outputs: int = 0
    """Of ``activations`` (not added again to the total): the stage outputs the schedule holds at once, one per
    microbatch in flight until its gradient, in the boundary dtype (the last stage's logits; 0 without pp)."""
    shape: dict[str, Any] | None = None
    """The stage's own shape (``tp``, ``dp``, ``dp_shard``, ``micro_batch``, ``ac``) under per-stage keys."""

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.weight_copies + self.gathered
                + self.unsharded_grads + self.recv_buffers + self.activations + self.transient)

    @property
    def fits(self) -> bool | None:
        return None if not self.capacity else self.total <= self.capacity * MEMORY_RESERVE


def stage_devices(cfg: TrainConfig) -> list[tuple[str, int]]:
    """(GPU part, memory bytes) of each stage from ``parallel.cluster``; ("unknown", 0) without one."""
    p = cfg.parallel
    if not p.cluster:
        return [("unknown", 0)] * p.pp
    from bimetal.parallel.layout import ParallelDims
    from bimetal.plan.layout_check import check_on_spec, spec_view
    from bimetal.plan.sbatch import islands
    from bimetal.plan.spec import load_spec

    spec = load_spec(p.cluster)
    widths = [tp * dp for tp, dp, _ in cfg.stage_shapes()]
    if sum(widths) != spec.total_gpus:
        what = ("the per-stage shapes need " + "+".join(map(str, widths)) if cfg.per_stage
                else f"parallel.pp*dp*tp = {p.pp}*{p.dp}*{p.tp} =")
        raise UserError(f"{what} {sum(widths)} GPUs but cluster {p.cluster} has {spec.total_gpus}; match the "
                        "layout to the cluster.")
    try:  # the one layout check (a tp group leaving a node, a stage across vendors), as `bimetal slurm` runs it
        layout = check_on_spec(ParallelDims.from_config(cfg), spec)
    except UserError as exc:
        raise UserError(f"parallel.cluster {p.cluster}: {exc}") from None
    groups_by_host = {f"{g.name}-{n}": g for g in spec.groups for n in range(g.count)}
    view = spec_view(islands(spec))
    out = []
    for j in range(p.pp):
        stage_ranks = [r for replica in layout.mesh[j] for r in replica]
        groups = {id(g): g for g in (groups_by_host[view.host_of(r)] for r in stage_ranks)}.values()
        small = min(groups, key=lambda g: g.memory_bytes)
        name = small.gpu if len({g.gpu for g in groups}) == 1 else "/".join(sorted({g.gpu for g in groups}))
        out.append((name, small.memory_bytes))
    return out


def boundary_size(cfg: TrainConfig) -> int:
    """Bytes per element at a stage boundary: bf16 (2) when training in bf16 with ``pp_boundary_dtype = "compute"``
    (``auto`` counts as bf16: the dry-run sizes GPUs), else float32 (4)."""
    return 2 if cfg.training.dtype != "float32" and cfg.parallel.pp_boundary_dtype == "compute" else 4


def stage_memory(cfg: TrainConfig, stage: int, device: tuple[str, int] = ("unknown", 0)) -> StageMemory:
    """Measure one stage of ``cfg`` on the meta device (bf16 unless ``training.dtype`` is float32)."""
    from bimetal import models
    from bimetal.train.memory import check_tp, measure_stage, param_bytes

    args = models.flavour_args(cfg.model.family, cfg.model.flavour)
    p, ac = cfg.parallel, cfg.activation_checkpoint
    tp, _, dp_shard = cfg.stage_shapes()[stage]  # this stage's own shape (per-stage layouts)
    check_tp(args, tp)
    split = cfg.stage_split(args.n_layers)
    first, last = stage == 0, stage == p.pp - 1
    # The trainer's stage (build_stage without the allocation and init that follow it).
    start = sum(split[:stage])  # bimetal.train.pipeline.stage_layer_ids, without importing torch's pipelining
    model = models.prune_to_stage(models.build_model(cfg.model.family, args, device="meta"),
                                  list(range(start, start + split[stage])), first, last)
    bf16 = cfg.training.dtype != "float32"
    fsdp = dp_shard > 1
    mb, seq = cfg.stage_microbatch(stage), cfg.data.seq_len
    size = boundary_size(cfg)
    m = measure_stage(model, tp, mb, seq, bf16, fsdp=fsdp, boundary_size=size)
    c = param_bytes(model, tp, dp_shard)
    n = split[stage]
    ckpt = {"none": 0, "full": n, "selective": n // ac.every}[ac.stage_mode(stage)]
    in_flight = p.microbatches if p.schedule == "gpipe" else min(p.microbatches, p.pp - stage)
    copies = 0 if fsdp else (n - ckpt) * m.block.weight_copies + m.head.weight_copies
    act = (n - ckpt) * m.block.activations + ckpt * m.block_input + m.rope + m.head.activations
    act += m.output if p.pp > 1 else 0  # the output the schedule holds until its gradient (none without one)
    transient = m.logits_grad
    if ckpt:
        transient += m.block.activations + (0 if fsdp else m.block.weight_copies)
    gathered = unsharded_grads = 0
    # tp's vocabulary-split embedding gets its gradient back whole (a replicated DTensor of all V rows): it is
    # the .grad kept without FSDP, the unsharded gradient FSDP accumulates with it.
    whole_emb = args.vocab_size * args.dim * (tp - 1) // tp if stage == 0 else 0
    if fsdp:
        size = 2 if bf16 else 4  # FSDP's param_dtype: bf16 under autocast, else float32
        if p.pp > 1:  # reshard_after_forward off, resharding off in every backward but the last
            gathered = c.local * size
        else:  # each block gathered for its forward and its backward: current + prefetched block
            transient += 2 * c.unit * size
        # Sync off in every backward but the last: unsharded gradients accumulate in float32.
        backwards = p.microbatches * (cfg.optim.grad_accum if p.pp == 1 else 1)
        unsharded_grads = 4 * (c.local + whole_emb) if backwards > 1 else 0
        transient += c.unit * (size + 4)  # one block's gradient and its float32 reduce-scatter input
    boundary = mb * seq * args.dim * size // tp  # one activation (or gradient) share at a stage boundary
    recv = p.microbatches * boundary * ((stage > 0) + (stage < p.pp - 1)) if p.pp > 1 else 0
    if _ragged(cfg):  # bimetal's runner (train/shaped.py): each microbatch in flight keeps its gathered input;
        recv = in_flight * boundary * tp * (stage > 0)  # gradients arrive one microbatch at a time
        transient += boundary * tp * (stage < p.pp - 1)
    grads = 4 * c.held + (0 if fsdp else 4 * whole_emb)
    shape = {"tp": tp, "dp": cfg.stage_shapes()[stage][1], "dp_shard": dp_shard, "micro_batch": mb,
             "ac": ac.stage_mode(stage)} if cfg.per_stage else None
    return StageMemory(stage, n, in_flight, device[0], device[1], 4 * c.held, grads,
                       8 * c.held + 4 * c.tensors, in_flight * copies, gathered, unsharded_grads, recv,
                       in_flight * act, transient, in_flight * m.output if p.pp > 1 else 0, shape)


def _ragged(cfg: TrainConfig) -> bool:
    """Stages that differ in tp or dp: they run bimetal's own pipeline runner, not torch's stage."""
    shapes = cfg.stage_shapes()
    return len({(tp, dp) for tp, dp, _ in shapes}) > 1


def hop_report(cfg: TrainConfig) -> list[HopCost]:
    """Each pipeline boundary's hops on ``parallel.cluster`` (its distinct links), priced; [] without a cluster
    spec or a pipeline. Stages take the spec's GPUs in file order, as ``stage_devices``."""
    from bimetal import models
    from bimetal.plan.spec import load_spec

    p = cfg.parallel
    if p.pp < 2 or not p.cluster:
        return []
    spec = load_spec(p.cluster)
    owner = [g for g in spec.groups for _ in range(g.gpus)]
    if cfg.per_stage:  # a global microbatch crosses each boundary, spread over min(widths) pairs at once
        args = models.FLAVOURS[cfg.model.family][cfg.model.flavour]
        widths = [tp * dp for tp, dp, _ in cfg.stage_shapes()]
        total = cfg.global_batch // p.microbatches * cfg.data.seq_len * args.dim * boundary_size(cfg)
        out = []
        for j in range(p.pp - 1):
            pairs = min(widths[j], widths[j + 1])
            ends = [owner[sum(widths[:j])], owner[sum(widths[:j + 1])]]
            h = hop_costs(ends, pairs, total / pairs, p.pp_transport, p.homogeneous_backend)[0]
            out.append(replace(h, stages=(j, j + 1)))
        return out
    width = p.dp * p.tp
    args = models.flavour_args(cfg.model.family, cfg.model.flavour)
    nbytes = cfg.data.batch_size // p.microbatches * cfg.data.seq_len * args.dim * boundary_size(cfg) / p.tp
    seen: dict[tuple[Any, ...], HopCost] = {}
    for i in range(width):  # the pp group of position i: the i-th GPU of every stage
        for h in hop_costs([owner[j * width + i] for j in range(p.pp)], width, nbytes, p.pp_transport,
                           p.homogeneous_backend):
            key = (h.stages, h.groups, h.link)
            if key not in seen or h.seconds > seen[key].seconds:
                seen[key] = h
    return sorted(seen.values(), key=lambda h: h.stages)


def report(cfg: TrainConfig) -> list[StageMemory]:
    """Every stage of ``cfg`` against its device."""
    devices = stage_devices(cfg)
    return [stage_memory(cfg, j, devices[j]) for j in range(cfg.parallel.pp)]


def format_report(cfg: TrainConfig, stages: list[StageMemory], chosen: str = "") -> str:
    """The report as a table, in GB (MB when every stage is under 1 GB, e.g. the debug flavour)."""
    p, ac = cfg.parallel, cfg.activation_checkpoint
    unit, scale = ("GB", 1e9) if max(s.total for s in stages) >= 1e9 else ("MB", 1e6)

    def _gb(x: int) -> str:
        return f"{x / scale:.1f}"

    # what the ranks compute in, as the trainer decides it (``chosen``: how training.dtype auto was resolved)
    fsdp = max(sh for _, _, sh in cfg.stage_shapes()) > 1
    dtype = ("float32, no autocast" if cfg.training.dtype == "float32" else
             "bf16 (FSDP gathers bf16 weights), float32 master weights and AdamW" if fsdp else
             "bf16 autocast, float32 master weights and AdamW") + (f" ({chosen})" if chosen else "") + \
        (f", stage boundary {'bf16' if boundary_size(cfg) == 2 else 'float32'}" if p.pp > 1 else "")
    if cfg.per_stage:
        shape = f"pp={p.pp} stages " + " | ".join(
            f"{s}: dp={dp} (shard {sh}) tp={tp} microbatch {cfg.stage_microbatch(s)}"
            for s, (tp, dp, sh) in enumerate(cfg.stage_shapes())) + \
            f", global batch {cfg.global_batch} x {cfg.data.seq_len} tokens, {p.schedule} (per-stage shapes), "
    else:
        shape = (f"pp={p.pp} dp={p.dp} (shard {p.dp_shard}) tp={p.tp} microbatch "
                 f"{cfg.data.batch_size // p.microbatches} x {cfg.data.seq_len} tokens, {p.schedule}, ")
    lines = [f"dry run: {cfg.model.family}/{cfg.model.flavour} " + shape +
             f"{dtype}, activation checkpoint "
             + (" | ".join(ac.mode_per_stage) if ac.mode_per_stage else ac.mode)
             + (f" every {ac.every}" if "selective" in (ac.mode, *ac.mode_per_stage) else ""),
             f"{unit} per GPU (1 {unit} = {scale:.0e} bytes):",
             f"{'stage':>5} {'layers':>6} {'mb':>3} {'device':<14} {'params':>7} {'grads':>7} {'optim':>7} "
             f"{'copies':>7} {'gather':>7} {'ugrads':>7} {'recv':>7} {'activ':>7} {'trans':>7} {'total':>7} "
             f"{'limit':>7}  fits"]
    for s in stages:
        limit = _gb(int(s.capacity * MEMORY_RESERVE)) if s.capacity else "-"
        fits = {True: "yes", False: "NO", None: "unknown (set parallel.cluster)"}[s.fits]
        lines.append(f"{s.stage:>5} {s.layers:>6} {s.in_flight:>3} {s.device:<14} {_gb(s.params):>7} "
                     f"{_gb(s.grads):>7} {_gb(s.optimizer):>7} {_gb(s.weight_copies):>7} {_gb(s.gathered):>7} "
                     f"{_gb(s.unsharded_grads):>7} {_gb(s.recv_buffers):>7} {_gb(s.activations):>7} "
                     f"{_gb(s.transient):>7} {_gb(s.total):>7} {limit:>7}  {fits}")
    lines.append(f"limit = {MEMORY_RESERVE:.0%} of the device's memory; mb = microbatches in flight; "
                 "copies = bf16 weight copies autocast keeps per microbatch; gather = FSDP's unsharded parameters "
                 "kept through the step (pp > 1); ugrads = FSDP's unsharded float32 gradients accumulated between "
                 "microbatches; recv = the pipeline's receive buffers, one per microbatch, in the boundary dtype; "
                 "trans = short-lived peak buffers")
    return "\n".join(lines)


def dry_run(cfg: TrainConfig, as_json: bool = False, local: bool = True, device_type: str = "cuda") -> int:
    """Print the report of a config ``bimetal.train.prepare`` passed; 0 when every stage fits (or no device is
    known), 1 when one does not. ``local``: its ranks would run here, so the files they read and write were
    checked too (else the report says they are left to the ranks). ``device_type``: what the ranks compute on
    (``Job.device_type``), which decides what ``training.dtype = "auto"`` trains in: the report sizes and names
    the dtype, autocast and boundary of that run, as the trainer will (``TrainConfig.compute_dtype``)."""
    chosen = ""
    if cfg.training.dtype == "auto":
        chosen = f"training.dtype auto on {'GPUs' if device_type == 'cuda' else 'the ' + device_type.upper()}"
        cfg = replace(cfg, training=replace(cfg.training, dtype=cfg.compute_dtype(device_type)))
    stages = report(cfg)
    hops = hop_report(cfg) if len(stages) == cfg.parallel.pp else []
    if as_json:
        bf16 = cfg.training.dtype == "bfloat16"  # resolved above: what the ranks compute in
        out: dict[str, Any] = {"reserve": MEMORY_RESERVE, "files_checked": local, "dtype": {
            "compute": cfg.training.dtype, "autocast": bf16, "device": device_type,
            "boundary": ("bfloat16" if boundary_size(cfg) == 2 else "float32") if cfg.parallel.pp > 1 else None},
            "stages": [
            asdict(s) | {"total": s.total, "fits": s.fits} for s in stages], "hops": [asdict(h) for h in hops]}
        print(json.dumps(out, indent=1))
    else:
        print(format_report(cfg, stages, chosen))
        if hops:
            print(f"pipeline hops on {cfg.parallel.cluster}, each on its own link (per step: an activation and its "
                  "gradient per microbatch):\n" + "\n".join(format_hops(hops, cfg.parallel.microbatches)))
        if not local:
            print(f"a torchrun job of {cfg.world_size} ranks: its data, tokenizer "
                  "and output folders are checked by each rank on its node at start-up, not here")
    bad = [s for s in stages if s.fits is False]
    if bad and not as_json:
        print(f"stage {bad[0].stage} does not fit its {bad[0].device}: shard the optimizer state "
              "(parallel.dp_shard), checkpoint activations, use smaller microbatches or more stages.")
    return 1 if bad else 0
