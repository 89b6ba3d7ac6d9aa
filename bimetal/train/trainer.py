"""The training loop: one pipeline stage x one dp replica per rank.

The stage is built in ``_build_stage``: the model part laid out on the meta device, tensor parallelism,
activation checkpointing, then FSDP2 over the stage-local mesh when ``parallel.dp_shard`` > 1
(``parallelize``), and only then allocated on the rank's device and initialised (``materialize``). Per step:
``grad_accum`` schedule runs (each over ``parallel.microbatches`` microbatches), gradient average over the dp
group (done by FSDP's reduce-scatter/all-reduce in the backward when sharded), one global-norm clip over all
stages and replicas, AdamW, lr schedule, metrics, checkpoint (one part per shard owner when sharded:
``shards``). Stages of different tp or dp (``parallel.*_per_stage``) run ``ShapedRunner`` (``shaped``) in place of
torch's schedule: their boundary joins and splits microbatch rows between replicas, and the loss and gradient norm
are summed over the world. Single-process runs (pp=dp=1, no process group) use the same loop with a plain forward
and the same microbatch split, so the two agree to float32 rounding.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bimetal import env, faults
from bimetal.comm.meter import TransportMeter
from bimetal.config import TrainConfig
from bimetal.errors import JobAborted, UserError
from bimetal.parallel.job import Job, World, agent_id, restart_line
from bimetal.supervisor import report_step
from bimetal.topology.local_device import bind_rank_device
from bimetal.train import checkpoint
from bimetal.train.ckpt_files import GLOBAL, moved, run_meta
from bimetal.train.comm_report import pipeline_transport, write_comm_report
from bimetal.train.console import StepConsole
from bimetal.train.data import TokenStream, load_tokens
from bimetal.train.export import export_model
from bimetal.train.metrics import StepMetrics, cluster_peak_flops
from bimetal.train.optim import average_gradients, build_optimizer, build_scheduler, clip_global_norm
from bimetal.train.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    materialize,
    memory_bytes,
    set_gradient_sync,
    tensor_bytes,
)
from bimetal.train.pipeline import PipelineRunner, StageModule, boundary_dtype, stage_layer_ids, stage_of_param
from bimetal.train.shaped import ShapedRunner
from bimetal.train.shards import merge_loaded, part_name, to_local
from bimetal.train.tokenizer import build_tokenizer
from bimetal.train.tp import apply_tp, check_tp, tp_mesh

_log = logging.getLogger(__name__)


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@contextmanager
def _during(rank: int, step: int, phase: str, group: str | None) -> Iterator[None]:
    """Turn a failure of ``phase`` of a step into one sentence naming the rank, step, phase and group.

    Every error a transport or collective raises is a ``RuntimeError`` (bimetal's ``TransportError``, torch's
    ``DistError`` and Gloo's own); its first line already names the operation and, for bimetal transports,
    the peer and sequence number. ``BIMETAL_TRACEBACK=1`` keeps the traceback for debugging.
    """
    try:
        yield
    except RuntimeError as exc:
        if env.read_flag("BIMETAL_TRACEBACK"):
            raise
        where = f" on group {group!r}" if group else ""
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*", "", reason)  # Gloo's source locations
        raise JobAborted(f"rank {rank} stopped in step {step} during the {phase}{where}: {reason}") from exc


def _autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPUs by default; float32 on the CPU unless asked for bf16 (``TrainConfig.compute_dtype``)."""
    return torch.bfloat16 if cfg.compute_dtype(device.type) == "bfloat16" else None


class _XvendorMeter:
    """Cross-vendor communication per step, summed over the job.

    Counted: what this rank sends to a pipeline neighbour of the other vendor (the hops that cross vendors: a
    hop inside a vendor is not counted, whatever group carries it), and the gradient exchange when the dp group
    spans vendors. pp bytes come from the transport's own counters of the crossing hops when they have them (a
    per-hop pipeline's cross-vendor pairs, ``PerHopGroup.cross_vendor_counters``; a pipeline that is one
    transport group, every hop of which crosses), else from the pipeline's send ops to those neighbours; dp
    bytes are the payload each rank hands to the cross-vendor all-reduce (what the wire carries depends on the
    transport's algorithm). Time is this rank's schedule time minus its stage compute (waits for the peer
    included) when it has a crossing hop, plus the time of a vendor-spanning gradient average. Under HSDP with
    a vendor-spanning replicate dimension the dp bytes are the gradient shard each rank all-reduces; that
    all-reduce runs inside the backward, so its time is not separated out. Per-stage shapes (``ShapedRunner``):
    the counters of this rank's cross-vendor boundary pair groups, else the bytes of the pieces it sent across.
    """

    def __init__(self, ctx: Any, runner: PipelineRunner | ShapedRunner | None) -> None:
        name = ctx.my_group_name("pp") if ctx else None
        # the same on every rank (read() all-reduces): whether the pipelines span vendors at all
        self.pp = runner is not None and name is not None and ctx.spec(name).kind == "cross-vendor"
        self.dp = bool(ctx) and ctx.dp_size > 1 and ctx.dp_spans_vendors
        self.runner, self.ctx = runner, ctx
        self.peers = _cross_vendor_neighbours(ctx, name) if self.pp and name else set()
        self.counters: list[Any] | None = None
        self.shaped = runner if isinstance(runner, ShapedRunner) else None
        if self.shaped is not None:  # boundary pairs: the crossing ones' transport counters, else the pieces sent
            from bimetal.parallel.groups import PAIR

            self.pp = any(g.axis == PAIR and g.kind == "cross-vendor" for g in ctx.group_specs)
            self.counters = self.shaped.cross_counters()
            self.peers = {0} if self.shaped.crosses else set()
        self.active = self.pp or self.dp
        if self.pp and self.shaped is None:
            pg = ctx.pp_group
            if hasattr(pg, "cross_vendor_counters"):
                self.counters = pg.cross_vendor_counters()
            elif getattr(pg, "counters", None) is not None:
                self.counters = [pg.counters]
        parts = (["pp: " + ("transport counters" if self.counters is not None else "pipeline send ops")]
                 if self.pp else []) + (
            ["dp: all-reduce payload"] if self.dp else [])
        self.source = "; ".join(parts) or "none"
        self._last = self._sent()

    def _sent(self) -> int:
        if self.counters is not None:
            return sum(int(c.snapshot()["bytes_sent"]) for c in self.counters)
        if self.shaped is not None:
            return self.shaped.cross_sent
        if not isinstance(self.runner, PipelineRunner) or not self.pp:
            return 0
        return sum(n for peer, n in self.runner.pipe_stage.sent_to.items() if peer in self.peers)

    def read(self, schedule_s: float, dp_s: float, dp_bytes: int) -> tuple[float, int]:
        """(seconds, bytes) of the last step: this rank's cross-vendor time, and the bytes every rank sent."""
        if not self.active:
            return 0.0, 0
        now = self._sent()
        sent, self._last = now - self._last, now
        busy = dp_s if self.dp else 0.0
        if self.shaped is not None:
            busy += max(0.0, schedule_s - self.shaped.compute_s) if self.peers else 0.0
            self.shaped.compute_s = 0.0
        elif isinstance(self.runner, PipelineRunner):
            st = self.runner.pipe_stage
            busy += max(0.0, schedule_s - st.compute_s) if self.peers else 0.0
            st.reset_counters()
            if self.counters is None:
                self._last = 0
        local = torch.tensor([float(sent + (dp_bytes if self.dp else 0)), busy], dtype=torch.float64)
        dist.all_reduce(local)  # world (Gloo, CPU): bytes summed over ranks; time as the mean per rank
        return float(local[1]) / self.ctx.world_size, int(local[0])


def _cross_vendor_neighbours(ctx: Any, pp_name: str) -> set[int]:
    """This rank's neighbouring stages (global ranks) in its pipeline that run on another vendor."""
    ranks = ctx.spec(pp_name).ranks  # in stage order
    s = ranks.index(ctx.rank)
    return {ranks[j] for j in (s - 1, s + 1)
            if 0 <= j < len(ranks) and ctx.view.vendor_of(ranks[j]) != ctx.vendor}


def _write_memory(run_dir: str, rank: int, sizes: dict[str, int]) -> None:
    """``memory-rank<R>.json``: bytes of parameters, gradients and optimizer state this rank holds (and, under
    FSDP with a pipeline, FSDP's unsharded parameters and gradients at the first step's last backward; with a
    pipeline, the schedule's receive buffers and the most stage-output bytes it held at once in that step)."""
    import json
    from pathlib import Path

    from bimetal.outputs import write_text

    write_text(Path(run_dir) / f"memory-rank{rank}.json", json.dumps(sizes))  # whole or not at all


def train(cfg: TrainConfig, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run ``cfg`` on this rank (world from the torchrun env when pp*dp > 1); returns the summary. With
    ``parallel.layout = "auto"`` the ranks pick the layout for the world they find, keeping the layout keys
    ``keep`` (``bimetal.plan.auto_layout``)."""
    tok = build_tokenizer(cfg.data.tokenizer)
    tokens = load_tokens(cfg.data.path, tok, cfg.data.bin_dtype)  # a missing file fails before any model work
    from bimetal import models

    args = models.flavour_args(cfg.model.family, cfg.model.flavour)
    if tok.vocab_size > args.vocab_size:
        raise UserError(f"tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} tokens but model "
                        f"{cfg.model.family}/{cfg.model.flavour} has only {args.vocab_size}; match them.")

    def check_shapes(cfg: TrainConfig) -> list[int]:
        """The stage split, and tp against the model: before any process group, or once the layout is picked."""
        for tp in dict.fromkeys(tp for tp, _, _ in cfg.stage_shapes()):
            check_tp(args, tp, f"{cfg.model.family}/{cfg.model.flavour}")
        return cfg.stage_split(args.n_layers)

    auto = cfg.parallel.layout == "auto"
    split = [] if auto else check_shapes(cfg)
    torch.manual_seed(cfg.training.seed)
    torch.set_num_threads(env.read_int("BIMETAL_THREADS", 1))
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    # The rank's GPU, bound before any process group exists: NCCL/RCCL and every transport buffer land on it.
    device = bind_rank_device()
    ctx = None
    if auto and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: the world is this rank alone
        from bimetal.plan.auto_layout import World, pick_layout
        from bimetal.topology.vendor import detect_vendor

        pick = pick_layout(cfg, World.simulated([detect_vendor(0)]), keep)
        print(pick.line, flush=True)
        cfg = pick.cfg
    elif cfg.world_size > 1 or auto:
        from bimetal.parallel import ParallelDims, init_parallel

        def dims(view: Any, store: Any) -> ParallelDims:
            """The layout of the config, or the one the ranks pick for the world they found."""
            nonlocal cfg
            if auto:
                from bimetal.plan.auto_layout import agree_layout

                cfg = agree_layout(cfg, keep, view, store, int(os.environ.get("RANK", "0")),
                                   timedelta(seconds=cfg.parallel.timeout_s)).cfg
            return ParallelDims.from_config(cfg)

        ctx = init_parallel(dims,
                            transports={"pp": cfg.parallel.pp_transport, "dp": cfg.parallel.dp_transport,
                                        "homogeneous": cfg.parallel.homogeneous_backend},
                            timeout=timedelta(seconds=cfg.parallel.timeout_s),
                            interfaces=cfg.parallel.interfaces or None)
    if auto:  # the picked layout passed these checks in the pick; its split is the one the checkpoints record
        split = check_shapes(cfg)
    smesh = None
    shards = [sh for _, _, sh in cfg.stage_shapes()]
    try:
        if ctx is not None and max(shards) > 1:
            from bimetal.parallel.mesh import build_stage_mesh

            smesh = build_stage_mesh(ctx, shards if cfg.per_stage else cfg.parallel.dp_shard, device.type,
                                     {"dp": cfg.parallel.dp_transport}, timedelta(seconds=cfg.parallel.timeout_s))
            if ctx.rank == 0:
                from bimetal.parallel.groups import format_group_table

                print("bimetal FSDP mesh groups (shard, replicate; a name from the table above is that group):\n"
                      + format_group_table(smesh.specs), flush=True)
        # a rank whose stage does not shard (per-stage dp_shard) holds the mesh groups only to destroy them
        return _run(cfg, ctx, smesh if smesh is not None and smesh.sharding else None, models, args, split, tokens,
                    device)
    finally:
        if smesh is not None:
            smesh.destroy()
        if ctx is not None:
            ctx.destroy()


def _warn(message: str) -> None:
    _log.warning("%s", message)


def _reads(meta: dict[str, Any], rank: int, part: str, split: list[int], stage: int) -> Any:
    """Which files of a checkpoint this rank reads back against their checksums before it resumes: the JSON
    files, and its own part; where the checkpoint is of another layout (keyed by global names), the parts of the
    old stages holding any of this stage's layers (``checkpoint.load_moved``)."""
    import json

    first, last = stage == 0, stage == len(split) - 1
    mine = set(stage_layer_ids(split, stage))
    known: dict[Any, set[str]] = {}

    def parts(path: Any) -> set[str]:
        if path not in known:
            known[path] = _parts(path)
        return known[path]

    def _parts(path: Any) -> set[str]:
        try:
            saved = json.loads((path / "meta.json").read_text())
            old = [int(n) for n in saved["layers_per_stage"]]
        except (OSError, ValueError, KeyError, TypeError):
            return {part}  # damage() reports the file itself
        if saved.get("keys") != GLOBAL or not moved(saved, meta):
            return {part}
        held = {s for s in range(len(old)) if mine & set(stage_layer_ids(old, s))}
        held |= ({0} if first else set()) | ({len(old) - 1} if last else set())
        return {f"stage{s}" for s in held}

    def reads(path: Any, name: str) -> bool:
        if name in ("meta.json", f"extra-rank{rank}.json", "extra-rank0.json"):
            return True
        top, held = name.split("/")[0], parts(path)
        return top in held or top.split("-")[0] in held  # its own part, or every shard part of a stage it reads

    return reads


def _same_job(cfg: TrainConfig, ctx: Any) -> tuple[Job | None, list[str], bool]:
    """This rank's job under an agent (None outside one), the agents of every rank of this round, and whether the
    round continues a job that started (``Job.continues``): the one decision that makes a round resume by itself
    and that the start check (``prepare.check_start``) keeps. Every rank takes it from the same agents, before
    anything is written."""
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    job = ctx.job if ctx is not None else Job.connect(timeout)
    if job is None:
        return None, [], False
    if ctx is None:
        agents = [agent_id()]
    else:
        from bimetal.topology import store_exchange

        store = dist.distributed_c10d._get_default_store()
        agents = store_exchange.exchange(store, "bimetal/job/agent", ctx.rank, agent_id(), range(ctx.world_size),
                                         timeout)
        # One answer for the whole round: a rank whose node sees no record (its own copy of the run folder) must
        # not start afresh while the others resume. The record can only name agents of this job, so one rank
        # that finds them is enough.
        found = Job.continues(cfg.metrics.run_dir, agents)
        votes: list[bool] = store_exchange.exchange(store, "bimetal/job/continues", ctx.rank, found,
                                                    range(ctx.world_size), timeout)
        return job, agents, any(votes)
    return job, agents, Job.continues(cfg.metrics.run_dir, agents)


def _begin_round(job: Job, ctx: Any, cfg: TrainConfig, start: int, path: Any, agents: list[str],
                 continued: bool) -> None:
    """Every rank has decided how it starts (so none reads the record this round writes): rank 0 records this
    round's world and agents in the run folder and, where it ``continued`` the job, logs the one restart line
    against the round before."""
    if ctx is not None:
        dist.barrier()
    if (ctx.rank if ctx is not None else 0) != 0:
        return
    if ctx is not None:
        ranks = [(ctx.view.host_of(r), ctx.view.vendor_of(r)) for r in range(ctx.world_size)]
        layout = ctx.layout.dims.describe()
    else:
        from bimetal.parallel import ParallelDims
        from bimetal.topology.exchange import host_identity
        from bimetal.topology.vendor import detect_vendor

        ranks, layout = [(host_identity(), detect_vendor(0))], ParallelDims.from_config(cfg).describe()
    before, done = job.previous(cfg.metrics.run_dir) if continued else (None, None)
    now = World.of(ranks, layout)
    job.begin(now, cfg.metrics.run_dir, agents, continued)
    if before is not None:
        print(restart_line(before, now, done, start, None if path is None else str(path)), flush=True)


def _build_stage(cfg: TrainConfig, ctx: Any, models: Any, args: Any, split: list[int], stage: int, n_stages: int,
                 device: torch.device, amp: torch.dtype | None, smesh: Any) -> tuple[Any, StageModule, Any]:
    """This rank's stage, in torchtitan's order: the model part, tensor parallelism, activation checkpointing,
    then FSDP2 over the stage mesh.

    Returns (model, stage module, tp mesh): the schedule (or the plain loop) runs the stage module, which under
    FSDP is the root FSDP module holding the model.
    """
    # Laid out on the meta device and split there; then each rank allocates, on its device, only what it keeps
    # (its stage, its tp slices, its FSDP shards: never the whole model nor the unsharded stage) and
    # initialises it per parameter name, so every layout starts from the weights of one process.
    model = models.build_stage(cfg.model.family, args, stage_layer_ids(split, stage), stage == 0,
                               stage == n_stages - 1, device="meta")
    mesh = None
    if ctx is not None and ctx.tp_size > 1:  # under FSDP the tp dimension of the stage mesh, to compose
        mesh = smesh.tp_mesh if smesh is not None else tp_mesh(ctx.tp_group, device)
        apply_tp(model, mesh)
    apply_activation_checkpointing(model, cfg.activation_checkpoint, stage)
    local = StageModule(model, amp, device.type, boundary_dtype(cfg.parallel.pp_boundary_dtype, amp))
    if smesh is not None:
        apply_fsdp(local, model, smesh.dp_mesh, pipelined=n_stages > 1, param_dtype=amp)
    materialize(model, device, cfg.model.seed)
    return model, local, mesh


def _run(cfg: TrainConfig, ctx: Any, smesh: Any, models: Any, args: Any, split: list[int], tokens: Any,
         device: torch.device) -> dict[str, Any]:
    stage, n_stages = (ctx.stage, ctx.num_stages) if ctx else (0, 1)
    dp_rank, dp_size = (ctx.dp_rank, ctx.dp_size) if ctx else (0, 1)
    rank = ctx.rank if ctx else 0
    amp = _autocast_dtype(cfg, device)
    family = cfg.model.family
    # A later round of a job that started (its agent restarted it: a rank died, a node left or joined) resumes by
    # itself: it loses at most the steps since the newest checkpoint. Any other run that is not a --resume is a
    # start, refused where checkpoints are (``parallel.job``).
    job, agents, continued = _same_job(cfg, ctx)
    from bimetal.train.prepare import check_start

    check_start(cfg, continued)
    resume = cfg.checkpoint.resume or continued
    model, local, mesh = _build_stage(cfg, ctx, models, args, split, stage, n_stages, device, amp, smesh)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.training.steps)
    shaped = ctx is not None and ctx.shaped
    # per replica (per-stage shapes: every rank reads the whole global batch; ShapedRunner takes its rows)
    batch = cfg.global_batch if shaped else cfg.global_batch // dp_size
    stream = TokenStream(tokens, cfg.data.seq_len, batch, 0 if shaped else dp_rank, 1 if shaped else dp_size,
                         cfg.training.seed, vocab_size=args.vocab_size)
    n_mb = cfg.parallel.microbatches
    mb, seq = batch // n_mb, cfg.data.seq_len
    runner: PipelineRunner | ShapedRunner | None = None
    if shaped:
        runner = ShapedRunner(local, ctx, n_mb, cfg.global_batch, seq, args.dim, local.boundary_dtype, device,
                              cfg.parallel.schedule)
    elif n_stages > 1:
        # Shapes and dtypes only (meta: no storage; a real [mb, seq, vocab] float32 example of an 8B model at
        # seq 8192 held 4.2 GB for the whole job): the boundary's dtype, and the last stage's logits in it too.
        edt = local.boundary_dtype
        hidden = torch.empty(mb, seq, args.dim, dtype=edt, device="meta")
        ids = torch.empty(mb, seq, dtype=torch.long, device="meta")
        logits = torch.empty(mb, seq, args.vocab_size, dtype=edt, device="meta")
        runner = PipelineRunner(local, stage, n_stages, ctx.pp_group, n_mb, cfg.parallel.schedule, _loss_fn,
                                device, ids if stage == 0 else hidden, logits if stage == n_stages - 1 else hidden,
                                autocast_dtype=amp, tp_mesh=mesh)
        del hidden, ids, logits
    folder = cfg.checkpoint.folder or f"{cfg.metrics.run_dir}/checkpoints"
    meta = run_meta(cfg, split)
    if ctx is not None:  # the vendor mix, rank by rank ("nvidia:2,amd:2"): a move to another one is logged
        mix: dict[str, int] = {}
        for r in range(ctx.world_size):
            mix[ctx.view.vendor_of(r)] = mix.get(ctx.view.vendor_of(r), 0) + 1
        meta["vendors"] = ",".join(f"{v}:{n}" for v, n in mix.items())
    # Sharded (tp=1): the first replica group writes, each shard owner its own part of local shards.
    # Otherwise the stage's first replica writes whole tensors (tp rank 0, after the stage's ranks gather each
    # DTensor: FSDP x TP shards are 2-D), and a load reads each rank's slices of them.
    local_shards = smesh is not None and (ctx is None or ctx.tp_size == 1)
    part = part_name(stage, smesh.shard_rank if local_shards else None)
    if local_shards:
        writer = smesh.replicate_rank == 0
    else:
        writer = dp_rank == 0 and (ctx is None or ctx.tp_rank == 0)
    start = 0
    # Each rank reads its own part, its extra and the meta back against their checksums; all take the newest
    # checkpoint no rank found damaged. Where none is usable among the ones there, every rank stops: starting
    # from step 0 would replace them and pruning delete them.
    reads = _reads(meta, rank, part, split, stage)
    found = checkpoint.agree_latest(folder, rank, reads) if resume else None
    path = found.found if found is not None else None
    if found is not None:
        refusal = found.refusal("--resume" if cfg.checkpoint.resume else "the restarted run's resume")
        if refusal is not None:
            raise UserError(refusal)
        if rank == 0:
            for note in found.notes():
                _warn(note)
    if resume and path is None and rank == 0:
        print(f"no checkpoint in {folder}; starting from step 0", flush=True)
    if path is not None:
        saved = checkpoint.check_meta(path, meta, cfg.checkpoint.resume_changed, note=_warn if rank == 0 else None)
        legacy = saved.get("keys") != GLOBAL  # written before the global keys: on its own layout (check_meta)
        state = checkpoint.training_state(model, opt, stage, legacy)
        if moved(saved, meta):  # another layout: each tensor from the old stage part holding its name
            extra = checkpoint.load_moved(path, {"model": state["model"], "optim": {"state": state["optim"]["state"]}},
                                          saved["layers_per_stage"], stage_of_param)
            checkpoint.apply_training_state(model, opt, stage, state)  # param groups: this run's, from the config
            sched.load_state_dict(extra["sched"])
            for group, lr in zip(opt.param_groups, sched.get_last_lr()):
                group["lr"] = lr
            stream.seek(extra["data"]["position"], extra["data"]["seed"])
        else:
            if not local_shards:  # DTensors read their slices of the whole tensors
                extra = checkpoint.load(path, state, rank, shard=part)
                checkpoint.apply_training_state(model, opt, stage, state, legacy)
            else:  # FSDP shards are filled in place from this shard's own part; the rest comes back in `loaded`
                loaded = to_local(state, {})
                extra = checkpoint.load(path, loaded, rank, shard=part)
                checkpoint.apply_training_state(model, opt, stage, merge_loaded(state, loaded), legacy)
            sched.load_state_dict(extra["sched"])
            stream.load_state_dict(extra["data"])
        checkpoint.set_rng_state(extra["rng"])
        start = extra["step"]
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)
    if job is not None:
        _begin_round(job, ctx, cfg, start, path, agents, continued)
    devices = [ctx.view[r].device for r in range(ctx.world_size)] if ctx else [
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"]
    metrics = StepMetrics(cfg.metrics.run_dir, rank, float(args.flops_per_token(seq)), cluster_peak_flops(devices),
                          cfg.metrics.log_every, cfg.metrics.tensorboard, start_step=start)
    # one step line per job: the last stage's first replica, whose step ends last
    if rank == (ctx.layout.mesh[-1][0][0] if ctx else 0):
        metrics.console = StepConsole(cfg.training.steps, start, cfg.metrics.log_every)
    meter = _XvendorMeter(ctx, runner)
    transport_meter = TransportMeter([ctx.pp_group, ctx.dp_group] if ctx else [])
    pp_name = ctx.my_group_name("pp") if ctx else None
    dp_name = ctx.my_group_name("dp") if ctx else None
    for step in range(start, cfg.training.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        schedule_s = 0.0
        for acc in range(cfg.optim.grad_accum):
            x, y = (t.to(device) for t in stream.next_batch())
            if isinstance(runner, ShapedRunner):
                ts = time.perf_counter()
                with _during(rank, step + 1, "pipeline boundary (per-stage shapes)", None):
                    loss_sum += runner.step(x, y)
                schedule_s += time.perf_counter() - ts
            elif runner is not None:
                ts = time.perf_counter()
                with _during(rank, step + 1, "pipeline schedule", pp_name):
                    loss_sum += runner.step(x if stage == 0 else None, y if stage == n_stages - 1 else None)
                schedule_s += time.perf_counter() - ts
            else:
                # Same microbatch split and mean as the pipeline schedule, so both paths agree numerically.
                for i, (xc, yc) in enumerate(zip(x.chunk(n_mb), y.chunk(n_mb))):
                    # FSDP reduce-scatters in the last microbatch's backward only, overlapped block by block.
                    set_gradient_sync(local, acc == cfg.optim.grad_accum - 1 and i == n_mb - 1)
                    loss = _loss_fn(local(xc), yc) / n_mb
                    loss.backward()
                    loss_sum += loss.detach()
        if cfg.optim.grad_accum > 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= cfg.optim.grad_accum
        td = time.perf_counter()
        with _during(rank, step + 1, "gradient all-reduce", dp_name):
            if smesh is None:
                dp_bytes = average_gradients(model, ctx.dp_group if ctx else None, dp_size,
                                             ctx.hierarchical if ctx else None)
            else:  # FSDP reduced the gradients in the backward; this is what its replicate all-reduce carried
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                dp_bytes = tensor_bytes(grads) if smesh.replicate_spans_vendors else 0
        dp_s = time.perf_counter() - td
        with _during(rank, step + 1, "global gradient norm", pp_name):
            if shaped:  # over the world, each stage counted once (its replica 0, tp rank 0)
                norm = clip_global_norm(model, cfg.optim.grad_clip, None, n_stages,
                                        counted=dp_rank == 0 and ctx.tp_rank == 0)
            else:
                norm = clip_global_norm(model, cfg.optim.grad_clip, ctx.pp_group if ctx else None, n_stages)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        if step == start:
            st = runner.pipe_stage if isinstance(runner, PipelineRunner) else None
            held = st.fsdp_held if st is not None else None  # FSDP's unsharded buffers
            pipe = {"recv_buffers": st.recv_buffer_bytes(), "held_outputs": st.held_outputs} if st is not None else {}
            if isinstance(runner, ShapedRunner):  # the received inputs it kept for their backward, at most
                pipe = {"recv_buffers": runner.held_inputs}
            _write_memory(cfg.metrics.run_dir, rank, memory_bytes(model, opt) | (held or {}) | pipe)
        loss_t = (loss_sum / cfg.optim.grad_accum).reshape(1)
        if dp_size > 1 and not shaped:  # the shaped runner's loss is already the global mean
            with _during(rank, step + 1, "loss all-reduce", dp_name):
                dist.all_reduce(loss_t, group=ctx.dp_group)
            loss_t /= dp_size
        comm_s, comm_bytes = meter.read(schedule_s, dp_s, dp_bytes)
        ntok = cfg.global_batch * seq * cfg.optim.grad_accum
        metrics.log(step + 1, float(loss_t), ntok, time.perf_counter() - t0, lr, norm, comm_s, comm_bytes,
                    transport_meter.step())
        every = cfg.checkpoint.every
        if (every and (step + 1) % every == 0) or step + 1 == cfg.training.steps:
            shards: dict[str, list[int]] = {}
            state = checkpoint.training_state(model, opt, stage)
            extra = {"step": step + 1, "sched": sched.state_dict(),
                     "data": stream.state_dict() | {"position": stream.position()},
                     "rng": checkpoint.rng_state()}
            if local_shards:  # no gather; their layout goes into this rank's JSON
                state = to_local(state, shards)
                extra["shards"] = {"part": part, "dim": 0, "count": smesh.dp_shard, "tensors": shards}
            with _during(rank, step + 1, "checkpoint save", None):  # a peer that dies meanwhile: one sentence
                checkpoint.save(folder, step + 1, state, extra, meta, rank, shard=part, writer=writer)
            if rank == 0:
                checkpoint.prune(folder, cfg.checkpoint.keep_last)
        report_step(step + 1)  # for the launcher's sentence if this rank dies; no-op outside bimetal's launcher
        if job is not None and metrics.console is not None:  # the next round's restart line counts what it redoes
            job.finished(step + 1)
        faults.after_step(rank, step + 1)  # fault injection for the reliability tests; no-op unless configured
    if cfg.checkpoint.export_hf:
        export_model(model, family, args, split, ctx, cfg.checkpoint.export_hf, cfg.checkpoint.export_shard_bytes)
    # the transports as built (a device-direct group that fell back reports cpu-forward and why)
    transport, fallback = pipeline_transport(ctx, pp_name) if runner is not None and pp_name else ("none", "")
    if shaped:
        from bimetal.parallel.groups import PAIR

        transport = ", ".join(sorted({ctx.built_backend(g.name) if ctx.rank in g.ranks else g.backend
                                      for g in ctx.group_specs if g.axis == PAIR and g.kind == "cross-vendor"}))
        fallback = next((why for name, why in ctx.fallbacks.items() if name.startswith("pp.b")), "")
    dp_x = "none"
    if meter.dp:
        dp_x = ctx.built_backend(dp_name) + (" (hierarchical)" if ctx.hierarchical else " (flat)")
    if ctx is not None:
        write_comm_report(cfg.metrics.run_dir, ctx)
    summary = metrics.summary(transport, meter.source if meter.active else "none", dp_x, fallback=fallback)
    return summary
