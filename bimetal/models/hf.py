"""Hugging Face checkpoint folders: config.json <-> ModelArgs, safetensors weights <-> our parameter names.

``from_hf(path)`` reads ``config.json`` (``model_type`` ``llama`` or ``qwen2``), builds the model on the meta
device, and fills it from ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
``export_hf(model, args, path)`` writes the same layout back (``bimetal.models.hf_write``: one model per
folder). ``config.json`` itself (both ``transformers`` formats, the fields refused) is
``bimetal.models.hf_config``. Our RoPE uses HF's rotate-half convention, so q/k weights are copied as they
are, with no permutation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from bimetal.errors import UserError
from bimetal.models.args import ModelArgs
from bimetal.models.hf_config import args_from_hf_config, hf_config
from bimetal.models.hf_write import write_model_folder
from bimetal.models.transformer import Transformer, build_model, prune_to_stage

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


def export_hf(model: Transformer, args: ModelArgs, path: str | Path, max_shard_bytes: int = 0) -> Path:
    """Write ``config.json`` and the weights (HF names) of the whole ``model``; returns the folder.

    ``max_shard_bytes`` > 0 shards the weights as transformers does (``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``); 0 writes one ``model.safetensors``. The folder then holds this model alone:
    an older export there is replaced whole, other files are kept, and a folder holding weights bimetal did not
    write is refused (``bimetal.models.hf_write``). A pruned pipeline stage cannot be exported on its own
    (gather the stages into one model first).
    """
    if model.tok_embeddings is None or model.output is None or model.norm is None or \
            len(model.layers) != args.n_layers:
        raise UserError("export_hf needs the whole model, not one pipeline stage; load the stages' weights into "
                        "one model built with build_model first.")
    if max_shard_bytes < 0:
        raise UserError(f"max_shard_bytes={max_shard_bytes} must be 0 (one file) or more.")
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied: only tok_embeddings.weight appears, as HF stores it
        tensors[ours_to_hf(name)] = p.detach().to("cpu").contiguous()
    dtype = next(iter(tensors.values())).dtype
    config_text = json.dumps(hf_config(model.family, args, dtype), indent=2) + "\n"
    return write_model_folder(path, tensors, config_text, max_shard_bytes)
