"""Model arguments: one frozen dataclass per family, the table of flavours, and ``flavour_args`` to look one up.

``LlamaArgs`` and ``Qwen2Args`` share ``ModelArgs`` (same fields, different defaults); the family is a
class attribute, so ``build_model`` can check that the arguments fit the family asked for. Parameter
counts and FLOPs are computed from the arguments alone, so they describe the whole model whether or not
a pipeline stage has pruned its copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bimetal.errors import UserError


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3 (3.1 and later) RoPE frequency scaling, HF ``rope_scaling`` with ``rope_type: llama3``."""

    factor: float = 8.0
    """Long wavelengths are divided by this factor."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_positions / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_positions / high_freq_factor`` are left as they are."""
    original_max_positions: int = 8192
    """Context length the model was pre-trained with before scaling."""


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a decoder-only transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    family: ClassVar[str] = ""

    dim: int = 128
    """Hidden size (HF ``hidden_size``)."""
    n_layers: int = 4
    """Number of transformer blocks (HF ``num_hidden_layers``)."""
    n_heads: int = 4
    """Query heads; the head size is ``dim // n_heads``."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    vocab_size: int = 258
    """Embedding rows and logits; 258 fits the byte tokenizer (256 bytes, ``<eos>``, ``<pad>``)."""
    ffn_dim: int = 384
    """Hidden size of the SwiGLU feed-forward (HF ``intermediate_size``)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    rope_theta: float = 500000.0
    """RoPE base (HF ``rope_theta``)."""
    rope_scaling: RopeScaling | None = None
    """LLaMA-3 frequency scaling, or None for plain RoPE."""
    max_seq_len: int = 2048
    """Longest sequence the model is meant for (HF ``max_position_embeddings``); RoPE itself has no table."""
    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2); the output projection never has one."""
    tie_embeddings: bool = False
    """The output projection shares the input embedding matrix (HF ``tie_word_embeddings``)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head size {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def layer_params(self) -> int:
        """Parameters of one block: attention (with optional qkv bias), SwiGLU, two RMSNorm weights."""
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv
        if self.qkv_bias:
            attn += self.dim + 2 * kv
        return attn + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters of the whole model, a tied matrix counted once.

        ``exclude_embedding`` leaves out the input embedding; with tied embeddings the shared matrix stays
        in, because it still does the work of the output projection.
        """
        emb = self.vocab_size * self.dim
        total = self.n_layers * self.layer_params() + self.dim + emb + (0 if self.tie_embeddings else emb)
        if exclude_embedding and not self.tie_embeddings:
            total -= emb
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the whole model, torchtitan's convention: ``6*N' + 12*L*d*s``.

        ``N'`` is ``num_params(exclude_embedding=True)`` (6 = forward 2 + backward 4 per parameter); the
        attention score and value products add ``12*L*d*s`` (not halved for the causal mask).
        """
        return 6 * self.num_params(exclude_embedding=True) + 12 * self.n_layers * self.dim * seq_len


@dataclass(frozen=True)
class LlamaArgs(ModelArgs):
    """LLaMA-3: no qkv bias, RoPE base 500000, untied embeddings."""

    family: ClassVar[str] = "llama3"


@dataclass(frozen=True)
class Qwen2Args(ModelArgs):
    """Qwen2: qkv bias, RoPE base 1e6, RMSNorm eps 1e-6; small sizes tie their embeddings."""

    family: ClassVar[str] = "qwen2"

    rope_theta: float = 1000000.0
    """RoPE base (HF ``rope_theta``)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    qkv_bias: bool = True
    """Bias on the q, k and v projections."""


ARGS_CLASSES: dict[str, type[ModelArgs]] = {"llama3": LlamaArgs, "qwen2": Qwen2Args}

# Published sizes: Meta-Llama-3-8B, Llama-3.1-8B and Qwen2-7B config.json. The debug flavours train on
# a CPU in seconds with the byte tokenizer; llama3 debug uses the 3.1 frequency scaling (scaled above
# 64 positions) so the demo exercises it.
FLAVOURS: dict[str, dict[str, ModelArgs]] = {
    "llama3": {
        "debug": LlamaArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=258, ffn_dim=384,
                           rope_theta=500000.0, max_seq_len=512,
                           rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_positions=64)),
        "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
        # Llama-3.2-1B's shape with the embedding untied from the output, so that a pipeline can split it
        # (1.50B parameters; `bimetal bench gpu-ladder`, the one-GPU headline measurement).
        "llama3.2-1b-untied": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                        ffn_dim=8192, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072,
                                        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
        "llama3.1-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                 ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072,
                                 rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
    },
    "qwen2": {
        "debug": Qwen2Args(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=258, ffn_dim=384,
                           max_seq_len=512),
        "qwen2-7b": Qwen2Args(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
                              ffn_dim=18944, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
                              tie_embeddings=False),
    },
}


def flavour_args(family: str, flavour: str) -> ModelArgs:
    """The arguments of ``family``'s ``flavour`` (config keys ``model.family`` and ``model.flavour``).

    An unknown pair is a user error that lists every known one.
    """
    try:
        return FLAVOURS[family][flavour]
    except KeyError:
        known = ", ".join(f"{f}/{v}" for f, vs in FLAVOURS.items() for v in vs)
        raise UserError(f"model {family}/{flavour} is unknown; set model.family and model.flavour to one of "
                        f"{known}.") from None


def check_tp(args: ModelArgs, tp: int, model: str = "the model") -> None:
    """Refuse a tp degree the model's shapes cannot be split by, in one sentence naming the number."""
    if tp <= 1:
        return
    for field, what in (("n_heads", "attention heads"), ("n_kv_heads", "key/value heads"),
                        ("ffn_dim", "feed-forward width"), ("vocab_size", "vocabulary size")):
        value = getattr(args, field)
        if value % tp:
            raise UserError(f"parallel.tp={tp} does not divide the {what} of {model} ({field}={value}); choose a "
                            f"tp that divides {field}.")
