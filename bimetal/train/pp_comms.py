"""Pipeline communication: which collectives the pipeline uses, and how much it moves.

``torch.distributed.pipelining`` issues the activation/gradient sends and receives itself (``P2POp`` over
the pp group we hand it). ``MeteredStage`` is its ``PipelineStage`` with two additions and no change to the
data path: it counts the bytes of every send and receive it hands to the schedule, and it times its own
forward/backward compute, so the time a step spends in pipeline communication (issuing and waiting for
transfers, the waits for the peer stage included) is the step's schedule time minus that compute.
Everything else on the pp axis goes through the functions below: the loss broadcast and the gather of
every stage's weights for export.

With tensor parallelism, ``TPBoundary`` keeps cross-vendor bytes independent of tp: a stage's output is cut
along the hidden dim and each tp rank hands only its ``1/tp`` share to its counterpart tp rank of the next
stage (the pp groups pair equal tp positions); the receiving stage all-gathers the shares over its native
tp group before its first layer. Gradients travel the same way backwards (the receiver's input gradient is
its share of a replicated gradient; the sender all-gathers the shares into the replicated gradient its
stage's backward expects). So the schedule's send/receive shapes are the ``1/tp`` shapes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor, Replicate, Shard


def _op_bytes(ops: list[dist.P2POp]) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


def _count_by_peer(counts: dict[int, int], ops: list[dist.P2POp]) -> None:
    for op in ops:
        counts[op.peer] = counts.get(op.peer, 0) + op.tensor.numel() * op.tensor.element_size()


class MeteredStage(PipelineStage):
    """A ``PipelineStage`` that counts transferred bytes and its own compute seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.sent_to: dict[int, int] = {}
        """Bytes sent per peer (global rank): the cross-vendor share where the pairs' groups keep no counters."""
        self.compute_s = 0.0
        self.fsdp_held: dict[str, int] | None = None
        """Under FSDP: what it held unsharded just before the first step's last backward (``memory-rank<R>.json``)."""
        self.held_outputs = 0
        """Most bytes of stage outputs the schedule held at once, read after each forward (``memory-rank<R>.json``):
        outputs wait in torch's forward cache until their gradient (the last stage's logits until the loss's)."""

    def recv_buffer_bytes(self) -> int:
        """Bytes of the receive buffers torch's stage allocated (activations in, gradients back), read from them.

        They exist once the first step has set the stage up, one per microbatch each way, and stay for the job.
        """
        infos = [*self.args_recv_info.values(), *self.grad_recv_info.values()]
        return sum(i.buffer.numel() * i.buffer.element_size() for info in infos for i in info
                   if isinstance(getattr(i, "buffer", None), torch.Tensor))

    def reset_counters(self) -> None:
        self.sent_bytes, self.recv_bytes, self.compute_s = 0, 0, 0.0
        self.sent_to = {}

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.sent_bytes += _op_bytes(ops)
        _count_by_peer(self.sent_to, ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bytes += _op_bytes(ops)
        _count_by_peer(self.sent_to, ops)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.recv_bytes += _op_bytes(ops)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.recv_bytes += _op_bytes(ops)
        return ops

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
                                   ) -> Any:
        """Under FSDP, the last microbatch's backward reduce-scatters block by block as it goes.

        torch's stage turns gradient sync off for every microbatch and reduce-scatters all blocks after the
        last backward (``perform_reduce_grad``, which then finds nothing left to reduce: FSDP's
        post-backward is idempotent). Syncing in the last backward instead lets each block's reduce-scatter
        overlap the backward of the blocks before it, as without a pipeline. With tp the FSDP root sits
        inside ``TPBoundary``, where torch's stage does not look: its flags are set here for every backward
        (else every microbatch would reduce-scatter and reshard).
        """
        fsdp = self.submod if isinstance(self.submod, FSDPModule) else getattr(self.submod, "inner", None)
        if backward_type == "full" and isinstance(fsdp, FSDPModule):
            if last_backward and self.fsdp_held is None:  # the peak: all gathered, earlier gradients accumulated
                from bimetal.train.memory import fsdp_unsharded_bytes

                self.fsdp_held = fsdp_unsharded_bytes(self.submod)
            fsdp.set_is_last_backward(last_backward)
            fsdp.set_reshard_after_backward(last_backward)
            fsdp.set_requires_gradient_sync(last_backward)
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"]), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = super().forward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t0
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for outputs, _ in self.fwd_cache.values() for t in outputs if isinstance(t, torch.Tensor)}
        held |= {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in self.output_chunks if isinstance(t, torch.Tensor)}
        self.held_outputs = max(self.held_outputs, sum(held.values()))
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - t0


class TPBoundary(nn.Module):
    """Around one tp rank's stage: all-gather the input shares over tp, keep only this rank's output share."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh, gather_input: bool, shard_output: bool) -> None:
        super().__init__()
        self.inner, self.mesh = inner, mesh
        self.gather_input, self.shard_output = gather_input, shard_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            # Shard -> Replicate: all-gather forward; backward keeps this rank's slice of the replicated grad.
            x = DTensor.from_local(x, self.mesh, [Shard(-1)], run_check=False).redistribute(
                self.mesh, [Replicate()]).to_local()
        out = self.inner(x)
        if self.shard_output:
            # Replicate -> Shard: a local slice forward; backward all-gathers the gradient shares.
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False).redistribute(
                self.mesh, [Shard(-1)]).to_local().contiguous()
        return out


def broadcast_from_last(value: torch.Tensor, group: dist.ProcessGroup | None, num_stages: int) -> torch.Tensor:
    """Broadcast ``value`` (e.g. the loss, only known on the last stage) to every stage, in place."""
    if num_stages > 1:
        src = dist.get_global_rank(group, num_stages - 1) if group is not None else num_stages - 1
        dist.broadcast(value, src=src, group=group)
    return value


def gather_full_state(stage_params: dict[str, torch.Tensor], full: dict[str, torch.Tensor], owners: list[int],
                      rank: int, dst: int, stage_names: list[list[str]], group: dist.ProcessGroup | None = None
                      ) -> None:
    """Collect every stage's parameters on global rank ``dst`` into ``full`` (name -> tensor), in place.

    ``owners[s]`` is the global rank that sends stage ``s`` (replica 0); ``stage_names[s]`` the names that
    stage holds, in the order both sides iterate. Tensors travel as raw CPU tensors over ``group`` (the
    Gloo world by default), one ``send``/``recv`` per tensor, so nothing is pickled and shapes come from the
    receiver's own full model.
    """
    for s, owner in enumerate(owners):
        if owner == dst:
            if rank == dst:
                for name in stage_names[s]:
                    full[name].copy_(stage_params[name])
            continue
        if rank == owner:
            for name in stage_names[s]:
                dist.send(stage_params[name].detach().float().cpu().contiguous(), dst=dst, group=group)
        elif rank == dst:
            for name in stage_names[s]:
                buf = torch.empty(full[name].shape, dtype=torch.float32)
                dist.recv(buf, src=owner, group=group)
                full[name].copy_(buf)
