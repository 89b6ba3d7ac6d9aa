"""Typed training configuration: dataclasses, TOML file, ``--section.key=value`` overrides.

Precedence is CLI > file > defaults. This module imports no torch.distributed so the planner can
write and check configs without side effects. Every mistake a user can make raises ``UserError``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic

from bimetal import transports
from bimetal.errors import UserError
from bimetal.schema import SHAPE, Problem, check, read_toml


@dataclass
class ModelConfig:
    __pydantic_config__ = SHAPE

    family: str = "llama3"
    """Model family: ``llama3`` or ``qwen2``."""
    flavour: str = "debug"
    """Flavour within the family (``debug``, ``llama3-8b``, ``qwen2-7b``)."""
    seed: int = 0
    """Seed of the deterministic weight initialisation."""


@dataclass
class ParallelConfig:
    __pydantic_config__ = SHAPE

    pp: int = 1
    """Number of pipeline stages."""
    dp: int = 1
    """Data-parallel ranks per stage."""
    tp: int = 1
    """Tensor-parallel degree inside a node and a vendor (column/row-parallel attention and MLP)."""
    dp_shard: int = 1
    """FSDP2 shard degree inside each stage's data-parallel ranks (must divide ``dp`` and stay inside one
    vendor island): 1 replicates parameters and optimizer state (plain data parallel), ``dp`` shards them
    fully, anything between is HSDP (``dp / dp_shard`` replicas of ``dp_shard``-way shards)."""
    tp_per_stage: list[int] = field(default_factory=list)
    """Tensor-parallel degree of each pipeline stage, e.g. ``[2, 1]``; empty: ``tp`` for every stage. Any of the
    ``*_per_stage`` keys makes the layout per-stage (docs/per-island-shapes.md): the world size is the sum over
    stages of dp x tp, and ``data.global_batch_size`` sets the batch."""
    dp_per_stage: list[int] = field(default_factory=list)
    """Data-parallel replicas of each pipeline stage, e.g. ``[2, 1]``; empty: ``dp`` for every stage."""
    dp_shard_per_stage: list[int] = field(default_factory=list)
    """FSDP2 shard degree of each pipeline stage (dividing its dp), e.g. ``[2, 1]``; empty: ``dp_shard``."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Layers held by each stage, e.g. ``[3, 1]``; empty means an even split. Must sum to the model's layers."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b`` or ``gpipe``."""
    microbatches: int = 2
    """Microbatches per optimizer step per replica (per accumulation step)."""
    pp_transport: str = transports.DEFAULT
    """Transport of pipeline groups that span vendors: ``cpu-forward``, ``device-direct`` or ``gloo``."""
    pp_boundary_dtype: str = "compute"
    """dtype of the activations and gradients that cross pipeline stages (and of the last stage's logits the
    schedule holds): ``compute`` (bf16 when training in bf16, i.e. ``training.dtype`` bfloat16 or auto on a
    GPU, else float32), or ``float32`` (twice the bytes; the residual stream is not rounded at a boundary).
    It changes the losses: a resume that changes it is refused unless ``--resume-changed``."""
    dp_transport: str = transports.DEFAULT
    """Transport of data-parallel groups that span vendors (with ``allow_cross_vendor_dp``), as ``pp_transport``."""
    homogeneous_backend: str = "native"
    """Back-end of one-vendor groups: ``native`` (NCCL/RCCL) or ``gloo`` (with ``pp_transport`` and
    ``dp_transport`` set to ``gloo``: every group on stock Gloo, the baseline ``bimetal plan --ladder`` prices)."""
    timeout_s: float = 120.0
    """Timeout of every collective, in seconds; a hang fails after this long."""
    allow_cross_vendor_dp: bool = False
    """Allow data-parallel groups that span vendors (gradients then cross vendors every step)."""
    interfaces: list[str] = field(default_factory=list)
    """Network interfaces the cross-vendor transports may use on each node (cpu-forward's stripes, device-direct's
    address): names or shell patterns, e.g. ``["ib*", "ens1f0np0"]``; each node takes the ones it has, and a name
    no node has is refused. Empty: ``BIMETAL_IFACES``, else every up IPv4 interface less loopback, bridges,
    tunnels and container networks. Precedence: CLI > file > ``BIMETAL_IFACES`` > that default. The world group
    follows torch's ``GLOO_SOCKET_IFNAME``."""
    layout: str = "fixed"
    """``fixed``: the layout is the keys above, as written. ``auto``: the ranks pick pp, dp, tp and the stage split
    when the job starts, for the world they find (vendor and node of every rank; docs/moving-a-run.md): the most
    data-parallel layout that fits, or with ``cluster`` the one the planner predicts fastest. The global
    batch (``data.global_batch_size``, else ``data.batch_size`` x ``parallel.dp``) and the rows per microbatch
    (``data.batch_size`` / ``parallel.microbatches``) are kept; ``pp``, ``dp``, ``tp``, ``dp_shard`` or
    ``layers_per_stage`` written beside ``auto`` (in the same file, or on the command line) are kept by the pick;
    ``auto`` on the command line replaces the file's layout keys (said in a note)."""
    cluster: str = ""
    """Cluster spec TOML (as for ``bimetal plan``, e.g. ``configs/clusters/h100_mi300x.toml``, relative to the
    working directory) naming each vendor island's GPU part; ``--dry-run`` sizes every stage against it.
    Stages take the spec's GPUs in file order. Empty: the dry-run prints bytes without a device limit."""


@dataclass
class DataConfig:
    __pydantic_config__ = SHAPE

    path: str = ""
    """Text file, JSONL file (``text`` field) or pre-tokenized ``.bin`` shard; empty means the shipped corpus."""
    tokenizer: str = "byte"
    """``byte`` (vocab 256 + specials, no download) or the path of an HF ``tokenizers`` JSON file."""
    bin_dtype: str = "uint16"
    """Element type of ``.bin`` shards: ``uint16`` or ``uint32``."""
    seq_len: int = 128
    """Tokens per sample."""
    batch_size: int = 4
    """Samples per replica per accumulation step, split into ``parallel.microbatches``."""
    global_batch_size: int = 0
    """Samples per accumulation step over all replicas; needed by a per-stage layout (each stage splits it over
    its own dp). 0: ``batch_size`` x ``parallel.dp`` (uniform layouts only)."""


@dataclass
class OptimConfig:
    __pydantic_config__ = SHAPE

    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 10
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Global gradient-norm clip over all stages and replicas; 0 disables."""
    grad_accum: int = 1
    """Gradient-accumulation steps per optimizer step."""


@dataclass
class TrainingConfig:
    __pydantic_config__ = SHAPE

    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed of data order and RNG."""
    dtype: str = "auto"
    """``auto`` (bf16 autocast on GPUs, float32 on CPU), ``bfloat16`` or ``float32``."""
    deterministic: bool = True
    """Use deterministic algorithms where cheap."""


@dataclass
class ActivationCheckpointConfig:
    __pydantic_config__ = SHAPE

    mode: str = "none"
    """``none``, ``full`` (recompute every transformer block in the backward pass) or ``selective``."""
    every: int = 2
    """With ``selective``: checkpoint every k-th block of each stage (1 = every block)."""
    mode_per_stage: list[str] = field(default_factory=list)
    """``mode`` of each pipeline stage, e.g. ``["selective", "none"]`` (what ``bimetal plan --per-stage`` writes);
    empty: ``mode`` for every stage."""

    def stage_mode(self, stage: int) -> str:
        """The mode of ``stage``."""
        return self.mode_per_stage[stage] if self.mode_per_stage else self.mode


@dataclass
class CheckpointConfig:
    __pydantic_config__ = SHAPE

    folder: str = ""
    """Checkpoint folder; empty means ``<run_dir>/checkpoints``."""
    every: int = 0
    """Save every N steps; 0 saves only at the end."""
    resume: bool = False
    """Continue from the newest complete checkpoint (a damaged one is reported and the one before it used; where
    the folder holds checkpoints but none is usable the run is refused, changing nothing). Without it a run is
    refused where the checkpoint folder holds checkpoints: to start over, move them away or use another folder."""
    resume_changed: bool = False
    """With ``resume``: accept a config that changes what the checkpoint's loss trajectory depends on (model,
    data, batch, sequence length, seeds, optimizer, steps, precision; ``docs/training-safety.md`` lists them);
    each change is logged. Without it such a resume is refused naming the key. ``--resume-changed`` sets it."""
    keep_last: int = 3
    """Keep the newest N complete checkpoints and delete older ones after each save; 0 keeps all. Three leave
    a fallback when the newest is damaged and one more, at three times one checkpoint's disk space."""
    export_hf: str = ""
    """If set, export the trained model as an HF safetensors folder here. The folder then holds this model
    alone: an older export in it is replaced whole (written beside it, then moved into place), so it must not
    be, hold or lie in the run folder or the checkpoint folder, nor be or hold the working directory."""
    export_shard_bytes: int = 0
    """Largest safetensors file of the export, in bytes: 0 writes one ``model.safetensors``; more shards the
    weights as transformers does (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``;
    its ``save_pretrained`` uses 5000000000)."""


@dataclass
class MetricsConfig:
    __pydantic_config__ = SHAPE

    run_dir: str = "runs/default"
    """Run folder: ``metrics.jsonl``, checkpoints, summary."""
    log_every: int = 1
    """Console progress line every N steps (rank 0)."""
    tensorboard: bool = False
    """Also write TensorBoard events, if tensorboard is installed."""


@dataclass
class TrainConfig:
    __pydantic_config__ = SHAPE

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model family, flavour and init seed."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Pipeline / data-parallel layout and transports."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer, batch shape."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Loop length, seed, precision."""
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    """Recomputation of activations in the backward pass."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and export."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Run folder and logging."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the values that need no model; raises ``UserError`` naming the bad field."""
        p = self.parallel
        if p.pp < 1 or p.dp < 1:
            raise UserError(f"parallel.pp={p.pp} and parallel.dp={p.dp} must both be at least 1.")
        if p.tp < 1:
            raise UserError(f"parallel.tp={p.tp} must be at least 1.")
        if p.dp_shard < 1 or (p.dp % p.dp_shard and not self.per_stage):  # per stage: each stage's own dp
            raise UserError(f"parallel.dp_shard={p.dp_shard} must be at least 1 and divide parallel.dp={p.dp}.")
        ac = self.activation_checkpoint
        if ac.mode not in ("none", "full", "selective"):
            raise UserError(f"activation_checkpoint.mode={ac.mode!r} is unknown; use none, full or selective.")
        if ac.mode_per_stage and len(ac.mode_per_stage) != p.pp:
            raise UserError(f"activation_checkpoint.mode_per_stage={ac.mode_per_stage} has {len(ac.mode_per_stage)} "
                            f"entries but parallel.pp={p.pp}; give one per stage.")
        for s, mode in enumerate(ac.mode_per_stage):
            if mode not in ("none", "full", "selective"):
                raise UserError(f"stage {s}: activation_checkpoint.mode_per_stage[{s}]={mode!r} is unknown; use "
                                "none, full or selective.")
        if ac.every < 1:
            raise UserError(f"activation_checkpoint.every={ac.every} must be at least 1.")
        if p.layers_per_stage and len(p.layers_per_stage) != p.pp:
            raise UserError(
                f"parallel.layers_per_stage={p.layers_per_stage} has {len(p.layers_per_stage)} entries but "
                f"parallel.pp={p.pp}; give one layer count per stage."
            )
        if any(n < 1 for n in p.layers_per_stage):
            raise UserError(f"parallel.layers_per_stage={p.layers_per_stage} has a stage with no layers; "
                            "give every stage at least one layer.")
        bad = [n for n in p.interfaces if not n.strip() or any(c in n for c in ", /\t")]
        if bad:
            raise UserError(f"parallel.interfaces={p.interfaces} holds {bad[0]!r}, which is no interface name or "
                            "pattern; give names like eth0 or patterns like ib*.")
        if p.layout not in ("fixed", "auto"):
            raise UserError(f"parallel.layout={p.layout!r} is unknown; use 'fixed' (the keys as written) or 'auto' "
                            "(picked when the job starts).")
        if p.homogeneous_backend not in ("native", "gloo"):
            raise UserError(f"parallel.homogeneous_backend={p.homogeneous_backend!r} is unknown; "
                            "use 'native' or 'gloo'.")
        for key in ("pp_transport", "dp_transport"):
            if getattr(p, key) not in transports.NAMES:
                raise UserError(f"parallel.{key}={getattr(p, key)!r} is unknown; use one of "
                                f"{', '.join(transports.NAMES)}.")
        if p.schedule not in ("1f1b", "gpipe"):
            raise UserError(f"parallel.schedule={p.schedule!r} is unknown; use '1f1b' or 'gpipe'.")
        if p.microbatches < 1 or (self.data.batch_size % p.microbatches and not self.per_stage):
            raise UserError(f"data.batch_size={self.data.batch_size} must be a multiple of "
                            f"parallel.microbatches={p.microbatches}.")
        if p.schedule == "1f1b" and p.pp > 1 and p.microbatches < p.pp and not self.per_stage:
            # torch's 1F1B schedule fills the pipeline with one microbatch per stage (else it raises on every rank)
            raise UserError(f"parallel.schedule='1f1b' needs at least one microbatch per stage, but parallel.pp="
                            f"{p.pp} has parallel.microbatches={p.microbatches}; raise parallel.microbatches to "
                            f"{p.pp} or more (data.batch_size={self.data.batch_size} a multiple of it), or use "
                            "parallel.schedule='gpipe'.")
        if p.pp_boundary_dtype not in ("compute", "float32"):
            raise UserError(f"parallel.pp_boundary_dtype={p.pp_boundary_dtype!r} is unknown; use 'compute' or "
                            "'float32'.")
        if self.training.dtype not in ("auto", "bfloat16", "float32"):
            raise UserError(f"training.dtype={self.training.dtype!r} is unknown; use auto, bfloat16 or float32.")
        if self.data.bin_dtype not in ("uint16", "uint32"):
            raise UserError(f"data.bin_dtype={self.data.bin_dtype!r} is unknown; use uint16 or uint32.")
        if self.checkpoint.keep_last < 0:
            raise UserError(f"checkpoint.keep_last={self.checkpoint.keep_last} must be 0 (keep all) or more.")
        if self.checkpoint.resume_changed and not self.checkpoint.resume:
            raise UserError("checkpoint.resume_changed=true (--resume-changed) accepts changes on a resume, but "
                            "checkpoint.resume is off; add --resume or drop it.")
        self._check_ranges()
        self._check_stage_shapes()

    def compute_dtype(self, device_type: str) -> str:
        """What the ranks compute in on a ``device_type`` device (``cuda`` or ``cpu``): ``bfloat16`` (autocast) or
        ``float32``; ``auto`` is bf16 on GPUs only. The trainer and the dry-run both ask this."""
        dtype = self.training.dtype
        return "bfloat16" if dtype == "bfloat16" or (dtype == "auto" and device_type == "cuda") else "float32"

    @property
    def per_stage(self) -> bool:
        """Whether the layout gives stages their own shapes (any ``parallel.*_per_stage`` key set)."""
        p = self.parallel
        return bool(p.tp_per_stage or p.dp_per_stage or p.dp_shard_per_stage)

    def stage_shapes(self) -> list[tuple[int, int, int]]:
        """(tp, dp, dp_shard) of every pipeline stage."""
        p = self.parallel
        return [(p.tp_per_stage[s] if p.tp_per_stage else p.tp, p.dp_per_stage[s] if p.dp_per_stage else p.dp,
                 p.dp_shard_per_stage[s] if p.dp_shard_per_stage else p.dp_shard) for s in range(p.pp)]

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: the sum over stages of dp x tp."""
        return sum(tp * dp for tp, dp, _ in self.stage_shapes())

    def stage_microbatch(self, stage: int) -> int:
        """Samples per microbatch of one replica of ``stage`` (its share of each global microbatch)."""
        dp = self.stage_shapes()[stage][1]
        return self.global_batch // (dp * self.parallel.microbatches)

    @property
    def global_batch(self) -> int:
        """Samples per accumulation step over all replicas."""
        return self.data.global_batch_size or self.data.batch_size * self.parallel.dp

    def _check_stage_shapes(self) -> None:
        """The per-stage keys: one positive entry per stage, dp_shard dividing dp, dp dividing the batch."""
        p, d = self.parallel, self.data
        if d.global_batch_size < 0:
            raise UserError(f"data.global_batch_size={d.global_batch_size} must be 0 (batch_size x dp) or more.")
        if not self.per_stage:
            if d.global_batch_size and d.global_batch_size != d.batch_size * p.dp:
                raise UserError(f"data.global_batch_size={d.global_batch_size} differs from data.batch_size x "
                                f"parallel.dp = {d.batch_size * p.dp}; drop it, or give per-stage shapes.")
            return
        for key in ("tp_per_stage", "dp_per_stage", "dp_shard_per_stage"):
            values = getattr(p, key)
            if values and len(values) != p.pp:
                raise UserError(f"parallel.{key}={values} has {len(values)} entries but parallel.pp={p.pp}; give "
                                "one per stage.")
            for s, v in enumerate(values):
                if v < 1:
                    raise UserError(f"stage {s}: parallel.{key}[{s}]={v} must be at least 1.")
        if not d.global_batch_size:
            raise UserError("a per-stage layout needs data.global_batch_size (samples per step over all replicas); "
                            "set it, e.g. --data.global_batch_size=16.")
        if p.allow_cross_vendor_dp:
            raise UserError("parallel.allow_cross_vendor_dp cannot be combined with per-stage shapes (each stage is "
                            "one vendor island); drop one of them.")
        for s, (_, dp, shard) in enumerate(self.stage_shapes()):
            if dp % shard:
                raise UserError(f"stage {s}: parallel.dp_shard_per_stage[{s}]={shard} does not divide the stage's "
                                f"dp={dp}; choose a divisor of it.")
            if d.global_batch_size % (dp * p.microbatches):
                raise UserError(f"stage {s}: parallel.dp_per_stage[{s}]={dp} does not divide data.global_batch_size="
                                f"{d.global_batch_size} into parallel.microbatches={p.microbatches} equal "
                                f"microbatches; make the batch a multiple of {dp * p.microbatches}.")

    def _check_ranges(self) -> None:
        """Numbers out of their range, each refused naming its key (a silent clamp would hide a typo)."""
        o = self.optim
        at_least = [("training.steps", self.training.steps, 1), ("data.seq_len", self.data.seq_len, 1),
                    ("data.batch_size", self.data.batch_size, 1),
                    ("parallel.microbatches", self.parallel.microbatches, 1),
                    ("optim.grad_accum", o.grad_accum, 1), ("optim.warmup_steps", o.warmup_steps, 0),
                    ("checkpoint.every", self.checkpoint.every, 0), ("metrics.log_every", self.metrics.log_every, 1),
                    ("checkpoint.export_shard_bytes", self.checkpoint.export_shard_bytes, 0),
                    ("model.seed", self.model.seed, 0), ("training.seed", self.training.seed, 0)]
        for key, count, least in at_least:
            if count < least:
                raise UserError(f"{key}={count} must be at least {least}.")
        for key, seed in (("model.seed", self.model.seed), ("training.seed", self.training.seed)):
            if seed >= 2 ** 63:
                raise UserError(f"{key}={seed} must be below 2**63.")
        # (key, value, lowest, highest, lowest allowed itself)
        spans: list[tuple[str, float, float, float, bool]] = [
                 ("optim.lr", o.lr, 0.0, math.inf, False), ("optim.weight_decay", o.weight_decay, 0.0, math.inf, True),
                 ("optim.beta1", o.beta1, 0.0, 1.0, True), ("optim.beta2", o.beta2, 0.0, 1.0, True),
                 ("optim.eps", o.eps, 0.0, math.inf, False), ("optim.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0, True),
                 ("optim.grad_clip", o.grad_clip, 0.0, math.inf, True),
                 ("parallel.timeout_s", self.parallel.timeout_s, 0.0, math.inf, False)]
        for key, value, low, high, closed in spans:
            ok = math.isfinite(value) and (value >= low if closed else value > low) and value <= high
            if key.startswith("optim.beta"):
                ok = ok and value < 1.0
            if not ok:
                low_s = f"{'>=' if closed else '>'} {low:g}"
                high_s = " and below 1" if key.startswith("optim.beta") else \
                    f" and at most {high:g}" if math.isfinite(high) else ""
                raise UserError(f"{key}={value!r} must be a finite number {low_s}{high_s}.")

    def stage_split(self, n_layers: int) -> list[int]:
        """Layers per stage for a model of ``n_layers``; raises ``UserError`` if the split does not sum."""
        split = list(self.parallel.layers_per_stage)
        if not split:
            pp = self.parallel.pp
            base, extra = divmod(n_layers, pp)
            split = [base + (1 if i < extra else 0) for i in range(pp)]
            if pp > n_layers:
                raise UserError(f"parallel.pp={pp} stages split model {self.model.family}/{self.model.flavour}'s "
                                f"{n_layers} layers as {split}, leaving {pp - n_layers} stage(s) with no layer; use "
                                f"at most {n_layers} stages, or a model with more layers.")
        if sum(split) != n_layers or min(split) < 1:
            raise UserError(
                f"parallel.layers_per_stage={split} sums to {sum(split)} but model "
                f"{self.model.family}/{self.model.flavour} has {n_layers} layers; make the split sum to {n_layers}."
            )
        return split

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (TOML/JSON-ready)."""
        return dataclasses.asdict(self)


def _from_text(text: str, want: Any, where: str) -> Any:
    """A file or CLI string for a key of type ``want`` (not ``str``), converted; ``where`` names the key."""
    text = text.strip()
    try:
        if want is bool:  # the words accepted since the first release, no more
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if typing.get_origin(want) is list:
            return pydantic.TypeAdapter(want).validate_python([v for v in text.strip("[]").split(",") if v.strip()])
        return pydantic.TypeAdapter(want).validate_python(text)
    except (ValueError, pydantic.ValidationError):
        name = getattr(typing.get_origin(want) or want, "__name__", str(want))
        raise UserError(f"{where}={text!r} is not a valid {name}; fix the value.") from None


def parse_value(key: str, text: str) -> Any:
    """The value of config key ``section.key`` written as ``text`` (as on the command line); ``UserError`` if bad."""
    section, _, name = key.partition(".")
    want = typing.get_type_hints(typing.get_type_hints(TrainConfig)[section])[name]
    return text if want is str else _from_text(text, want, key)


def _read_strings(data: dict[str, Any]) -> None:
    """Convert, in place, every string written for a known non-string key (``--training.steps=5``)."""
    for section, body in data.items():
        cls = typing.get_type_hints(TrainConfig).get(section)
        if cls is None or not isinstance(body, dict):
            continue
        hints = typing.get_type_hints(cls)
        for key, value in body.items():
            if isinstance(value, str) and hints.get(key, str) is not str:
                body[key] = _from_text(value, hints[key], f"{section}.{key}")


def _explain(file: str, from_cli: set[str]) -> typing.Callable[[Problem], str]:
    """The config's sentences for what the schema refuses, naming the key and where it was written."""
    sections = [f.name for f in dataclasses.fields(TrainConfig)]

    def explain(p: Problem) -> str:
        section, _, key = p.key.partition(".")
        origin = "the command line" if p.key in from_cli or any(k.startswith(section + ".") and not key
                                                                for k in from_cli) else file
        if not key and (p.kind == "type" or not isinstance(p.value, dict)):
            return f"unknown config key {section!r} in {origin}; keys belong in a [section]."
        if p.kind == "unknown" and not key:
            return f"unknown config section [{section}] in {origin}; known sections: {', '.join(sorted(sections))}."
        if p.kind == "unknown":
            return (f"unknown config key {section}.{key} in {origin}; known keys of [{section}]: "
                    f"{', '.join(sorted(p.known))}.")
        field_name = key.split("[", 1)[0]
        want = typing.get_type_hints(typing.get_type_hints(TrainConfig)[section]).get(field_name, str)
        if "[" in key:  # one element of a list
            want = typing.get_args(want)[0]
        name = getattr(typing.get_origin(want) or want, "__name__", str(want))
        return f"{p.key}={p.value!r} in {origin} should be a {name}; fix the value."
    return explain


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """``['--optim.lr=1e-3', '--training.steps', '5']`` -> ``{'optim.lr': '1e-3', 'training.steps': '5'}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"argument {arg!r} is not an override; write --section.key=value.")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(argv):
                raise UserError(f"override {arg} has no value; write {arg}=VALUE.")
            k, v = arg[2:], argv[i + 1]
            i += 1
        out[k] = v
        i += 1
    return out


UNIFORM_AND_PER_STAGE = (("parallel", "dp", "dp_per_stage"), ("parallel", "tp", "tp_per_stage"),
                         ("parallel", "dp_shard", "dp_shard_per_stage"),
                         ("activation_checkpoint", "mode", "mode_per_stage"))
"""A key every stage shares beside the list that gives each stage its own value."""


def uniform_beside_per_stage(cfg: TrainConfig, file_keys: set[str], cli_keys: set[str], file: str) -> list[str]:
    """Each uniform key written beside its per-stage list (``parallel.dp`` and ``parallel.dp_per_stage``).

    A list whose every entry equals the uniform key ignores nothing and passes. A list on the command line over
    a uniform key of the file overrides it, as any command-line key overrides the file (CLI > file): returned
    as a sentence for the job to print, so it is not silent. Any other pair - both in the file, both on the
    command line, or the uniform key on the command line over the file's list - would ignore a value the user
    wrote: refused (``UserError``), naming both keys and where each was written.
    """
    notes = []
    for section, one, many in UNIFORM_AND_PER_STAGE:
        u_key, l_key = f"{section}.{one}", f"{section}.{many}"
        body = getattr(cfg, section)
        value, values = getattr(body, one), getattr(body, many)
        levels = [2 if k in cli_keys else 1 if k in file_keys else 0 for k in (u_key, l_key)]
        if not values or not levels[0] or all(v == value for v in values):
            continue
        where = ["the command line" if lv == 2 else file for lv in levels]
        if levels[1] > levels[0]:
            notes.append(f"{l_key}={values} ({where[1]}) overrides {u_key}={value!r} ({where[0]}) for every stage")
            continue
        raise UserError(f"{u_key}={value!r} ({where[0]}) is set beside {l_key}={values} ({where[1]}), which gives "
                        f"each stage its own value, so {u_key} would be ignored; drop one of them, or make them "
                        "agree.")
    return notes


AUTO_KEEPS = ("pp", "dp", "tp", "dp_shard", "layers_per_stage")
"""``parallel`` keys a pick of ``parallel.layout = "auto"`` keeps where they are written beside it."""
AUTO_AC = "activation_checkpoint.mode"
"""Kept by the pick wherever it is written (the file or the command line): the planner's pick searches it otherwise."""
PER_STAGE = (("parallel", "tp_per_stage"), ("parallel", "dp_per_stage"), ("parallel", "dp_shard_per_stage"),
             ("activation_checkpoint", "mode_per_stage"))
"""Keys of a per-stage layout, which ``auto`` (a uniform layout) cannot keep."""


def auto_layout(cfg: TrainConfig, file_keys: set[str], cli_keys: set[str], file: str,
                notes: list[str]) -> tuple[TrainConfig, frozenset[str]]:
    """A config of ``parallel.layout = "auto"`` made ready for the pick, and the layout keys the pick keeps.

    Kept: each of ``AUTO_KEEPS`` written where ``auto`` is, or on the command line over the file's ``auto``
    (``layers_per_stage`` keeps ``pp`` too), and ``AUTO_AC`` wherever it is written. A layout key of the file
    under ``auto`` given on the command line is replaced (CLI > file): said in ``notes``. A per-stage key where
    ``auto`` is refused (``UserError``). The global batch and the rows per microbatch the config gives are what the
    pick keeps: the result holds them as ``data.global_batch_size`` and, for the kept (else one) replica,
    ``data.batch_size`` and ``parallel.microbatches``; its other layout keys are at their defaults until the pick.
    """
    level = 2 if "parallel.layout" in cli_keys else 1

    def written(key: str) -> int:
        return 2 if key in cli_keys else 1 if key in file_keys else 0

    replaced = [f"{section}.{key}" for section, key in PER_STAGE if written(f"{section}.{key}")]
    keep = {k for k in AUTO_KEEPS if written(f"parallel.{k}") >= level}
    replaced += [f"parallel.{k}" for k in AUTO_KEEPS if k not in keep and written(f"parallel.{k}")]
    if "layers_per_stage" in keep and cfg.parallel.layers_per_stage:
        keep.add("pp")
    if written(AUTO_AC):  # not a layout key: the pick with a cluster spec searches it only where nobody wrote it
        keep.add(AUTO_AC)
    if replaced:
        notes.append(f"parallel.layout='auto' (the command line) replaces {', '.join(replaced)} of {file}; the "
                     "layout is picked when the job starts")
    p, defaults = cfg.parallel, ParallelConfig()
    rows = cfg.stage_microbatch(0)  # per microbatch of a replica: kept, as the global batch
    values = {k: getattr(p if k in keep else defaults, k) for k in AUTO_KEEPS}
    if "dp" not in keep:  # one replica of each kept shard group, until the pick
        values["dp"] = values["dp_shard"]
    batch = cfg.global_batch // values["dp"]
    if cfg.global_batch % values["dp"] or batch % rows:
        raise UserError(f"parallel.dp_shard={values['dp_shard']} kept beside parallel.layout='auto' cannot split the "
                        f"global batch of {cfg.global_batch} rows into shard groups of whole microbatches of {rows} "
                        "rows; change parallel.dp_shard or the batch.")
    parallel = dataclasses.replace(p, **values, microbatches=max(1, batch // rows), tp_per_stage=[], dp_per_stage=[],
                                   dp_shard_per_stage=[])
    data = dataclasses.replace(cfg.data, global_batch_size=cfg.global_batch, batch_size=batch)
    ac = dataclasses.replace(cfg.activation_checkpoint, mode_per_stage=[])
    return dataclasses.replace(cfg, parallel=parallel, data=data, activation_checkpoint=ac), frozenset(keep)


def _auto_beside_per_stage(data: dict[str, Any], file_keys: set[str], cli_keys: set[str], file: str) -> None:
    """Refuse ``parallel.layout = "auto"`` written where a per-stage key is (before the keys are checked, so the
    sentence is about the contradiction): ``auto`` picks stages of equal shape."""
    if not isinstance(data.get("parallel"), dict) or data["parallel"].get("layout") != "auto":
        return
    level = 2 if "parallel.layout" in cli_keys else 1
    for section, key in PER_STAGE:
        name = f"{section}.{key}"
        lv = 2 if name in cli_keys else 1 if name in file_keys else 0
        if lv >= level:
            raise UserError(f"parallel.layout='auto' picks a layout of equal stages, but {name} "
                            f"({'the command line' if lv == 2 else file}) gives each stage its own shape; drop one "
                            "of them (bimetal plan --per-stage --write writes per-stage shapes).")


def load_config(path: str | Path | None, overrides: dict[str, Any] | list[str] | None = None,
                notes: list[str] | None = None, keep: set[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``; raises ``UserError``.

    A uniform key written beside its per-stage list is refused unless the list overrides it from the command
    line or agrees with it (``uniform_beside_per_stage``); ``notes`` receives the sentences of overrides. With
    ``parallel.layout = "auto"`` the config is made ready for the pick (``auto_layout``) and ``keep`` receives the
    layout keys the pick keeps."""
    data: dict[str, Any] = {}
    file = "the command line"
    if path is not None:
        p = Path(path)
        file = str(p)
        if p.is_dir():
            raise UserError(f"config file {p} is a folder; give the path of a TOML file to --config.")
        data = read_toml(p, f"config file {p} does not exist; check the --config path.",
                         f"config file {p} is not valid TOML ({{error}}); fix the syntax.")
    file_keys = {f"{s}.{k}" for s, body in data.items() if isinstance(body, dict) for k in body}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        body = data.setdefault(section, {})
        if isinstance(body, dict):
            body[key] = value
    try:
        _read_strings(data)
        _auto_beside_per_stage(data, file_keys, set(overrides or {}), file)
        cfg = check(TrainConfig, data, file, _explain(file, set(overrides or {})))  # __post_init__ validates
        said = uniform_beside_per_stage(cfg, file_keys, set(overrides or {}), file)
        if cfg.parallel.layout == "auto":
            cfg, kept = auto_layout(cfg, file_keys, set(overrides or {}), file, said)
            if keep is not None:
                keep |= kept
        if notes is not None:
            notes += said
        return cfg
    except UserError as exc:
        raise blame_file(exc, path, overrides) from None




def blame_file(exc: UserError, path: str | Path | None, overrides: dict[str, Any] | list[str] | None) -> UserError:
    """``exc`` naming the config file when a key its sentence names (``section.key``) was set there.

    A value refused for what it is, or for how it fits with others, is then found in the file that holds it;
    a sentence about keys set only on the command line (or left at their defaults) is kept as it is.
    """
    message = str(exc)
    if path is None or str(path) in message:
        return exc
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return exc
    in_file = {f"{section}.{key}" for section, body in data.items() if isinstance(body, dict) for key in body}
    sections = "|".join(f.name for f in dataclasses.fields(TrainConfig))
    named = {f"{a}.{b}" for a, b in re.findall(rf"\b({sections})\.([a-z_][a-z0-9_]*)\b", message)}
    if named & (in_file - set(overrides or {})):
        return UserError(f"{path}: {message}")
    return exc
