"""Rank program for the tensor-parallel tests: a tp=2 model against the same model on one device.

Usage (under ``bimetal launch --simulate nvidia:2``): ``python tp_rank.py OUT_DIR``. Each rank builds the
debug LLaMA-3 (untied, grouped-query attention) and the debug Qwen2 (tied embeddings, qkv bias) twice, splits
one copy with ``apply_tp`` over the context's tp group, and compares loss, every gradient, the global norm,
the collectives issued, and a checkpoint save/load against the single-device copy; a copy built as the trainer
builds it (meta, split, ``materialize``) against the unsplit init, and the trainer's AdamW (foreach, and the
fused kernel's CPU build) on the split model against torch's one-tensor-at-a-time AdamW. Writes
``OUT_DIR/rank<r>.json`` with one entry per check: ``{"case": ..., "ok": bool, "detail": str}``.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from bimetal import models
from bimetal.config import OptimConfig
from bimetal.parallel import ParallelDims, init_parallel
from bimetal.train import checkpoint
from bimetal.train.optim import build_optimizer, clip_global_norm
from bimetal.train.parallelize import materialize
from bimetal.train.tp import apply_tp, full_tensor, tp_mesh

torch.set_num_threads(1)
RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_family(family: str, mesh, results: list[dict], folder: Path) -> None:
    def check(case: str, ok: bool, detail: str = "") -> None:
        results.append({"case": f"{family}: {case}", "ok": bool(ok), "detail": detail})

    args = models.FLAVOURS[family]["debug"]
    ref = models.build_model(family, args, seed=3)
    tp = apply_tp(models.build_model(family, args, seed=3), mesh)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, args.vocab_size, (2, 33), generator=gen)  # same batch on every tp rank
    x, y = ids[:, :-1], ids[:, 1:]

    loss_ref = F.cross_entropy(ref(x).reshape(-1, args.vocab_size), y.reshape(-1))
    loss_ref.backward()
    with CommDebugMode() as comm:
        loss_tp = F.cross_entropy(tp(x).reshape(-1, args.vocab_size), y.reshape(-1))
        loss_tp.backward()
    lt, lr = loss_tp.item(), loss_ref.item()
    check("loss", abs(lt - lr) <= RTOL * abs(lr), f"{lt} vs {lr}")

    # Megatron's count: per block one all-reduce after wo and after w2 forward, and one for the input
    # gradient of attention and of the feed-forward backward; plus the embedding's forward all-reduce and the
    # output head's input-gradient all-reduce, and one all-gather of the logits.
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    n = args.n_layers
    check("all-reduces", counts.get("all_reduce", 0) == 4 * n + 2, str(counts))
    check("all-gathers", counts.get("all_gather_into_tensor", 0) == 1, str(counts))

    got = dict(tp.named_parameters())
    check("names", sorted(got) == sorted(dict(ref.named_parameters())), str(sorted(got)))
    split = [n for n, p in got.items() if isinstance(p, DTensor)]
    expect_split = [n for n in got if n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight",
                                                  "w2.weight", "w3.weight", "wq.bias", "wk.bias", "wv.bias"))
                    or n in ("tok_embeddings.weight", "output.weight")]
    check("split parameters", sorted(split) == sorted(expect_split), str(sorted(set(split) ^ set(expect_split))))
    if args.tie_embeddings:
        check("tie kept", tp.output.weight is tp.tok_embeddings.weight)
    check_materialize_and_step(family, mesh, ref, x, y, check)
    for name, p in ref.named_parameters():
        g = full_tensor(got[name].grad)
        check(f"grad {name}", rel(g, p.grad) <= RTOL, f"rel {rel(g, p.grad):.2e}")
    norm_ref, norm_tp = clip_global_norm(ref, 0.0, None, 1), clip_global_norm(tp, 0.0, None, 1)
    check("global norm", abs(norm_tp - norm_ref) <= RTOL * norm_ref, f"{norm_tp} vs {norm_ref}")

    # Checkpoint after one AdamW step, through checkpoint.save/load as the trainer calls them (tp rank 0
    # writes): the files hold whole tensors with the single-device shapes, equal to the gathered slices;
    # loaded into a fresh tp model each rank gets its own slices back bit for bit, and loaded into an
    # unsplit model the whole tensors.
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-3, foreach=False)
    opt.step()
    rank = dist.get_rank()
    path = checkpoint.save(folder / family, 1, checkpoint.training_state(tp, opt, 0), {"step": 1}, {}, rank,
                           writer=rank == 0)
    stored = dcp.FileSystemReader(str(path / "stage0")).read_metadata().state_dict_metadata
    for name, p in ref.named_parameters():
        size = stored[f"model.{name}"].size
        check(f"stored whole {name}", tuple(size) == tuple(p.shape), str(tuple(size)))

    def reload(model: torch.nn.Module) -> torch.optim.Optimizer:
        o = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        state = checkpoint.training_state(model, o, 0)
        checkpoint.load(path, state, 0)
        checkpoint.apply_training_state(model, o, 0, state)
        return o

    fresh = apply_tp(models.build_model(family, args, seed=99), mesh)
    fresh_opt = reload(fresh)
    for name, p in fresh.named_parameters():
        mine = got[name]
        same_split = isinstance(p, DTensor) == isinstance(mine, DTensor) and (
            not isinstance(p, DTensor) or (p.placements == mine.placements and torch.equal(p.to_local(),
                                                                                         mine.to_local())))
        check(f"reloaded slice {name}", same_split and torch.equal(_local(p), _local(mine)))
        m, m0 = fresh_opt.state[p]["exp_avg"], opt.state[mine]["exp_avg"]
        check(f"reloaded exp_avg {name}", torch.equal(_local(m), _local(m0)))
    whole = models.build_model(family, args, seed=99)
    reload(whole)
    for name, p in whole.named_parameters():
        check(f"reloaded unsplit {name}", torch.equal(p.detach(), full_tensor(got[name].detach())))


def check_materialize_and_step(family: str, mesh, ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                               check) -> None:
    """As the trainer builds a stage: laid out on the meta device, split, then ``materialize``d; every rank's
    slices are the unsplit init bit for bit (the tie kept). Then one step of the trainer's AdamW on the split
    model, foreach and (the CPU build of) the fused kernel, against torch's one-tensor-at-a-time AdamW on the
    same split weights and gradients."""
    args = models.FLAVOURS[family]["debug"]
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    steps = {}
    for impl in ("one-at-a-time", "cpu", "cuda"):  # build_optimizer on a CPU (foreach), on a GPU (fused)
        lazy = apply_tp(models.build_stage(family, args, list(range(args.n_layers)), True, True, device="meta"), mesh)
        materialize(lazy, torch.device("cpu"), 3)
        params = dict(lazy.named_parameters())
        check("materialized slices", sorted(params) == sorted(init) and all(
            torch.equal(full_tensor(p.detach()), init[n]) for n, p in params.items()))
        if args.tie_embeddings:
            check("materialized tie kept", lazy.output.weight is lazy.tok_embeddings.weight)
        F.cross_entropy(lazy(x).reshape(-1, args.vocab_size), y.reshape(-1)).backward()
        opt = build_optimizer(lazy, OptimConfig(lr=1e-2), device_type="cpu" if impl == "one-at-a-time" else impl)
        groups = [(g["foreach"], g["fused"]) for g in opt.param_groups]
        if impl == "one-at-a-time":
            for g in opt.param_groups:
                g["foreach"] = False
        else:
            want = [(True, None) if impl == "cpu" else (None, True)] * 2
            if family == "qwen2":  # no FSDP: plain norm weights beside split qkv biases in one group
                want[1] = (False, False)
            check(f"{impl} AdamW groups", groups == want, str(groups))
        before = {n: _local(p).detach().clone() for n, p in params.items()}
        opt.step()
        steps[impl] = {n: _local(p).detach() for n, p in params.items()}
        check(f"{impl} AdamW moved every slice", all(not torch.equal(steps[impl][n], before[n]) for n in params))
    for impl in ("cpu", "cuda"):
        for n, got in steps[impl].items():
            ref_t = steps["one-at-a-time"][n]
            check(f"{impl} AdamW step {n}", rel(got, ref_t) <= 1e-6, f"rel {rel(got, ref_t):.2e}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def main() -> None:
    out = sys.argv[1]
    ctx = init_parallel(ParallelDims(tp=2), timeout=timedelta(seconds=60), print_table=False)
    mesh = tp_mesh(ctx.tp_group, torch.device("cpu"))
    results: list[dict] = []
    for family in ("llama3", "qwen2"):
        try:
            run_family(family, mesh, results, Path(out))
        except Exception:  # noqa: BLE001  (recorded as a failed case; the test prints it)
            results.append({"case": family, "ok": False, "detail": traceback.format_exc()[-2000:]})
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(results, f)
    ctx.destroy()


if __name__ == "__main__":
    from launcher import rank_main

    rank_main(main)
