"""The training loop: one pipeline stage x one dp replica per rank.

Per step: ``grad_accum`` schedule runs (each over ``parallel.microbatches`` microbatches), gradient
average over the dp group, one global-norm clip over the pp group, AdamW, lr schedule, metrics,
checkpoint. Single-process runs (pp=dp=1, no process group) use the same loop with a plain forward.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bimetal.errors import UserError
from bimetal.train import checkpoint
from bimetal.train.config import TrainConfig
from bimetal.train.data import TokenStream, load_tokens
from bimetal.train.metrics import StepMetrics
from bimetal.train.optim import average_gradients, build_optimizer, build_scheduler, clip_global_norm
from bimetal.train.pipeline import PipelineRunner, stage_layer_ids
from bimetal.train.tokenizer import build_tokenizer


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` on this rank (world from the torchrun env when pp*dp > 1); returns the summary."""
    tok = build_tokenizer(cfg.data.tokenizer)
    tokens = load_tokens(cfg.data.path, tok, cfg.data.bin_dtype)  # a missing file fails before any model work
    from bimetal import models  # B's package; imported late so config checks need no model code

    torch.manual_seed(cfg.training.seed)
    torch.set_num_threads(1)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    family, flavour = cfg.model.family, cfg.model.flavour
    try:
        args = models.FLAVOURS[family][flavour]
    except KeyError:
        raise UserError(f"model {family}/{flavour} is unknown; set model.family and model.flavour to a known "
                        "flavour.") from None
    split = cfg.stage_split(args.n_layers)

    distributed = cfg.parallel.pp * cfg.parallel.dp > 1
    ctx = None
    if distributed:
        from bimetal.parallel import ParallelDims, init_parallel

        ctx = init_parallel(ParallelDims(pp=cfg.parallel.pp, dp=cfg.parallel.dp),
                            transports={"pp": cfg.parallel.pp_transport, "dp": cfg.parallel.dp_transport},
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    stage, n_stages = (ctx.stage, ctx.num_stages) if ctx else (0, 1)
    dp_rank, dp_size = (ctx.dp_rank, ctx.dp_size) if ctx else (0, 1)
    rank = ctx.rank if ctx else 0
    try:
        model = models.build_model(family, args)
        models.prune_to_stage(model, stage_layer_ids(split, stage), stage == 0, stage == n_stages - 1)
        opt = build_optimizer(model, cfg.optim)
        sched = build_scheduler(opt, cfg.optim, cfg.training.steps)
        stream = TokenStream(tokens, cfg.data.seq_len, cfg.data.batch_size, dp_rank, dp_size, cfg.training.seed)
        mb = cfg.data.batch_size // cfg.parallel.microbatches
        runner = None
        if n_stages > 1:
            hidden = torch.zeros(mb, cfg.data.seq_len, args.dim)
            ids = torch.zeros(mb, cfg.data.seq_len, dtype=torch.long)
            logits = torch.zeros(mb, cfg.data.seq_len, args.vocab_size)
            runner = PipelineRunner(model, stage, n_stages, ctx.pp_group, cfg.parallel.microbatches,
                                    cfg.parallel.schedule, _loss_fn, torch.device("cpu"),
                                    ids if stage == 0 else hidden, logits if stage == n_stages - 1 else hidden)
        folder = cfg.checkpoint.folder or f"{cfg.metrics.run_dir}/checkpoints"
        meta = {"family": family, "flavour": flavour, "layers_per_stage": split, "dp": dp_size}
        start = 0
        if cfg.checkpoint.resume and (path := checkpoint.latest(folder)) is not None:
            checkpoint.check_meta(path, meta)
            state = {f"stage{stage}": {"model": model.state_dict(), "optim": opt.state_dict()}}
            extra = checkpoint.load(path, state, rank)
            model.load_state_dict(state[f"stage{stage}"]["model"])
            opt.load_state_dict(state[f"stage{stage}"]["optim"])
            sched.load_state_dict(extra["sched"])
            stream.load_state_dict(extra["data"])
            checkpoint.set_rng_state(extra["rng"])
            start = extra["step"]
        metrics = StepMetrics(cfg.metrics.run_dir, rank, float(model.flops_per_token(cfg.data.seq_len))
                              if hasattr(model, "flops_per_token") else 0.0, None, cfg.metrics.log_every,
                              cfg.metrics.tensorboard)
        for step in range(start, cfg.training.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros(())
            for _ in range(cfg.optim.grad_accum):
                x, y = stream.next_batch()
                if runner is not None:
                    loss_sum += runner.step(x if stage == 0 else None, y if stage == n_stages - 1 else None)
                else:
                    # Same microbatch split and mean as the pipeline, so the two paths agree numerically.
                    parts = [_loss_fn(model(xc), yc) / cfg.parallel.microbatches
                             for xc, yc in zip(x.chunk(cfg.parallel.microbatches), y.chunk(cfg.parallel.microbatches))]
                    loss = torch.stack(parts).sum()
                    loss.backward()
                    loss_sum += loss.detach()
            if cfg.optim.grad_accum > 1:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad /= cfg.optim.grad_accum
            average_gradients(model, ctx.dp_group if ctx else None, dp_size)
            norm = clip_global_norm(model, cfg.optim.grad_clip, ctx.pp_group if ctx else None, n_stages)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            loss_v = float(loss_sum) / cfg.optim.grad_accum
            if dp_size > 1:
                t = torch.tensor([loss_v])
                dist.all_reduce(t, group=ctx.dp_group)
                loss_v = float(t) / dp_size
            ntok = cfg.data.batch_size * cfg.data.seq_len * cfg.optim.grad_accum * dp_size
            metrics.log(step + 1, loss_v, ntok, time.perf_counter() - t0, lr, norm, 0.0, 0, max(1, dp_size * n_stages))
            every = cfg.checkpoint.every
            if (every and (step + 1) % every == 0) or step + 1 == cfg.training.steps:
                checkpoint.save(folder, step + 1, {f"stage{stage}": {"model": model.state_dict(),
                                                                     "optim": opt.state_dict()}},
                                {"step": step + 1, "sched": sched.state_dict(), "data": stream.state_dict(),
                                 "rng": checkpoint.rng_state()}, meta, rank)
        return metrics.summary(cfg.parallel.pp_transport if n_stages > 1 else "none")
    finally:
        if ctx is not None:
            ctx.destroy()
