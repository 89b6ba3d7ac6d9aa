"""Cost model terms: FLOPs, per-layer time, all-reduce, bubble and memory (transfers: ``hostpath``).

FLOPs follow torchtitan: 6*N' + 12*L*d*s per token (N' excludes the input embedding, the attention
term is not halved for the causal mask). Memory (``stage_memory``) is the trainer's, term for term: the
same assumptions as ``bimetal train --dry-run`` (listed in ``bimetal/train/memory.py``), with the bytes a
block saves for its backward pass written out from what the dry-run measures on the trainer's own block:
16 bytes per parameter held (fp32 weights, gradients and two AdamW moments) after tp (attention, MLP,
embedding and output projection) and FSDP's ``dp_shard``; bf16 copies of the weights per microbatch in
flight without FSDP; with FSDP the stage's gathered parameters (kept through the step under a pipeline)
and float32 unsharded gradients accumulated between microbatches; activations per block per microbatch
(flash attention with grouped key/value heads, bf16 matmul inputs; float32 residual stream and norms under
autocast, bf16 under FSDP); checkpointed blocks keep only their input; receive buffers, stage outputs and the
last stage's logits in the boundary dtype (bf16 when training in bf16 unless ``pp_boundary_dtype`` is float32).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_PARAM = 16
ACT_BYTES_PER_TOKEN_HIDDEN = 34


@dataclass(frozen=True)
class ModelDims:
    """Layer dimensions of a model flavour, read from bimetal.models.FLAVOURS (qkv biases left out)."""

    name: str
    family: str
    flavour: str
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def layer_params(self) -> int:
        hd = self.dim // self.heads
        attn = 2 * self.dim * self.dim + 2 * self.dim * self.kv_heads * hd
        return attn + 3 * self.dim * self.ffn + 2 * self.dim  # + two RMSNorm weights

    @property
    def head_params(self) -> int:
        return self.dim * self.vocab + self.dim  # output projection + final norm

    @property
    def embed_params(self) -> int:
        return self.dim * self.vocab

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.head_params + self.embed_params


def _from_flavour(name: str, family: str, flavour: str) -> ModelDims:
    # The model package is the one source of sizes, so the planner costs exactly what the trainer builds.
    from bimetal.models import FLAVOURS

    a = FLAVOURS[family][flavour]
    return ModelDims(name, family, flavour, a.n_layers, a.dim, a.ffn_dim, a.n_heads, a.n_kv_heads, a.vocab_size)


# Planner name -> (family, flavour); "debug" is the LLaMA-3 debug flavour the lab trains.
MODELS: dict[str, ModelDims] = {name: _from_flavour(name, fam, fl) for name, (fam, fl) in {
    "llama3-8b": ("llama3", "llama3-8b"), "qwen2-7b": ("qwen2", "qwen2-7b"), "debug": ("llama3", "debug"),
    "qwen2-debug": ("qwen2", "debug")}.items()}


def model_dims(name: str) -> ModelDims:
    """Dimensions for a flavour name; KeyError names the known ones."""
    if name not in MODELS:
        raise KeyError(f"unknown model flavour {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def flops_per_token(m: ModelDims, seq: int) -> float:
    """Training FLOPs per token, 6*N' + 12*L*d*s."""
    return 6.0 * (m.params - m.embed_params) + 12.0 * m.layers * m.dim * seq


def layer_flops_per_token(m: ModelDims, seq: int) -> float:
    """Training FLOPs per token of one transformer block."""
    return 6.0 * m.layer_params + 12.0 * m.dim * seq


def head_flops_per_token(m: ModelDims) -> float:
    return 6.0 * m.head_params


def activation_bytes(micro_batch: int, seq: int, dim: int, size: int = 2) -> int:
    """Bytes crossing a pipeline boundary per microbatch each way: b*s*h*size (bf16: 2, the trainer's boundary
    when it trains in bf16; float32: 4)."""
    return micro_batch * seq * dim * size


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B step: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def ring_allreduce_seconds(nbytes: float, n: int, busbw_gbps: float) -> float:
    """Ring all-reduce: S*2(n-1)/n / bus bandwidth."""
    if n <= 1:
        return 0.0
    return nbytes * 2 * (n - 1) / n / (busbw_gbps * 1e9)


def block_saved_bytes(m: ModelDims, tokens: int, tp: int, bf16: bool = True, fsdp: bool = False) -> int:
    """Bytes one block keeps for its backward per microbatch of ``tokens`` on one tp rank (no weights).

    bf16 autocast: the residual x, its rsqrt and normalised copy in fp32 for both norms (8*d + 4 each),
    the bf16 inputs of q/k/v and w1/w3 (6*d + 4*d, replicated over tp), attention q and output in bf16
    (4*d/tp) and k and v with their grouped heads, not repeated per query head (4*kv/tp, ``kv`` the key/value
    width ``kv_heads * head_dim``), plus the fp32 log-sum-exp (4*heads/tp), four bf16 MLP hidden tensors
    (8*ffn/tp). Under FSDP in bf16 the block's input and weights are bf16 (FSDP casts them), which saves 10*d
    less. float32: norms 12*d + 4 each, attention 8*(d + kv)/tp, MLP 16*ffn/tp.
    """
    d, f, h = m.dim, m.ffn, m.heads
    kv = m.kv_heads * (d // h)
    if bf16:
        per_token = (16 if fsdp else 26) * d + 4 * (d + kv) / tp + 8 * f / tp + 8 + 4 * h / tp
    else:
        per_token = 24 * d + 8 * (d + kv) / tp + 16 * f / tp + 8 + 4 * h / tp
    return int(tokens * per_token)


def block_matrix_params(m: ModelDims) -> int:
    """Parameters of a block's attention and MLP matrices (what tp shards and autocast copies)."""
    hd = m.dim // m.heads
    return 2 * m.dim * m.dim + 2 * m.dim * m.kv_heads * hd + 3 * m.dim * m.ffn


def checkpointed_blocks(layers: int, ac: str, every: int) -> int:
    """Blocks of a stage whose activations are recomputed: all (full), every ``every``-th (selective), none."""
    return {"none": 0, "full": layers, "selective": layers // every}[ac]


def stage_memory(m: ModelDims, layers: int, first: bool, last: bool, tp: int, micro_batch: int, seq: int,
                 in_flight: int, dp_shard: int = 1, ac: str = "none", ac_every: int = 2,
                 bf16: bool = True, pipelined: bool = True, backwards: int = 2,
                 microbatches: int = 0, boundary_size: int = 0) -> dict[str, int]:
    """Per-GPU bytes of one stage by part (keys as the dry-run's report); ``total`` sums them.

    ``pipelined``: pp > 1 (FSDP then keeps the stage gathered through the step); ``backwards``: backward passes
    per gradient reduction (the microbatches; times ``grad_accum`` without a pipeline): more than one makes
    FSDP accumulate unsharded gradients. ``microbatches`` (default: ``backwards``): the schedule's, one
    receive buffer each. ``boundary_size``: bytes per element at a stage boundary (receive buffers, the output
    held until its gradient, the last stage's logits); 0 means the compute dtype's, the trainer's default
    (``parallel.pp_boundary_dtype = "compute"``): 2 in bf16, 4 in float32.
    """
    microbatches = microbatches or backwards
    bsize = boundary_size or (2 if bf16 else 4)
    tokens = micro_batch * seq
    mat = block_matrix_params(m) // tp
    block = mat + m.layer_params - block_matrix_params(m)  # norms are replicated over tp
    emb, head = m.embed_params // tp, m.dim * m.vocab // tp + m.dim  # vocabulary split; the final norm whole
    local = layers * block + (emb if first else 0) + (head if last else 0)  # tp slices, before FSDP
    held = -(-local // dp_shard)
    tensors = 9 * layers + (1 if first else 0) + (2 if last else 0)  # AdamW's step counter per tensor
    ckpt = checkpointed_blocks(layers, ac, ac_every)
    fsdp = dp_shard > 1
    low = fsdp and bf16  # the stage computes in bf16 weights and a bf16 residual stream
    size = 2 if low else 4
    saved = block_saved_bytes(m, tokens, tp, bf16, fsdp)
    copy = 2 * mat if bf16 else 0
    out_copy = 2 * m.dim * m.vocab // tp if last and bf16 else 0
    copies = 0 if fsdp else (layers - ckpt) * copy + out_copy
    hd = m.dim // m.heads
    act = (layers - ckpt) * saved + ckpt * tokens * m.dim * size + 2 * seq * hd * size
    act += 8 * tokens if first else 0  # token ids saved by the embedding
    if last:  # final norm, output input, fp32 log-softmax, targets; the logits a schedule holds (boundary dtype)
        act += tokens * ((8 if low else 10 if bf16 else 12) * m.dim + 4 + 8)
        act += tokens * m.vocab * 4 + (tokens * m.vocab * bsize if pipelined else 0)
    else:
        act += tokens * m.dim * bsize // tp  # the stage output (this tp rank's share) until its gradient
    transient = tokens * m.vocab * 4 if last else 0
    if ckpt:
        transient += saved + (0 if fsdp else copy)
    gathered = unsharded_grads = 0
    whole_emb = m.embed_params - emb if first else 0  # tp's embedding gradient comes back whole (all V rows)
    if fsdp:
        param_size = 2 if bf16 else 4
        unit = max(block, (emb if first else 0) + (head if last else 0))
        if pipelined:
            gathered = local * param_size
        else:
            transient += 2 * unit * param_size
        unsharded_grads = 4 * (local + whole_emb) if backwards > 1 else 0
        transient += unit * (param_size + 4)
    # torch's pipeline stage: a receive buffer per microbatch in the boundary dtype, activations in, gradients back
    recv = microbatches * tokens * m.dim * bsize // tp * ((not first) + (not last)) if pipelined else 0
    out = {"params": 4 * held, "grads": 4 * held + (0 if fsdp else 4 * whole_emb), "optimizer": 8 * held + 4 * tensors,
           "weight_copies": in_flight * copies, "gathered": gathered, "unsharded_grads": unsharded_grads,
           "recv_buffers": recv, "activations": in_flight * act, "transient": transient}
    out["total"] = sum(out.values())
    return out


def stage_memory_bytes(m: ModelDims, layers: int, first: bool, last: bool, tp: int, micro_batch: int,
                       seq: int, in_flight: int, dp_shard: int = 1, ac: str = "none", ac_every: int = 2,
                       bf16: bool = True, pipelined: bool = True, backwards: int = 2, microbatches: int = 0,
                       boundary_size: int = 0) -> int:
    """Per-GPU memory of one stage: parameter state, weight copies, FSDP buffers, activations, transients."""
    return stage_memory(m, layers, first, last, tp, micro_batch, seq, in_flight, dp_shard, ac, ac_every, bf16,
                        pipelined, backwards, microbatches, boundary_size)["total"]
