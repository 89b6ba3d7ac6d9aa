"""Measured memory of one pipeline stage per GPU, with no GPU and no allocation (for ``--dry-run``).

The stage is the trainer's own: ``build_model`` on the meta device pruned by ``prune_to_stage`` (what
``build_stage`` does before it allocates). Parameter counts come from that module. Activations are measured:
one transformer block (and the stage's head or embedding) runs forward on fake tensors under
``torch.autograd.graph.saved_tensors_hooks`` with the trainer's autocast, and the bytes of every distinct
tensor autograd keeps for the backward pass are summed. Assumptions, shared with the planner
(``bimetal.plan.cost.stage_memory``):

* master weights, gradients and both AdamW moments are float32 (16 bytes per parameter the GPU holds),
  whatever ``training.dtype`` says: the trainer keeps float32 weights and autocasts, and FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` also keeps float32 shards;
* ``training.dtype`` bf16 (``auto`` counts as bf16: the dry-run sizes GPUs): autocast keeps a bf16 copy of
  every matrix a block multiplies by, per microbatch in flight (the copies are saved for the backward
  pass). With FSDP (``parallel.dp_shard`` > 1) parameters are gathered in bf16 per block and resharded
  after the forward, so no copies are held; the working set is two gathered blocks (current + prefetch)
  plus one block's unsharded float32 gradient;
* ``parallel.tp`` shards the attention and MLP matrices (column/row parallel, no sequence parallel);
  norms, embedding and output projection are replicated over tp;
* ``parallel.dp_shard`` divides every parameter, gradient and optimizer tensor of the stage;
* activation checkpointing keeps only the block input of a checkpointed block (``full``: every block;
  ``selective``: every ``every``-th block of the stage), and recomputes one block at a time in the backward;
* microbatches in flight: 1F1B holds up to ``pp - stage`` forward passes, GPipe all of them;
* transient: the float32 gradient of the logits on the last stage, one recomputed block, FSDP's working set.
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
              "feed_forward.w1.", "feed_forward.w2.", "feed_forward.w3.")
"""Parameter name parts that tensor parallelism shards (the rest is replicated over tp)."""


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
        return nn.Linear(cols, rows, bias=src.bias is not None, device="cpu")

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
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(args, name) % tp:
            raise UserError(f"parallel.tp={tp} does not divide the model's {name}={getattr(args, name)}; "
                            "choose a tp that divides the heads, key/value heads and MLP width.")


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
                  loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn) -> StageMeasure:
    """Measure ``model`` (a meta-device stage of the trainer's Transformer) for one microbatch of ``micro_batch``."""
    args = model.args
    layer = next(iter(model.layers.values()))
    first, last = model.tok_embeddings is not None, model.output is not None
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    import copy

    # Copies of the meta modules (cheap: no storage), made real as fake tensors inside the mode.
    layer, emb, norm, output = (copy.deepcopy(x) for x in (layer, model.tok_embeddings, model.norm, model.output))
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = tp_local_block(_fake(layer), tp)
        x = torch.empty(micro_batch, seq, args.dim, requires_grad=True)
        cos = torch.empty(seq, args.head_dim)
        sin = torch.empty(seq, args.head_dim)
        with amp:
            blk = measure_saved(block, lambda: block(x, cos, sin), skip=(cos, sin))
        head = Saved()
        out_bytes = x.numel() * 4  # activations cross stages (and the residual stream runs) in float32
        grad = 0
        if first:
            emb = _fake(emb)
            ids = torch.zeros(micro_batch, seq, dtype=torch.long)
            with amp:
                head = measure_saved(emb, lambda: emb(ids))
        if last:
            norm, output = _fake(norm), _fake(output)
            tail = nn.ModuleList([norm, output])
            h = torch.empty(micro_batch, seq, args.dim, requires_grad=True)
            tgt = torch.zeros(micro_batch, seq, dtype=torch.long)
            with amp:
                t = measure_saved(tail, lambda: loss(output(norm(h)).float(), tgt))
            head = Saved(head.activations + t.activations, head.weight_copies + t.weight_copies)
            out_bytes = grad = micro_batch * seq * args.vocab_size * 4
    return StageMeasure(blk, micro_batch * seq * args.dim * 4, 2 * seq * args.head_dim * 4, head, out_bytes, grad)


def _fake(module: Any) -> Any:
    """A meta module with fake CPU tensors (call inside FakeTensorMode): shapes without storage."""
    return module.to_empty(device="cpu")


def param_bytes(model: nn.Module, tp: int, dp_shard: int) -> tuple[int, int]:
    """(parameters this GPU holds, elements of the largest FSDP unit before sharding) for a stage."""
    held, unit = 0, 0
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel() // tp if any(s in name for s in TP_SHARDED) else p.numel()
        rows = p.shape[0] if p.dim() else 1
        held += math.ceil(rows / dp_shard) * (n // rows) if dp_shard > 1 else n
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        units[key] = units.get(key, 0) + n
    unit = max(units.values()) if units else 0
    return held, unit
