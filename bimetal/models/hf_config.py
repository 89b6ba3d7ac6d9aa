"""HF ``config.json`` <-> ``ModelArgs``, in the formats of ``transformers`` 4.x and 5.x.

The two formats differ in where RoPE lives: 4.x writes ``rope_theta`` and ``rope_scaling`` (``null`` or a dict
with ``rope_type``/``type``) at the top level; 5.x writes one ``rope_parameters`` dict holding ``rope_type`` and
``rope_theta`` (or, keyed by layer type, one such dict per type), and ``dtype`` where older 4.x wrote
``torch_dtype``. Both are read. A field bimetal's model does not implement and that would change the model's
math (another RoPE type, partial rotary, sliding-window layers, bias flags the family does not have, a
``head_dim`` override, another activation, attention dropout) is refused naming the field: loading such a
checkpoint with a default in its place would give different logits and no error.

Fields the file leaves out take the defaults ``transformers`` gives them (``rope_theta`` 10000, ``rms_norm_eps``
1e-6, Qwen2's 32 key/value heads), so a sparse config means what it means to the reference implementation.

Export writes the 4.x format (``rope_theta`` + ``rope_scaling``, ``dtype``): the pinned ``transformers`` 4.57.1
reads only that one, and 5.x converts it on load (its ``rope_scaling``/``rope_theta`` compatibility path).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bimetal.errors import UserError
from bimetal.models.args import ARGS_CLASSES, ModelArgs, RopeScaling

HF_MODEL_TYPES = {"llama": "llama3", "qwen2": "qwen2"}
FAMILY_MODEL_TYPE = {v: k for k, v in HF_MODEL_TYPES.items()}
ARCHITECTURES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# transformers' own defaults for fields a config.json may leave out (LlamaConfig / Qwen2Config, 4.57 and 5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama3": {"num_key_value_heads": None, "max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
}
_DEFAULT_THETA = 10000.0
_SCALING_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor"}


def _fail(where: Path, what: str) -> UserError:
    return UserError(f"{where}: {what}")


def _rope_dict(cfg: dict[str, Any], where: Path) -> tuple[str, dict[str, Any]]:
    """(field name, the one RoPE dict) from either format; {} when the config has neither."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if params and scaling and params != scaling:
        raise _fail(where, "has both rope_parameters (transformers 5.x) and rope_scaling (4.x) with different "
                           "values; keep the one the checkpoint was trained with.")
    field, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    if not isinstance(rope, dict):
        raise _fail(where, f"{field} must be a JSON object, not {rope!r}.")
    # 5.x may key the parameters by layer type ({"full_attention": {...}}); only full attention exists here.
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        if set(rope) != {"full_attention"}:
            raise _fail(where, f"{field} is given per layer type ({', '.join(sorted(rope))}); bimetal implements "
                               "full attention only.")
        field, rope = f"{field}.full_attention", rope["full_attention"]
    return field, rope


def _rope(cfg: dict[str, Any], where: Path, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(RoPE base, llama3 scaling or None) from either format, refusing RoPE variants bimetal does not implement."""
    field, rope = _rope_dict(cfg, where)
    top = cfg.get("rope_theta")
    if top is not None and rope.get("rope_theta", top) != top:
        raise _fail(where, f"rope_theta {top} (transformers 4.x) and {field}.rope_theta {rope['rope_theta']} "
                           "(5.x) disagree; keep the one the checkpoint was trained with.")
    theta = rope.get("rope_theta", _DEFAULT_THETA if top is None else top)
    rtype = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    try:
        theta, partial = float(theta), float(partial)
    except (TypeError, ValueError):
        raise _fail(where, f"rope_theta {theta!r} and partial_rotary_factor {partial!r} must be numbers.") from None
    if not (math.isfinite(theta) and theta > 0):
        raise _fail(where, f"rope_theta {theta} must be a positive number.")
    if partial != 1.0:
        raise _fail(where, f"partial_rotary_factor {partial} is not supported; bimetal rotates the whole head "
                           "(1.0).")
    if rtype == "default":
        return theta, None
    if rtype != "llama3":
        raise _fail(where, f"{field}.rope_type {rtype!r} is not supported; bimetal implements 'default' and "
                           "'llama3' RoPE.")
    try:
        vals = {ours: float(rope[hf]) for hf, ours in _SCALING_KEYS.items()}
        # 5.x fills a missing original context with max_position_embeddings; 4.x requires the field.
        orig = int(rope.get("original_max_position_embeddings", max_pos))
    except KeyError as e:
        raise _fail(where, f"{field} has rope_type 'llama3' but no {e.args[0]!r}.") from None
    except (TypeError, ValueError) as e:
        raise _fail(where, f"{field} has a value that is not a number ({e}).") from None
    if vals["high_freq_factor"] <= vals["low_freq_factor"] or vals["factor"] <= 0 or orig <= 0:
        raise _fail(where, f"{field} needs factor > 0, high_freq_factor > low_freq_factor and a positive "
                           f"original_max_position_embeddings; it has {rope}.")
    return theta, RopeScaling(vals["factor"], vals["low_freq_factor"], vals["high_freq_factor"], orig)


def _check_unsupported(cfg: dict[str, Any], family: str, dim: int, heads: int, where: Path) -> None:
    """Refuse fields that change the math in a way this model does not implement, naming the field."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, f"hidden_act {act!r} is not supported; bimetal implements silu (SwiGLU).")
    if cfg.get("head_dim") not in (None, dim // heads):
        raise _fail(where, f"head_dim {cfg['head_dim']} differs from hidden_size/num_attention_heads = "
                           f"{dim // heads}; bimetal does not support a head_dim override.")
    if cfg.get("attention_dropout") not in (None, 0, 0.0):
        raise _fail(where, f"attention_dropout {cfg['attention_dropout']} is not supported; bimetal trains "
                           "without dropout (set it to 0.0).")
    if family == "llama3":
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise _fail(where, f"{flag} true is not supported for llama; bimetal's llama has no biases.")
    else:  # Qwen2 has q/k/v biases and nothing else, whatever a flag says; a flag that disagrees is refused
        if cfg.get("attention_bias") is False:
            raise _fail(where, "attention_bias false disagrees with qwen2, whose q/k/v projections have biases.")
        if cfg.get("mlp_bias"):
            raise _fail(where, "mlp_bias true is not supported for qwen2; its MLP has no biases.")
    if cfg.get("use_sliding_window"):
        raise _fail(where, "use_sliding_window true is not supported; bimetal implements full attention only.")
    kinds = set(cfg.get("layer_types") or [])
    if kinds - {"full_attention"}:
        raise _fail(where, f"layer_types holds {sorted(kinds - {'full_attention'})}; bimetal implements "
                           "full_attention layers only.")


def args_from_hf_config(cfg: dict[str, Any], where: Path | str = "config.json") -> tuple[str, ModelArgs]:
    """(family, args) from an HF config dict (4.x or 5.x); UserError naming a field bimetal does not implement."""
    where = Path(where)
    if not isinstance(cfg, dict):
        raise _fail(where, "is not a JSON object; an HF config.json holds one object of fields.")
    mtype = cfg.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise _fail(where, f"model_type {mtype!r} is not supported; bimetal loads {', '.join(HF_MODEL_TYPES)}.")
    family = HF_MODEL_TYPES[mtype]
    defaults = {**_DEFAULTS[family], **cfg}  # an explicit null keeps its meaning (kv heads = heads)
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_pos = int(defaults["max_position_embeddings"] or _DEFAULTS[family]["max_position_embeddings"])
        kw: dict[str, Any] = {
            "dim": dim, "n_layers": int(cfg["num_hidden_layers"]), "n_heads": heads,
            "n_kv_heads": int(defaults["num_key_value_heads"] or heads), "vocab_size": int(cfg["vocab_size"]),
            "ffn_dim": int(cfg["intermediate_size"]), "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "max_seq_len": max_pos, "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "qkv_bias": family == "qwen2",
        }
    except KeyError as e:
        raise _fail(where, f"config has no {e.args[0]!r}; it must be a complete {mtype} config.") from None
    except (TypeError, ValueError) as e:
        raise _fail(where, f"a model size field is not a number ({e}).") from None
    _check_unsupported(cfg, family, dim, heads, where)
    kw["rope_theta"], kw["rope_scaling"] = _rope(cfg, where, max_pos)
    try:
        return family, ARGS_CLASSES[family](**kw)
    except ValueError as e:
        raise _fail(where, f"inconsistent model shape: {e}.") from None


def hf_config(family: str, args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF ``config.json`` dict for ``args``, in the 4.x format (read by ``transformers`` 4.57 and 5.x)."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": FAMILY_MODEL_TYPE[family],
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "vocab_size": args.vocab_size, "intermediate_size": args.ffn_dim,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "head_dim": args.head_dim,
        "dtype": str(dtype).removeprefix("torch."), "attention_dropout": 0.0, "initializer_range": 0.02,
        "rope_scaling": None,
    }
    if family == "llama3":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers,
                   layer_types=["full_attention"] * args.n_layers)
    if args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_positions}
    return cfg
