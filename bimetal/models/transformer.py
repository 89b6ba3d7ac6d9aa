"""Decoder-only transformer shared by LLaMA-3 and Qwen2, single-device and vendor-free.

RMSNorm, RoPE (with optional LLaMA-3 frequency scaling), grouped-query attention through
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (key/value heads not repeated where a fused
kernel takes them grouped) and a SwiGLU feed-forward. RoPE uses the Hugging Face
"rotate half" layout (the two halves of a head are the pairs), so HF q/k weights load without a
permutation. A pipeline stage is this same class with parts removed by ``prune_to_stage``: ``layers`` is a
``ModuleDict`` keyed by the global layer index, and ``tok_embeddings``, ``norm`` and ``output`` may be None.

Initialisation is deterministic per parameter name (a generator seeded from the seed and the name), so
two processes building the same model with the same seed hold identical weights, whatever they prune.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from bimetal.errors import UserError
from bimetal.models.args import ARGS_CLASSES, FLAVOURS, ModelArgs, RopeScaling

INIT_STD = 0.02


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of RoPE (``head_dim // 2`` values), with LLaMA-3 scaling when given.

    LLaMA-3 scaling divides the frequencies of wavelengths longer than ``original / low_freq_factor`` by
    ``factor``, keeps those shorter than ``original / high_freq_factor``, and blends linearly in between.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    orig = scaling.original_max_positions
    wavelen = 2 * math.pi / inv
    long = wavelen > orig / scaling.low_freq_factor
    short = wavelen < orig / scaling.high_freq_factor
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return torch.where(long, inv / scaling.factor, torch.where(short, inv, blended))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _sdpa_takes_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a fused SDPA kernel takes these grouped key/value heads as they are (``enable_gqa``).

    Then key and value are never repeated per query head: ``n_heads / n_kv_heads`` times less memory for them,
    in the forward and in what the backward keeps. The CPU's flash kernel takes groups (and gives the same bits
    as repeated heads); on a GPU torch's own backend checks decide (flash takes groups; on some builds, ROCm's
    memory-efficient kernel among them, none does, and grouped heads would fall to the unfused math kernel,
    which repeats them anyway and materialises the attention matrix: there the heads are repeated here instead).
    """
    if q.device.type != "cuda":
        return True
    cuda = torch.backends.cuda
    params = cuda.SDPAParams(q, k, v, None, 0.0, True, True)
    return bool(cuda.can_use_flash_attention(params) or cuda.can_use_efficient_attention(params)
                or cuda.can_use_cudnn_attention(params))


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention; ``n_heads // n_kv_heads`` query heads share one key/value head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kv = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the projections' widths: a column-split projection (applied from outside)
        # yields only its share of the heads, and the block needs no argument for it.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = q.shape[1] // k.shape[1]
        grouped = rep > 1 and _sdpa_takes_groups(q, k, v)
        if rep > 1 and not grouped:  # query head h reads key/value head h // rep
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it once ``prune_to_stage`` has removed parts.

    ``forward(x)`` takes token ids ``[b, s]`` when ``tok_embeddings`` is present, else hidden states
    ``[b, s, dim]``; it returns logits ``[b, s, vocab]`` when ``output`` is present, else hidden states.
    With tied embeddings ``output.weight`` is ``tok_embeddings.weight`` (one parameter).
    """

    rope_inv_freq: torch.Tensor

    def __init__(self, family: str, args: ModelArgs) -> None:
        super().__init__()
        self.family, self.args = family, args
        emb = nn.Embedding(args.vocab_size, args.dim)
        out = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            out.weight = emb.weight
        self.tok_embeddings: nn.Embedding | None = emb
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = out
        # Not persistent: derived from the arguments, so checkpoints and HF exports hold weights only.
        self.register_buffer("rope_inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling),
                             persistent=False)

    def reset_buffers(self) -> None:
        """After ``to_empty`` from the meta device: recompute RoPE frequencies and restore a tie.

        ``to_empty`` may replace parameters with new objects, which would silently untie the output
        projection from the embedding.
        """
        inv = rope_inv_freq(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)
        self.rope_inv_freq = inv.to(self.rope_inv_freq.device)
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init: each parameter gets ``initial_value`` of its name (see there), on its own device."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(self.initial_value(name, tuple(p.shape), seed).to(p.dtype))

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
        """The whole initial tensor of parameter ``name`` (float32, CPU), from a generator seeded by ``seed``
        and the name alone, so any process holding any part of the model (a stage, a tp slice, an FSDP shard)
        computes the same numbers for it.

        Linear and embedding weights ~ N(0, 0.02), the two residual-out projections (``wo``, ``w2``) scaled
        down by ``sqrt(2 * n_layers)`` (GPT-2), biases zero, norm weights one. Drawn on the CPU whatever the
        target device: the CPU generator gives the same numbers on every machine and vendor.
        """
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        std = INIT_STD / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)

    def _rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # In float32 as HF does, then cast: angles of late positions lose precision in bf16.
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.rope_inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = self._rope(h.shape[1], h.device, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters this module holds now (a stage counts its own), a tied matrix once.

        ``exclude_embedding`` leaves out the input embedding unless it is tied to the output projection.
        For the whole model's count use ``self.args.num_params``.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the whole model (not this stage): ``6*N' + 12*L*d*s`` (torchtitan).

        ``N'`` excludes the input embedding; MFU divides the cluster's FLOP rate by the devices of all stages.
        """
        return self.args.flops_per_token(seq_len)


def build_model(family: str, args: ModelArgs | str, *, device: str | torch.device = "cpu",
                seed: int = 0) -> Transformer:
    """The whole model of ``family`` with ``args`` (or a flavour name), deterministically initialised.

    Weights depend only on ``seed`` (not on the global RNG); on the ``meta`` device nothing is initialised.
    """
    if family not in FLAVOURS:
        raise UserError(f"model family {family!r} is unknown; use one of {', '.join(FLAVOURS)}.")
    if isinstance(args, str):
        if args not in FLAVOURS[family]:
            raise UserError(f"flavour {args!r} is unknown for {family}; use one of {', '.join(FLAVOURS[family])}.")
        args = FLAVOURS[family][args]
    if not isinstance(args, ARGS_CLASSES[family]):
        raise UserError(f"{type(args).__name__} does not describe a {family} model; use "
                        f"{ARGS_CLASSES[family].__name__}.")
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            return Transformer(family, args)
    # Built and initialised on the CPU so every device type gets the same numbers, then moved.
    model = Transformer(family, args)
    model.init_weights(seed)
    return model.to(device)


def prune_to_stage(model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """Keep only ``layer_ids`` (global indices), the embedding if ``first`` and norm/output if ``last``.

    Works in place and returns ``model``. Tied embeddings are refused unless one stage is both first and
    last: the shared matrix would live on two ranks and its two gradients would need a sum across stages,
    which the pipeline does not do (untie the flavour, or use pp=1).
    """
    present = [int(k) for k in model.layers]
    missing = [i for i in layer_ids if i not in present]
    if missing or not layer_ids:
        raise UserError(f"stage layers {layer_ids} are not all in this model (it holds layers {present}); "
                        "make layers_per_stage sum to the model's layer count.")
    if model.args.tie_embeddings and (first != last or not first):
        raise UserError(f"{model.family} model has tied embeddings, so its first and last layers must be on one "
                        "stage; use an untied flavour or a single pipeline stage.")
    keep = {str(i) for i in layer_ids}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def build_stage(family: str, args: ModelArgs | str, layer_ids: list[int], first: bool, last: bool, *,
                device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """One pipeline stage, equal to ``prune_to_stage(build_model(...), ...)`` but never holding the whole model.

    The model is laid out on the meta device, pruned, then only the stage's tensors are allocated on
    ``device`` and initialised there one parameter at a time; init is per parameter name, so the weights are
    those of the full build. With ``device="meta"`` the pruned stage is returned unallocated, for a caller that
    splits it first (tensor parallelism, FSDP) and then allocates and initialises only its own parts
    (``to_empty``, ``reset_buffers``, ``initial_value`` per parameter).
    """
    model = prune_to_stage(build_model(family, args, device="meta"), layer_ids, first, last)
    if torch.device(device).type == "meta":
        return model
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    model.init_weights(seed)
    return model
