"""A small, complete megatron-core training script on bimetal: GPT with Megatron's local layer spec, mock data,
Megatron's DDP and optimizer, any tp x pp x dp layout (with the interleaved schedule, the distributed optimizer
and tied embeddings as options).

    bimetal megatron --simulate nvidia:2,amd:2 -- scripts/megatron_gpt.py --pp 2 --tp 2
    torchrun --nproc-per-node 8 scripts/megatron_gpt.py --pp 2 --tp 4      # one rank per GPU, real cluster

The one bimetal line is ``bimetal.integrations.megatron.initialize()`` before Megatron builds its groups; everything
else is plain Megatron. ``--report FILE`` writes this rank's losses (the last pipeline stage's) and, with
``--count-ops``, the operations each process group carried (``bimetal.integrations.megatron.traffic``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

import bimetal.integrations.megatron as bimetal_megatron
from bimetal.args import ArgumentParser
from bimetal.entry import run_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="scripts/megatron_gpt.py", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved schedule)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4, help="microbatches per step and data-parallel rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tied", action="store_true", help="share the embedding with the output layer")
    p.add_argument("--dist-opt", action="store_true", help="Megatron's distributed optimizer")
    p.add_argument("--batch-p2p", action="store_true", help="batch_p2p_comm=True (batched pipeline sends/receives)")
    p.add_argument("--overlap-p2p", action="store_true",
                   help="overlap_p2p_comm=True (interleaved schedule; needs batch_p2p_comm=False)")
    p.add_argument("--transport", choices=("cpu-forward", "device-direct"),
                   help="of groups that span vendors (default cpu-forward, or bimetal megatron's --transport)")
    p.add_argument("--report", help="write this rank's losses (and op counts) as JSON here")
    p.add_argument("--count-ops", action="store_true", help="count the operations of every process group")
    return p.parse_args(argv)


def mock_batches(args: argparse.Namespace, stream: int) -> Any:
    """Megatron's mock-data idea: random microbatches of tokens, the same for every run with this seed and
    ``stream`` (one per data-parallel rank and step: every model chunk of the rank reads the same microbatches)."""
    micro = 0
    while True:
        g = torch.Generator().manual_seed(args.seed * 1000003 + micro * 1009 + stream)
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "position_ids": torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1).contiguous()}
        micro += 1


def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    # a copy: the schedule divides the loss it is handed by the microbatch count in place
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    device = next(model.parameters()).device
    output = model(batch["tokens"].to(device), batch["position_ids"].to(device), None,
                   labels=batch["labels"].to(device))
    return output, loss_func


def build_model(args: argparse.Namespace, config: Any) -> list[torch.nn.Module]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunks = []
    for vp in range(args.vpp or 1):
        vp_stage = vp if args.vpp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
            max_sequence_length=args.seq,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=args.tied, vp_stage=vp_stage))
    return chunks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bimetal_megatron.initialize(transport=args.transport)  # the one line: before Megatron builds its groups
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    counter = None
    if args.count_ops:
        from bimetal.integrations.megatron.traffic import OpCounter

        counter = OpCounter()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    on_gpu = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        batch_p2p_comm=args.batch_p2p, batch_p2p_sync=False, overlap_p2p_comm=args.overlap_p2p,
        # the sequence-parallel fused kernels and gradient fusion need apex / TransformerEngine
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)
    model = build_model(args, config)
    if on_gpu:
        model = [m.cuda() for m in model]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.dist_opt, overlap_grad_reduce=False)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                     disable_bucketing=(i > 0)) for i, m in enumerate(model)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, use_distributed_optimizer=args.dist_opt, clip_grad=1.0,
                        params_dtype=torch.float32), model)
    config.finalize_model_grads_func = finalize_model_grads
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
    else:
        config.no_sync_func = [m.no_sync for m in model]
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    losses = []
    if counter is not None:
        counter.start()
    for step in range(args.steps):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        data = [mock_batches(args, dp_rank * 1000 + step) for _ in model]
        out = forward_backward(forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
                               model=model if len(model) > 1 else model[0], num_microbatches=args.micro_batches,
                               seq_length=args.seq, micro_batch_size=args.micro_batch, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            step_loss = sum(float(o["lm loss"]) for o in out) / len(out)
            losses.append(step_loss)
            if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
                print(f"step {step + 1}: loss {step_loss:.6f} grad norm {float(grad_norm or 0):.6f}", flush=True)
    if counter is not None:
        counter.stop()
    if args.report:
        rank = torch.distributed.get_rank()
        record: dict[str, Any] = {"rank": rank, "losses": losses}
        if counter is not None:
            record["ops"] = counter.records()
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(f"{args.report}.rank{rank}.json", "w") as f:
            json.dump(record, f, indent=1)
    parallel_state.destroy_model_parallel()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command("megatron", main, sys.argv[1:]))
