"""Hugging Face checkpoint folders: config.json <-> ModelArgs, safetensors weights <-> our parameter names.

``from_hf(path)`` reads ``config.json`` (``model_type`` ``llama`` or ``qwen2``), builds the model on the meta
device, and fills it from ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
``export_hf(model, args, path)`` writes the same layout back. Our RoPE uses HF's rotate-half convention,
so q/k weights are copied as they are, with no permutation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bimetal.errors import UserError
from bimetal.models.args import ARGS_CLASSES, ModelArgs, RopeScaling
from bimetal.models.transformer import Transformer, build_model, prune_to_stage

HF_MODEL_TYPES = {"llama": "llama3", "qwen2": "qwen2"}
FAMILY_MODEL_TYPE = {v: k for k, v in HF_MODEL_TYPES.items()}
ARCHITECTURES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# HF name pattern -> ours; layer names keep the global index.
_LAYER_MAP = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
}
_TOP_MAP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for an HF tensor name, or None for a name we do not know."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def ours_to_hf(name: str) -> str:
    """The HF tensor name of one of our parameter names."""
    for hf, ours in _TOP_MAP.items():
        if name == ours:
            return hf
    parts = name.split(".")  # layers.<i>.<module>.<sub>.<weight|bias>
    inner = ".".join(parts[2:-1])
    rev = {v: k for k, v in _LAYER_MAP.items()}
    if parts[0] != "layers" or inner not in rev:
        raise ValueError(f"no HF name for parameter {name!r}")
    return f"model.layers.{parts[1]}.{rev[inner]}.{parts[-1]}"


def _fail(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}")


def args_from_hf_config(cfg: dict[str, Any], where: Path | str = "config.json") -> tuple[str, ModelArgs]:
    """(family, args) from an HF config dict; UserError for a model or option bimetal does not implement."""
    where = Path(where)
    mtype = cfg.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise _fail(where, f"model_type {mtype!r} is not supported; bimetal loads {', '.join(HF_MODEL_TYPES)}.")
    family = HF_MODEL_TYPES[mtype]
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kw: dict[str, Any] = {
            "dim": dim, "n_layers": int(cfg["num_hidden_layers"]), "n_heads": heads,
            "n_kv_heads": int(cfg.get("num_key_value_heads") or heads), "vocab_size": int(cfg["vocab_size"]),
            "ffn_dim": int(cfg["intermediate_size"]), "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(cfg.get("rope_theta", 10000.0)),
            "max_seq_len": int(cfg.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise _fail(where, f"config has no {e.args[0]!r}; it must be a complete {mtype} config.") from None
    if cfg.get("hidden_act", "silu") != "silu":
        raise _fail(where, f"hidden_act {cfg['hidden_act']!r} is not supported; only silu (SwiGLU) is.")
    if cfg.get("head_dim") not in (None, dim // heads):
        raise _fail(where, f"head_dim {cfg['head_dim']} differs from hidden_size/num_attention_heads; not supported.")
    if family == "llama3":
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise _fail(where, "attention_bias/mlp_bias are not supported for llama; set them false.")
        kw["qkv_bias"] = False
    else:
        if cfg.get("use_sliding_window"):
            raise _fail(where, "use_sliding_window is not supported; set it false.")
        kw["qkv_bias"] = True
    scaling = cfg.get("rope_scaling")
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type"))
        if rtype == "llama3":
            kw["rope_scaling"] = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                             float(scaling["high_freq_factor"]),
                                             int(scaling["original_max_position_embeddings"]))
        elif rtype != "default":
            raise _fail(where, f"rope_scaling type {rtype!r} is not supported; only llama3 scaling is.")
    try:
        return family, ARGS_CLASSES[family](**kw)
    except ValueError as e:
        raise _fail(where, f"inconsistent model shape: {e}.") from None


def hf_config(family: str, args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF ``config.json`` dict for ``args`` (loadable by ``transformers`` and by ``from_hf``)."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": FAMILY_MODEL_TYPE[family],
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "vocab_size": args.vocab_size, "intermediate_size": args.ffn_dim,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "head_dim": args.head_dim,
        "torch_dtype": str(dtype).removeprefix("torch."), "attention_dropout": 0.0, "initializer_range": 0.02,
    }
    if family == "llama3":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, max_window_layers=args.n_layers)
    if args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_positions}
    return cfg


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise _fail(index, f"is not a safetensors index ({e}); re-save the checkpoint.") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise _fail(folder, f"weight file {f.name} is missing; bimetal reads safetensors checkpoints "
                                "(model.safetensors or the shards of model.safetensors.index.json).")
    return files


def from_hf(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
            stage: tuple[list[int], bool, bool] | None = None) -> Transformer:
    """Build the model described by an HF checkpoint folder and load its weights (cast to ``dtype``).

    ``stage=(layer_ids, first, last)`` loads one pipeline stage only (as ``prune_to_stage`` would cut it),
    allocating and reading only that stage's tensors.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give the path of an HF checkpoint folder (config.json + "
                        "safetensors).")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise _fail(folder, "has no config.json; give the folder an HF checkpoint was saved to.")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise _fail(cfg_path, f"is not valid JSON ({e}).") from None
    family, args = args_from_hf_config(cfg, cfg_path)
    files = _weight_files(folder)
    model = build_model(family, args, device="meta")
    known = {n for n, _ in model.named_parameters()}  # the whole model's names, to tell "other stage" from "wrong"
    if stage is not None:
        prune_to_stage(model, *stage)
    model = model.to_empty(device=device)
    model.reset_buffers()
    params = dict(model.named_parameters())  # a tied matrix appears once, as tok_embeddings.weight
    loaded: set[str] = set()
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for hf_name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    ours = hf_to_ours(hf_name)
                    if ours == "output.weight" and args.tie_embeddings:
                        continue  # some tied checkpoints also store lm_head; the embedding is the one used
                    if ours in known and ours not in params:
                        continue  # held by another pipeline stage
                    if ours is None or ours not in params:
                        raise _fail(f, f"tensor {hf_name} does not belong to a {family} model with this config; "
                                       "check that config.json matches the weights.")
                    t = sf.get_tensor(hf_name)
                    p = params[ours]
                    if tuple(t.shape) != tuple(p.shape):
                        raise _fail(f, f"tensor {hf_name} has shape {list(t.shape)} but config.json implies "
                                       f"{list(p.shape)}; check that config.json matches the weights.")
                    p.copy_(t.to(dtype))
                    loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise _fail(folder, f"the checkpoint lacks {len(missing)} tensors, e.g. {ours_to_hf(missing[0])}; "
                            "check that config.json matches the weights.")
    return model.to(dtype=dtype)


def export_hf(model: Transformer, args: ModelArgs, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (HF names) for the whole ``model``; returns the folder.

    A pruned pipeline stage cannot be exported on its own (gather the stages into one model first).
    """
    if model.tok_embeddings is None or model.output is None or model.norm is None or \
            len(model.layers) != args.n_layers:
        raise UserError("export_hf needs the whole model, not one pipeline stage; load the stages' weights into "
                        "one model built with build_model first.")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied: only tok_embeddings.weight appears, as HF stores it
        tensors[ours_to_hf(name)] = p.detach().to("cpu").contiguous()
    dtype = next(iter(tensors.values())).dtype
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(model.family, args, dtype), indent=2) + "\n")
    return folder
