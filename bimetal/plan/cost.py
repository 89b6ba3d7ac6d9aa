"""Cost model terms: FLOPs, per-layer time, boundary transfers, all-reduce, bubble and memory.

FLOPs follow torchtitan: 6*N' + 12*L*d*s per token (N' excludes the input embedding, the attention
term is not halved for the causal mask). Memory counts 16 bytes per parameter (fp32 weights, fp32
gradients, two fp32 Adam moments) and 34*s*b*h bytes of activations per layer per in-flight microbatch
(Korthikanti et al. 2022 with flash attention, so no s^2 term); no activation recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_PARAM = 16
ACT_BYTES_PER_TOKEN_HIDDEN = 34
CHUNKS = 8
"""Chunks a cpu-forward transfer is split into when D2H, network and H2D overlap."""


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


def activation_bytes(micro_batch: int, seq: int, dim: int) -> int:
    """Bytes crossing a pipeline boundary per microbatch each way, bf16: b*s*h*2."""
    return micro_batch * seq * dim * 2


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B step: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def transfer_seconds(nbytes: float, transport: str, net_gbps: float, d2h_gbps: float, h2d_gbps: float,
                     overlap: bool = True) -> float:
    """One boundary transfer. net_gbps is the network rate in GB/s over the NICs actually used.

    cpu-forward stages through host memory (D2H, network, H2D); with chunk overlap the three stages
    pipeline so the slowest dominates plus one chunk of the others. device-direct is the network only.
    """
    net = nbytes / (net_gbps * 1e9)
    if transport == "device-direct":
        return net
    if transport != "cpu-forward":
        raise ValueError(f"unknown transport {transport!r}")
    parts = [nbytes / (d2h_gbps * 1e9), net, nbytes / (h2d_gbps * 1e9)]
    if not overlap:
        return sum(parts)
    return max(parts) + (sum(parts) - max(parts)) / CHUNKS


def ring_allreduce_seconds(nbytes: float, n: int, busbw_gbps: float) -> float:
    """Ring all-reduce: S*2(n-1)/n / bus bandwidth."""
    if n <= 1:
        return 0.0
    return nbytes * 2 * (n - 1) / n / (busbw_gbps * 1e9)


def hierarchical_allreduce_seconds(nbytes: float, local: int, groups: int, local_gbps: float,
                                   cross_seconds_per_byte: float) -> float:
    """Reduce-scatter inside each vendor group, all-reduce of the 1/local shard across groups, all-gather.

    cross_seconds_per_byte is the cost of moving one byte between groups (network, plus staging for
    cpu-forward); the cross step is a ring over ``groups`` members.
    """
    inner = ring_allreduce_seconds(nbytes, local, local_gbps)  # reduce-scatter + all-gather together
    shard = nbytes / max(local, 1)
    cross = shard * 2 * (groups - 1) / groups * cross_seconds_per_byte if groups > 1 else 0.0
    return inner + cross


def stage_memory_bytes(m: ModelDims, layers: int, first: bool, last: bool, tp: int, micro_batch: int,
                       seq: int, in_flight: int) -> int:
    """Per-GPU memory of one stage: parameter state plus activations of in-flight microbatches."""
    params = layers * m.layer_params + (m.embed_params if first else 0) + (m.head_params if last else 0)
    act = ACT_BYTES_PER_TOKEN_HIDDEN * seq * micro_batch * m.dim * layers * in_flight
    if last:  # logits in fp32 for the loss, one microbatch at a time
        act += micro_batch * seq * m.vocab * 4
    return (params * BYTES_PER_PARAM + act) // tp
