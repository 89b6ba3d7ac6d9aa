"""HF import/export against ``transformers``: logits of folders it wrote, export round-trip, bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bimetal.errors import UserError
from bimetal.models import FLAVOURS, build_model, export_hf, from_hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")
torch.set_num_threads(1)

VOCAB = 300
COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "initializer_range": 0.1}  # larger than HF's 0.02 so logits are O(1) and 1e-4 is a tight bound


def _llama(tmp: Path, **extra: object) -> Path:
    # head size 16, base 10000, original context 256: wavelengths fall in all three llama3 scaling regimes.
    cfg = transformers.LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp, **extra)
    return tmp


def _qwen2(tmp: Path, tied: bool) -> Path:
    cfg = transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=tied, use_sliding_window=False)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero; random ones check that they are loaded and used
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp)
    return tmp


def _hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(x).logits


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(9))


def test_llama3_with_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    folder = _llama(tmp_path)
    model = from_hf(folder)
    assert model.family == "llama3" and model.args.rope_scaling is not None
    assert model.args.rope_scaling.original_max_positions == 256 and not model.args.qkv_bias
    x = _ids()
    with torch.no_grad():
        ours = model(x)
    ref = _hf_logits(folder, x)
    assert (ours - ref).abs().max() < 1e-4
    # The scaling matters here: plain RoPE gives different logits, so the test would notice it missing.
    plain = build_model("llama3", model.args.__class__(**{**model.args.__dict__, "rope_scaling": None}))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(x) - ref).abs().max() > 1e-3


def test_stages_loaded_from_hf_chain_to_the_full_model(tmp_path: Path) -> None:
    folder = _llama(tmp_path, max_shard_size="100KB")
    full = from_hf(folder)
    s0 = from_hf(folder, stage=([0], True, False))
    s1 = from_hf(folder, stage=([1, 2], False, True))
    assert list(s0.layers) == ["0"] and s0.output is None and list(s1.layers) == ["1", "2"]
    x = _ids(16)
    with torch.no_grad():
        assert torch.equal(s1(s0(x)), full(x))


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    folder = _llama(tmp_path, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    x = _ids(16)
    with torch.no_grad():
        assert (from_hf(folder)(x) - _hf_logits(folder, x)).abs().max() < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_matches_transformers(tmp_path: Path, tied: bool) -> None:
    folder = _qwen2(tmp_path, tied)
    model = from_hf(folder)
    assert model.family == "qwen2" and model.args.qkv_bias and model.args.tie_embeddings == tied
    assert model.output is not None and model.tok_embeddings is not None
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    x = _ids()
    with torch.no_grad():
        assert (model(x) - _hf_logits(folder, x)).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_export_round_trip_loads_in_transformers(tmp_path: Path, family: str) -> None:
    args = FLAVOURS[family]["debug"]
    model = build_model(family, args, seed=11)
    export_hf(model, args, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == {"llama3": "llama", "qwen2": "qwen2"}[family]
    x = torch.randint(0, args.vocab_size, (2, 30))
    with torch.no_grad():
        ours = model(x)
        again = from_hf(tmp_path)(x)
    assert torch.equal(ours, again)
    assert (ours - _hf_logits(tmp_path, x)).abs().max() < 1e-4


def test_export_refuses_a_stage(tmp_path: Path) -> None:
    from bimetal.models import prune_to_stage

    args = FLAVOURS["llama3"]["debug"]
    with pytest.raises(UserError, match="whole model"):
        export_hf(prune_to_stage(build_model("llama3", args), [0, 1], True, False), args, tmp_path)


def test_bad_folders(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a folder"):
        from_hf(tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        from_hf(tmp_path)
    folder = _qwen2(tmp_path / "q", tied=False)
    cfg = json.loads((folder / "config.json").read_text())

    def write(**changes: object) -> None:
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))

    write(model_type="gpt2")
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        from_hf(folder)
    write(intermediate_size=128)
    with pytest.raises(UserError, match=r"tensor model\.layers\.\d+\.mlp\.\w+_proj\.weight has shape"):
        from_hf(folder)
    write(num_hidden_layers=4)
    with pytest.raises(UserError, match=r"lacks \d+ tensors, e\.g\. model\.layers\.3\."):
        from_hf(folder)
    write(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UserError, match="yarn"):
        from_hf(folder)
    write()
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match="model.safetensors is missing"):
        from_hf(folder)
