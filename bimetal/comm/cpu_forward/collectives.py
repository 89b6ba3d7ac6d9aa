"""cpu-forward's collectives: each one a Gloo op on the stripes, run on the group's collective worker in issue
order (the same on every rank).

CPU tensors go to Gloo as they are (a contiguous host stand-in for a strided or device one). Device tensors
(or CPU ones with ``BIMETAL_CF_FORCE_STAGING=1``) run in rounds through the pinned pool (``rounds``,
``staged_ops``), except the coalesced all-gather of lists, which stages whole tensors per call; all-to-all with
uneven splits first agrees on its longest part (one 8-byte all-reduce), then goes in rounds as the others
do. Element-wise ops on large tensors are split over the stripes. Collectives do not fail over: on a
degraded stripe they fail with an error saying so. Each function is the group's ``_do_<op>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from bimetal.comm.base import OpRecord
from bimetal.comm.cpu_forward import rounds
from bimetal.comm.cpu_forward import staged_ops as so
from bimetal.comm.cpu_forward.staging import OpEnd, capture, copy_to_device, is_device, on_stream, record_end, settle
from bimetal.comm.cpu_forward.state import GroupState
from bimetal.comm.cpu_forward.work import Deadline

Host = Callable[[torch.Tensor], torch.Tensor]
StagedPlan = Callable[[Host, so.Stripe], list[rounds.Staged]]


def run(g: GroupState, op: OpRecord, ins: list[torch.Tensor], outs: list[torch.Tensor],
        call: Callable[[Host], list[Any]], staged: StagedPlan | None = None,
        unpack: Callable[[Host], None] | None = None) -> dist.Work:
    """Run ``call(host)`` on the collective worker; ``host(t)`` is t's host (contiguous) stand-in, and
    ``unpack(host)``, when given, runs once ``call``'s works completed (before the stand-ins are copied to the
    outputs). With device tensors (or staging forced), ``staged(flat, stripe)`` instead: the op in rounds
    through the pool."""
    if staged is not None and g.stages(*ins, *outs):
        end = OpEnd((ins or outs)[0].device)
        return g.workers.submit("collective", op, _staged_body(g, ins, outs, staged, end), end)

    def body(d: Deadline) -> list[torch.Tensor]:  # returns the outputs: the future's value, like NCCL's
        stand_in: dict[int, torch.Tensor] = {}
        in_ids = {id(t) for t in ins}

        def host(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in stand_in:
                if not is_device(t) and t.is_contiguous():
                    stand_in[id(t)] = t
                elif id(t) in in_ids:
                    stand_in[id(t)] = t.detach().to("cpu", copy=True).contiguous()
                else:
                    stand_in[id(t)] = torch.empty(t.shape, dtype=t.dtype)
            return stand_in[id(t)]

        for w in call(host):
            d.wait(w)
        if unpack is not None:
            unpack(host)
        nbytes = 0
        for t in outs:
            h = stand_in.get(id(t))
            if h is not None and h is not t:
                t.copy_(h)
                nbytes += h.numel() * h.element_size()
        nbytes += sum(t.numel() * t.element_size() for t in ins if is_device(t))
        g.counters.add(bytes_staged=nbytes)
        return list(outs)

    return g.workers.submit("collective", op, body)


def _staged_body(g: GroupState, ins: list[torch.Tensor], outs: list[torch.Tensor],
                 staged: StagedPlan, end: OpEnd) -> Callable[[Deadline], list[torch.Tensor]]:
    """On the caller's thread: flat contiguous views (a contiguous copy, made on the producer's stream, for a
    strided tensor) and the producer's event; the returned body runs the rounds on the worker. The op
    completes once its last host-to-device copies are enqueued (``end`` holds their event; the caller's
    ``wait()`` orders its stream on it); the worker then waits for them and gives their slabs back."""
    flat: dict[int, torch.Tensor] = {}
    for t in (*ins, *outs):
        if id(t) not in flat:
            if t.is_contiguous():
                flat[id(t)] = t.detach().view(-1)
            elif any(t is i for i in ins):
                flat[id(t)] = t.detach().contiguous().view(-1)
            else:
                flat[id(t)] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    ready = capture([*ins, *outs])
    device = end.device

    def body(d: Deadline) -> list[torch.Tensor]:
        streams = g.streams.pair(device)
        ops = staged(lambda t: flat[id(t)], lambda i: g.stripe(i % len(g.stripes)))
        kept: list[tuple[object, torch.Tensor]] = []
        try:
            nbytes = sum(rounds.run(s, g.pool, streams, ready, d, g.timeout, kept if i == len(ops) - 1 else None)
                         for i, s in enumerate(ops))
            for t in outs:
                if not t.is_contiguous():  # (device to device, after the rounds' copies on the same stream)
                    copy_to_device(flat[id(t)].view(t.shape), t, streams[1])
            g.counters.add(bytes_staged=nbytes)
            end.event = record_end(streams[1])
            with on_stream(streams[1]):  # a device-aware future records the stream's position here
                d.complete(list(outs))
        finally:
            settle(kept, g.pool)
        return list(outs)

    return body


def _parts(g: GroupState, h: torch.Tensor) -> list[torch.Tensor]:
    """An element-wise op's tensor split over the stripes (large tensors only)."""
    k = len(g.stripes)
    if k == 1 or h.numel() * h.element_size() < 2 * g.options.chunk_bytes:
        return [h]
    return [p for p in h.view(-1).tensor_split(k) if p.numel()]


def _with(options: Any, **fields: Any) -> Any:
    """A fresh torch options object with ``fields`` set (Gloo gets its own, never the caller's)."""
    o = options()
    for name, value in fields.items():
        setattr(o, name, value)
    return o


def allreduce(g: GroupState, op: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
    def call(host: Host) -> list[Any]:
        return [g.stripe(i).allreduce([part], _with(AllreduceOptions, reduceOp=opts.reduceOp))
                for t in tensors for i, part in enumerate(_parts(g, host(t)))]

    return run(g, op, tensors, tensors, call, lambda f, st: [so.allreduce(f(t), st, opts.reduceOp) for t in tensors])


def broadcast(g: GroupState, op: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
    root = opts.rootRank

    def call(host: Host) -> list[Any]:
        return [g.stripe(i).broadcast([part], _with(BroadcastOptions, rootRank=root))
                for t in tensors for i, part in enumerate(_parts(g, host(t)))]

    return run(g, op, tensors if g.rank == root else [], tensors, call,
               lambda f, st: [so.broadcast(f(t), st, root, g.rank) for t in tensors])


def allgather(g: GroupState, op: OpRecord, output_lists: list[list[torch.Tensor]],
              inputs: list[torch.Tensor], opts: Any) -> dist.Work:
    outs = [t for lst in output_lists for t in lst]
    return run(g, op, inputs, outs, lambda h: [g.stripe(0).allgather(
        [[h(t) for t in lst] for lst in output_lists], [h(t) for t in inputs], AllgatherOptions())],
        lambda f, st: [so.all_gather([f(o) for o in lst], f(i), st) for lst, i in zip(output_lists, inputs)])


def allgather_coalesced(g: GroupState, op: OpRecord, output_lists: list[list[torch.Tensor]],
                        inputs: list[torch.Tensor], opts: Any) -> dist.Work:
    outs = [t for lst in output_lists for t in lst]
    return run(g, op, inputs, outs, lambda h: [g.stripe(0).allgather_coalesced(
        [[h(t) for t in lst] for lst in output_lists], [h(t) for t in inputs], AllgatherOptions())])


def all_gather_into(g: GroupState, op: OpRecord, output: torch.Tensor, input: torch.Tensor,
                    opts: Any) -> dist.Work:
    return run(g, op, [input], [output], lambda h: [
        g.stripe(0)._allgather_base(h(output), h(input), AllgatherOptions())],
        lambda f, st: [so.all_gather_into(f(output), f(input), st, g.size)])


def all_gather_into_coalesced(g: GroupState, op: OpRecord, outputs: list[torch.Tensor],
                              inputs: list[torch.Tensor], opts: Any) -> dist.Work:
    return run(g, op, inputs, outputs, lambda h: [
        g.stripe(0)._allgather_base(h(o), h(i), AllgatherOptions()) for o, i in zip(outputs, inputs)],
        lambda f, st: [so.all_gather_into(f(o), f(i), st, g.size) for o, i in zip(outputs, inputs)])


def reduce_scatter(g: GroupState, op: OpRecord, outputs: list[torch.Tensor],
                   input_lists: list[list[torch.Tensor]], opts: Any) -> dist.Work:
    ins = [t for lst in input_lists for t in lst]
    return run(g, op, ins, outputs, lambda h: [g.stripe(0).reduce_scatter(
        [h(t) for t in outputs], [[h(t) for t in lst] for lst in input_lists],
        _with(ReduceScatterOptions, reduceOp=opts.reduceOp))], lambda f, st: [
        so.reduce_scatter(f(o), [f(t) for t in lst], st, opts.reduceOp) for o, lst in zip(outputs, input_lists)])


def reduce_scatter_into(g: GroupState, op: OpRecord, output: torch.Tensor, input: torch.Tensor,
                        opts: Any) -> dist.Work:
    return run(g, op, [input], [output], lambda h: [g.stripe(0)._reduce_scatter_base(
        h(output), h(input), _with(ReduceScatterOptions, reduceOp=opts.reduceOp))], lambda f, st: [
        so.reduce_scatter_into(f(output), f(input), st, g.size, opts.reduceOp)])


def reduce_scatter_into_coalesced(g: GroupState, op: OpRecord, outputs: list[torch.Tensor],
                                  inputs: list[torch.Tensor], opts: Any) -> dist.Work:
    return run(g, op, inputs, outputs, lambda h: [g.stripe(0)._reduce_scatter_base(
        h(out), h(inp), _with(ReduceScatterOptions, reduceOp=opts.reduceOp)) for out, inp in zip(outputs, inputs)],
        lambda f, st: [so.reduce_scatter_into(f(o), f(i), st, g.size, opts.reduceOp)
                       for o, i in zip(outputs, inputs)])


def alltoall_single(g: GroupState, op: OpRecord, output: torch.Tensor, input: torch.Tensor,
                    output_split_sizes: list[int], input_split_sizes: list[int], opts: Any) -> dist.Work:
    size = g.size
    equal = all(len(set(s)) <= 1 for s in (output_split_sizes, input_split_sizes)) and \
        input.numel() % size == 0 and output.numel() == input.numel()

    def uneven(f: Host, st: so.Stripe) -> list[rounds.Staged]:
        outs = _split(f(output), output, output_split_sizes, size)
        ins = _split(f(input), input, input_split_sizes, size)
        return [so.all_to_all_uneven(outs, ins, st, _agreed_unit(g, outs + ins))]

    return run(g, op, [input], [output], lambda h: [g.stripe(0).alltoall_base(
        h(output), h(input), output_split_sizes, input_split_sizes, AllToAllOptions())],
        (lambda f, st: [so.all_to_all_equal(f(output), f(input), st, size)]) if equal else uneven)


def alltoall(g: GroupState, op: OpRecord, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
             opts: Any) -> dist.Work:
    equal = len({t.numel() for t in (*inputs, *outputs)}) == 1

    def uneven(f: Host, st: so.Stripe) -> list[rounds.Staged]:
        outs, ins = [f(t) for t in outputs], [f(t) for t in inputs]
        return [so.all_to_all_uneven(outs, ins, st, _agreed_unit(g, outs + ins))]

    # Gloo's list all-to-all is missing from some torch releases (2.11): one alltoall_base on packed copies
    outs_n, ins_n = [t.numel() for t in outputs], [t.numel() for t in inputs]
    packed_out: list[torch.Tensor] = []

    def call(h: Host) -> list[Any]:
        packed_out.append(torch.empty(sum(outs_n), dtype=outputs[0].dtype))
        packed_in = torch.cat([h(t).reshape(-1) for t in inputs])
        return [g.stripe(0).alltoall_base(packed_out[0], packed_in, outs_n, ins_n, AllToAllOptions())]

    def unpack(h: Host) -> None:
        for t, part in zip(outputs, packed_out[0].split(outs_n)):
            h(t).view(-1).copy_(part)

    def equal_plan(f: Host, st: so.Stripe) -> list[rounds.Staged]:
        return [so.all_to_all([f(t) for t in outputs], [f(t) for t in inputs], st)]

    return run(g, op, inputs, outputs, call, equal_plan if equal else uneven, unpack)


def _split(flat: torch.Tensor, t: torch.Tensor, splits: list[int], size: int) -> list[torch.Tensor]:
    """``t``'s flat view cut into its per-peer parts: ``splits`` rows of dim 0 each (equal parts when empty)."""
    row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1
    counts = [s * row for s in splits] if splits else [t.numel() // size] * size
    return list(flat.split(counts))


def _agreed_unit(g: GroupState, parts: list[torch.Tensor]) -> int:
    """The longest part of an uneven all-to-all on any rank (one 8-byte max all-reduce on stripe 0, in the
    collective's turn): every rank must cut it into the same rounds, and each knows only its own splits."""
    longest = torch.tensor([max((p.numel() for p in parts), default=0)], dtype=torch.int64)
    o = AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    g.stripe(0).allreduce([longest], o).wait()
    return int(longest.item())


def barrier(g: GroupState, op: OpRecord, opts: Any) -> dist.Work:
    return run(g, op, [], [], lambda h: [g.stripe(0).barrier(BarrierOptions())])


def scatter(g: GroupState, op: OpRecord, outputs: list[torch.Tensor],
            input_lists: list[list[torch.Tensor]], opts: Any) -> dist.Work:
    ins = [t for lst in input_lists for t in lst]
    return run(g, op, ins, outputs, lambda h: [g.stripe(0).scatter(
        [h(t) for t in outputs], [[h(t) for t in lst] for lst in input_lists],
        _with(ScatterOptions, rootRank=opts.rootRank))], lambda f, st: [
        so.scatter(f(outputs[0]), [f(t) for t in ins], st, opts.rootRank, g.size)])


def gather(g: GroupState, op: OpRecord, output_lists: list[list[torch.Tensor]],
           inputs: list[torch.Tensor], opts: Any) -> dist.Work:
    outs = [t for lst in output_lists for t in lst]
    return run(g, op, inputs, outs, lambda h: [g.stripe(0).gather(
        [[h(t) for t in lst] for lst in output_lists], [h(t) for t in inputs],
        _with(GatherOptions, rootRank=opts.rootRank))], lambda f, st: [
        so.gather([f(t) for t in outs], f(inputs[0]), st, opts.rootRank, g.size)])


def reduce(g: GroupState, op: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
    return run(g, op, tensors, tensors, lambda h: [g.stripe(0).reduce([h(t) for t in tensors], _with(
        ReduceOptions, reduceOp=opts.reduceOp, rootRank=opts.rootRank, rootTensor=opts.rootTensor))], lambda f, st: [
        so.reduce(f(t), st, opts.reduceOp, opts.rootRank) for t in tensors])
