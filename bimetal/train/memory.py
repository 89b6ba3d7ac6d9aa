"""Measured memory of one pipeline stage per GPU, with no GPU and no allocation (for ``--dry-run``).

The stage is the trainer's own: ``build_model`` on the meta device pruned by ``prune_to_stage`` (what
``build_stage`` does before it allocates). Parameter counts come from that module. Activations are measured:
one transformer block (and the stage's head or embedding) runs forward on fake tensors under
``torch.autograd.graph.saved_tensors_hooks`` with the trainer's autocast, and the bytes of every distinct
tensor autograd keeps for the backward pass are summed. What the trainer does, and so what is counted
(shared with the planner, ``bimetal.plan.cost.stage_memory``, term for term):

* master weights, gradients and both AdamW moments are float32 (16 bytes per parameter the GPU holds, plus
  AdamW's float32 step counter per parameter tensor), whatever ``training.dtype`` says;
* ``parallel.tp`` splits the attention and MLP matrices and also the embedding (rows over the vocabulary)
  and the output projection (columns over the vocabulary, logits all-gathered whole, ``b*s*V``); norms
  stay whole. ``parallel.dp_shard`` then divides every tensor of the stage (FSDP2 shards dim 0). The
  embedding's gradient comes back whole from tp (a replicated DTensor of all ``V`` rows, as measured): it
  is the ``.grad`` kept without FSDP;
* without FSDP, ``training.dtype`` bf16 (``auto`` counts as bf16: the dry-run sizes GPUs) autocasts: a bf16
  copy of every matrix a block or the output projection multiplies by is saved per microbatch in flight;
* with FSDP (``parallel.dp_shard`` > 1, ``MixedPrecisionPolicy(param_dtype=bf16 or None,
  reduce_dtype=float32)``) parameters are all-gathered in the compute dtype (bf16, float32 in float32 runs)
  and block inputs are cast to it, so blocks compute in bf16 with no autocast copies. With a pipeline
  (``pp`` > 1) ``reshard_after_forward`` is off and torch's stage keeps resharding off in every backward
  but the last, so the stage's whole unsharded parameters stay gathered from the first forward to the last
  microbatch's backward (``gathered``); without one each block is resharded after its forward and
  backward (two gathered blocks, current + prefetch, are transient). Gradient sync is off for every
  backward but the last microbatch's (and the last accumulation step's without a pipeline): earlier
  backwards leave each parameter's unsharded gradient, upcast to float32 (``unsharded_grads``, 4 bytes
  per unsharded parameter; with tp the embedding's gradient comes back whole, all ``V`` rows, a
  replicated DTensor, as measured), which the last backward reduce-scatters block by block (transient: one
  block's gradient in the compute dtype plus its float32 reduce-scatter input);
* activation checkpointing keeps only the block input of a checkpointed block (``full``: every block;
  ``selective``: every ``every``-th block of the stage), and recomputes one block at a time in the backward;
* microbatches in flight: 1F1B holds up to ``pp - stage`` forward passes, GPipe all of them; a stage's
  output is held until its gradient returns (with tp: this rank's ``1/tp`` share, ``TPBoundary``), in the
  boundary dtype (``parallel.pp_boundary_dtype``: bf16 when training in bf16 unless float32 is asked for),
  the last stage's logits too; a bf16 activation received is widened to float32 for the stage's residual
  stream (that copy is the first block's saved input, counted with the block);
* torch's ``PipelineStage`` allocates, once, a receive buffer in the boundary dtype per microbatch for the
  activation (stages after the first) and for the gradient (stages before the last), each of a ``1/tp``
  share; the examples the stage is built from are meta tensors and hold nothing;
* transient: the float32 gradient of the logits on the last stage, one recomputed block, FSDP's buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bimetal.errors import UserError

TP_SHARDED = ("attention.wq.", "attention.wk.", "attention.wv.", "attention.wo.",
              "feed_forward.w1.", "feed_forward.w2.", "feed_forward.w3.", "tok_embeddings.", "output.")
"""Parameter name parts that tensor parallelism splits (``bimetal.train.tp.apply_tp``); norms stay whole."""


@dataclass
class Saved:
    """Bytes autograd keeps from one forward: activations and bf16 copies of weights."""

    activations: int = 0
    weight_copies: int = 0


class _CopyRecorder(TorchDispatchMode):
    """Remembers the tensors that are dtype casts of parameters (autocast's weight copies)."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.copies: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.params:
            self.copies.add(id(out))
        return out


def _base(t: torch.Tensor) -> torch.Tensor:
    while t._base is not None:
        t = t._base
    return t


def measure_saved(module: nn.Module, fn: Callable[[], Any], skip: tuple[torch.Tensor, ...] = ()) -> Saved:
    """Run ``fn`` (a forward over fake tensors) and sum the distinct tensors saved for backward.

    Parameters themselves are not counted (they are parameter state); casts of parameters count as
    weight copies; ``skip`` tensors (shared ones such as the RoPE tables) are left out.
    """
    params = {id(p) for p in module.parameters()}
    rec = _CopyRecorder(params)
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        b = _base(t)
        seen[id(b)] = b
        return t

    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    out = Saved()
    skipped = {id(_base(t)) for t in skip}
    for key, t in seen.items():
        if key in params or key in skipped:
            continue
        nbytes = t.numel() * t.element_size()
        if key in rec.copies:
            out.weight_copies += nbytes
        else:
            out.activations += nbytes
    return out


def tp_local_block(block: Any, tp: int) -> Any:
    """What one tensor-parallel rank holds of a block: q/k/v and w1/w3 split by output, wo and w2 by input."""
    if tp == 1:
        return block
    a, f = block.attention, block.feed_forward

    def lin(src: nn.Linear, rows: int, cols: int) -> nn.Linear:
        return nn.Linear(cols, rows, bias=src.bias is not None, device="cpu", dtype=src.weight.dtype)

    for name in ("wq", "wk", "wv"):
        src = getattr(a, name)
        setattr(a, name, lin(src, src.out_features // tp, src.in_features))
    a.wo = lin(a.wo, a.wo.out_features, a.wo.in_features // tp)
    a.n_heads, a.n_kv_heads = a.n_heads // tp, a.n_kv_heads // tp
    f.w1 = lin(f.w1, f.w1.out_features // tp, f.w1.in_features)
    f.w3 = lin(f.w3, f.w3.out_features // tp, f.w3.in_features)
    f.w2 = lin(f.w2, f.w2.out_features, f.w2.in_features // tp)
    return block


def check_tp(args: Any, tp: int) -> None:
    """Refuse a tp that does not divide the heads, key/value heads and MLP width, in one sentence."""
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(args, name) % tp:
            raise UserError(f"parallel.tp={tp} does not divide the model's {name}={getattr(args, name)}; "
                            "choose a tp that divides the heads, key/value heads, MLP width and vocabulary.")


@dataclass
class StageMeasure:
    """Measured bytes of one microbatch through one stage (per GPU), by part."""

    block: Saved
    """One transformer block (tp-local)."""
    block_input: int
    """The input of a block: all a checkpointed block keeps."""
    rope: int
    """RoPE cos/sin tables, shared by the stage's blocks."""
    head: Saved
    """Embedding (first stage) plus final norm, output projection and loss (last stage)."""
    output: int
    """The stage output the schedule holds until the backward pass."""
    logits_grad: int
    """Transient float32 gradient of the logits (last stage), else 0."""


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss (``bimetal.train.trainer._loss_fn``, which a test holds this equal to); kept here so
    the dry-run does not import the pipeline package and torch's compiler stack behind it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def measure_stage(model: Any, tp: int, micro_batch: int, seq: int, bf16: bool,
                  loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn,
                  fsdp: bool = False, boundary_size: int = 4) -> StageMeasure:
    """Measure ``model`` (a meta-device stage of the trainer's Transformer) for one microbatch of ``micro_batch``.

    ``boundary_size``: bytes per element of the stage's output as the schedule holds it (2 for a bf16
    boundary, 4 for float32).

    ``fsdp``: the stage runs under FSDP2, whose parameters (gathered) and block inputs are in the compute
    dtype: with ``bf16`` the modules and the residual stream inside the stage are bf16, and autocast finds
    nothing to copy.
    """
    args = model.args
    layer = next(iter(model.layers.values()))
    first, last = model.tok_embeddings is not None, model.output is not None
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    low = torch.bfloat16 if fsdp and bf16 else torch.float32  # dtype of gathered weights and the stage inside
    size = 2 if low == torch.bfloat16 else 4
    import copy

    # Copies of the meta modules (cheap: no storage), made real as fake tensors inside the mode.
    # Cast while still meta: fake parameters cannot be swapped for cast ones.
    layer, emb, norm, output = (copy.deepcopy(x).to(low) if x is not None else None
                                for x in (layer, model.tok_embeddings, model.norm, model.output))
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = tp_local_block(_fake(layer), tp)
        x = torch.empty(micro_batch, seq, args.dim, dtype=low, requires_grad=True)
        cos = torch.empty(seq, args.head_dim, dtype=low)
        sin = torch.empty(seq, args.head_dim, dtype=low)
        with amp:
            blk = measure_saved(block, lambda: block(x, cos, sin), skip=(cos, sin))
        head = Saved()
        # StageModule hands activations on in the boundary dtype; with tp the schedule holds this rank's 1/tp share.
        out_bytes = micro_batch * seq * args.dim * boundary_size // tp
        grad = 0
        if first:
            emb = _fake(emb)
            ids = torch.zeros(micro_batch, seq, dtype=torch.long)
            with amp:
                head = measure_saved(emb, lambda: emb(ids))
        if last:
            # tp: this rank's vocabulary columns of the output projection; the logits are all-gathered whole.
            norm, output = _fake(norm), _fake(output)
            if tp > 1:
                output = nn.Linear(args.dim, args.vocab_size // tp, bias=False, device="cpu", dtype=low)
            tail = nn.ModuleList([norm, output])
            h = torch.empty(micro_batch, seq, args.dim, dtype=low, requires_grad=True)
            tgt = torch.zeros(micro_batch, seq, dtype=torch.long)
            with amp:
                t = measure_saved(tail, lambda: output(norm(h)))
                ldt = torch.bfloat16 if bf16 else torch.float32  # autocast's (or FSDP's bf16) matmul output
                logits = torch.empty(micro_batch, seq, args.vocab_size, dtype=ldt, requires_grad=True)
                ls = measure_saved(tail, lambda: loss(logits.float(), tgt))
            head = Saved(head.activations + t.activations + ls.activations, head.weight_copies + t.weight_copies)
            out_bytes = micro_batch * seq * args.vocab_size * boundary_size  # the logits, held until the backward
            grad = micro_batch * seq * args.vocab_size * 4
    return StageMeasure(blk, micro_batch * seq * args.dim * size, 2 * seq * args.head_dim * size, head, out_bytes,
                        grad)


def _fake(module: Any) -> Any:
    """A meta module with fake CPU tensors (call inside FakeTensorMode): shapes without storage."""
    return module.to_empty(device="cpu")


@dataclass
class ParamCount:
    """Parameter elements of one stage on one GPU."""

    held: int
    """Elements this GPU keeps between steps (its tp slice, then its FSDP shard of dim 0)."""
    local: int
    """Elements of the stage's tp slices before FSDP sharding (what FSDP gathers)."""
    unit: int
    """Elements of the largest FSDP unit (one block, or the root: embedding, final norm, output) before sharding."""
    tensors: int
    """Parameter tensors (each has an AdamW step counter)."""


def param_bytes(model: nn.Module, tp: int, dp_shard: int) -> ParamCount:
    """Count the parameters of a stage as the trainer splits them (tp first, then FSDP's dim-0 shards)."""
    held, local, tensors = 0, 0, 0
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        split = any(s in name for s in TP_SHARDED)
        n = p.numel() // tp if split else p.numel()
        # tp splits dim 0 except for the row-parallel wo/w2 (dim 1): FSDP then shards the local dim 0.
        rows = (p.shape[0] // tp if split and not name.endswith(("wo.weight", "w2.weight")) else p.shape[0]
                ) if p.dim() else 1
        held += math.ceil(rows / dp_shard) * (n // rows) if dp_shard > 1 else n
        local += n
        tensors += 1
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        units[key] = units.get(key, 0) + n
    return ParamCount(held, local, max(units.values()) if units else 0, tensors)


def fsdp_unsharded_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes FSDP2 holds unsharded right now under ``module``, read from its parameters (a measurement).

    ``gathered``: the all-gather outputs the unsharded parameters live in (storage freed when resharded);
    ``unsharded_grads``: gradients accumulated unsharded while gradient sync is off (float32 under a bf16
    ``param_dtype``, else the unsharded parameter's own ``.grad``). Reads FSDP2's per-parameter state
    (torch 2.13's ``FSDPParam``), which has no public accessor.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    gathered = grads = 0
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in sub._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                gathered += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
                if fp.unsharded_accumulated_grad is not None:
                    grads += nbytes(fp.unsharded_accumulated_grad)
                elif hasattr(fp, "_unsharded_param"):
                    grads += nbytes(fp._unsharded_param.grad)
    return {"gathered": gathered, "unsharded_grads": grads}
