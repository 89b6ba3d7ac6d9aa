"""The pipeline of a per-stage layout: stages of different dp and tp, joined by boundary pieces.

torch's pipelining schedules pair one rank of each stage (a pipeline group per replica and tp position); when
stages differ in dp or tp a receiver assembles its rows and columns from several senders, which those schedules
cannot express. This runner is the naive reference for that case (picotron style): ``parallel.schedule``'s
order (1F1B, or GPipe: all forwards, then all backwards), with explicit ``isend``/``irecv`` of each piece
(``bimetal.parallel.boundary``) over its pair's own group (native inside a vendor, the pp transport across).

Per global microbatch of ``R`` rows, replica ``r`` of a stage with ``dp`` replicas holds rows
``[r R/dp, (r+1) R/dp)``; stage 0 and the last stage read their rows of the global batch (every rank reads the
same global batch, so the data position is the same on every rank). With tp, a sender's output is replicated
over its tp ranks and tp rank ``t`` sends only its columns; a receiver gathers the columns over its tp group
(and back: its input gradient is replicated, each tp rank returns its columns; a sender all-gathers the
gradient columns before its backward).

Gradient scale: each stage averages its gradients over its own dp (``average_gradients`` or FSDP's
reduce-scatter), so a replica's gradient must be ``dp`` times its rows' share of the global-mean loss. The last
stage's backward loss is ``dp_last * sum(CE) / (B * seq)``; a gradient crossing from stage s+1 to s is scaled by
``dp_s / dp_{s+1}``. The reported loss is the global mean, summed over the world.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from bimetal.parallel.boundary import Piece, boundary_pieces, pair_name


class ShapedRunner:
    """One rank's stage in a per-stage layout; ``step`` runs forward and backward of all microbatches."""

    def __init__(self, module: nn.Module, ctx: Any, microbatches: int, global_batch: int, seq: int, hidden: int,
                 boundary_dtype: torch.dtype, device: torch.device, schedule: str = "1f1b") -> None:
        self.module, self.ctx, self.device, self.schedule = module, ctx, device, schedule
        layout, me = ctx.layout, ctx.rank
        self.stage, self.n_stages = ctx.stage, ctx.num_stages
        self.is_first, self.is_last = self.stage == 0, self.stage == self.n_stages - 1
        self.microbatches, self.seq, self.hidden, self.dtype = microbatches, seq, hidden, boundary_dtype
        self.rows = global_batch // microbatches  # rows of one global microbatch
        dims = layout.dims
        self.dp, self.tp = dims.stage_dp(self.stage), dims.stage_tp(self.stage)
        mine = self.rows // self.dp
        self.my_rows = (ctx.dp_rank * mine, (ctx.dp_rank + 1) * mine)
        self.global_batch = global_batch
        # this rank's pieces: received from the stage before, sent to the stage after
        self.incoming: list[Piece] = [] if self.is_first else [
            p for p in boundary_pieces(layout, self.stage - 1, self.rows, hidden) if p.receiver == me]
        self.outgoing: list[Piece] = [] if self.is_last else [
            p for p in boundary_pieces(layout, self.stage, self.rows, hidden) if p.sender == me]
        self.next_dp = dims.stage_dp(self.stage + 1) if not self.is_last else 1
        self.groups = {p: ctx.groups[pair_name(layout, p.sender, p.receiver)] for p in self.incoming + self.outgoing}
        self.compute_s = 0.0
        self.held_inputs = 0
        """Most bytes of received (gathered) microbatch inputs held at once, waiting for their backward."""
        self._holding = 0
        self.cross_sent = 0
        """Bytes this rank sent to a rank of another vendor (activations and gradients), since the start."""
        self._cross = {p: ctx.view.vendor_of(p.sender) != ctx.view.vendor_of(p.receiver)
                       for p in self.incoming + self.outgoing}

    @property
    def crosses(self) -> bool:
        """Whether this rank exchanges pieces with a rank of another vendor."""
        return any(self._cross.values())

    def cross_counters(self) -> list[Any] | None:
        """The transport counters of this rank's cross-vendor pair groups; None when one keeps none (Gloo)."""
        crossing = {id(pg): pg for p, pg in self.groups.items() if self._cross[p]}.values()
        counters = [getattr(pg, "counters", None) for pg in crossing]
        return None if any(c is None for c in counters) else counters

    def _cols(self, tp: int, t: int) -> tuple[int, int]:
        width = self.hidden // tp
        return t * width, (t + 1) * width

    def _send(self, piece: Piece, block: torch.Tensor, peer: int, works: list[Any]) -> None:
        block = block.contiguous()
        if self._cross[piece]:
            self.cross_sent += block.numel() * block.element_size()
        pg = self.groups[piece]
        works.append(dist.isend(block, group=pg, group_dst=dist.get_group_rank(pg, peer)))

    def _recv(self, piece: Piece, peer: int, works: list[Any]) -> torch.Tensor:
        shape = (piece.rows[1] - piece.rows[0], self.seq, piece.cols[1] - piece.cols[0])
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        pg = self.groups[piece]
        works.append(dist.irecv(buf, group=pg, group_src=dist.get_group_rank(pg, peer)))
        return buf

    def _assemble(self, pieces: list[Piece], peer_of: Callable[[Piece], int], rows: tuple[int, int],
                  cols: tuple[int, int]) -> torch.Tensor:
        """Receive ``pieces`` and place them in one ``[rows, seq, cols]`` block (this rank's share)."""
        works: list[Any] = []
        bufs = [(p, self._recv(p, peer_of(p), works)) for p in pieces]
        for w in works:
            w.wait()
        out = torch.empty((rows[1] - rows[0], self.seq, cols[1] - cols[0]), dtype=self.dtype, device=self.device)
        for p, buf in bufs:
            out[p.rows[0] - rows[0]:p.rows[1] - rows[0], :, p.cols[0] - cols[0]:p.cols[1] - cols[0]] = buf
        return out

    def _gather_cols(self, share: torch.Tensor) -> torch.Tensor:
        """All tp ranks' column shares of a block, joined along the hidden dimension (native tp group)."""
        if self.tp == 1:
            return share
        parts = [torch.empty_like(share) for _ in range(self.tp)]
        dist.all_gather(parts, share.contiguous(), group=self.ctx.tp_group)
        return torch.cat(parts, dim=-1)

    def _set_sync(self, last: bool) -> None:
        if isinstance(self.module, FSDPModule):  # reduce-scatter only in the last backward
            self.module.set_is_last_backward(last)
            self.module.set_reshard_after_backward(last)
            self.module.set_requires_gradient_sync(last)

    def order(self) -> list[tuple[str, int]]:
        """This stage's sequence of ("f", microbatch) and ("b", microbatch): GPipe (every forward, then every
        backward) or 1F1B (``stages - stage - 1`` forwards to fill the pipeline, then one forward and one backward
        in turn, then the remaining backwards); every rank of a stage runs the same order."""
        m = self.microbatches
        if self.schedule == "gpipe":
            return [("f", i) for i in range(m)] + [("b", i) for i in range(m)]
        warm = min(self.n_stages - self.stage - 1, m)
        out = [("f", i) for i in range(warm)]
        for i in range(m - warm):
            out += [("f", warm + i), ("b", i)]
        return out + [("b", i) for i in range(m - warm, m)]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch of the global batch ``x``/``y`` (``[B, seq]``, read by every
        rank); returns the global-mean loss (a 0-d float tensor, the same on every rank)."""
        lo, hi = self.my_rows
        my_cols = self._cols(self.tp, self.ctx.tp_rank)
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        # Sends in flight by (kind, microbatch), waited for (and their blocks freed) once certainly received: a
        # forward's when its gradient came back, a backward's at the next backward; the rest at the end.
        sends: dict[tuple[str, int], list[Any]] = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for kind, m in self.order():
            if kind == "f":
                held[m] = self._forward(m, x, y, my_cols, sends.setdefault(("f", m), []), loss_sum)
            else:
                for w in sends.pop(("b", m - 1), []):
                    w.wait()
                self._backward(m, *held.pop(m), my_cols, sends.setdefault(("b", m), []))
                for w in sends.pop(("f", m), []):
                    w.wait()
        for works in sends.values():
            for w in works:
                w.wait()
        # the global mean: only the last stage's tp rank 0 of each replica counts its rows
        counted = self.is_last and self.ctx.tp_rank == 0
        total = (loss_sum if counted else torch.zeros_like(loss_sum)).cpu().double()
        dist.all_reduce(total)  # the world (Gloo, CPU)
        return (total / (self.global_batch * self.seq)).float().to(self.device)

    def _forward(self, m: int, x: torch.Tensor, y: torch.Tensor, my_cols: tuple[int, int], sends: list[Any],
                 loss_sum: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Microbatch ``m`` forward: receive (or read) this rank's rows, run the stage, send the pieces on; returns
        what its backward needs (the input, the output or the scaled loss)."""
        lo, hi = self.my_rows
        base = m * self.rows
        inp: torch.Tensor | None = None
        if self.is_first:
            xin = x[base + lo:base + hi]
        else:
            share = self._assemble(self.incoming, lambda p: p.sender, (lo, hi), my_cols)
            inp = self._gather_cols(share).detach().requires_grad_(True)
            xin = inp
            self._holding += inp.numel() * inp.element_size()
            self.held_inputs = max(self.held_inputs, self._holding)
        t0 = time.perf_counter()
        out = self.module(xin)
        if self.is_last:
            ce = F.cross_entropy(out.float().reshape(-1, out.size(-1)), y[base + lo:base + hi].reshape(-1),
                                 reduction="sum")
            loss_sum += ce.detach()
            out = ce * (self.dp / (self.global_batch * self.seq))
        self.compute_s += time.perf_counter() - t0
        for p in self.outgoing:
            self._send(p, out.detach()[p.rows[0] - lo:p.rows[1] - lo, :, p.cols[0]:p.cols[1]].to(self.dtype),
                       p.receiver, sends)
        return inp, out

    def _backward(self, m: int, inp: torch.Tensor | None, out: torch.Tensor, my_cols: tuple[int, int],
                  sends: list[Any]) -> None:
        """Microbatch ``m`` backward: receive the output gradient's pieces (scaled to this stage's dp), run the
        backward, send the input gradient's pieces back."""
        lo, hi = self.my_rows
        self._set_sync(m == self.microbatches - 1)
        t0 = time.perf_counter()
        if self.is_last:
            out.backward()
        else:
            share = self._assemble(self.outgoing, lambda p: p.receiver, (lo, hi), my_cols)
            out.backward(self._gather_cols(share).to(out.dtype) * (self.dp / self.next_dp))
        self.compute_s += time.perf_counter() - t0
        if inp is not None and inp.grad is not None:
            for p in self.incoming:
                block = inp.grad[p.rows[0] - lo:p.rows[1] - lo, :, p.cols[0]:p.cols[1]].to(self.dtype)
                self._send(p, block, p.sender, sends)
        if inp is not None:
            self._holding -= inp.numel() * inp.element_size()
