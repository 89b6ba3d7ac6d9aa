"""HF import/export against ``transformers``: logits of folders it wrote, export round-trip, bad folders.

The pinned ``transformers`` (4.57.1) writes the 4.x config format; ``tests/data/hf5/*.json`` are config.json
files written by ``transformers`` 5.25.0 (``save_pretrained``) for the same model shapes as ``_llama``/``_qwen2``
here, so the same weights can be loaded under either format and compared with the reference's logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bimetal.errors import UserError
from bimetal.models import FLAVOURS, args_from_hf_config, build_model, export_hf, from_hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")
torch.set_num_threads(1)

VOCAB = 300
HF5 = Path(__file__).parent / "data" / "hf5"
COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "initializer_range": 0.1}  # larger than HF's 0.02 so logits are O(1) and 1e-4 is a tight bound


def _llama(tmp: Path, **extra: object) -> Path:
    # head size 16, base 50000 (not the default 10000, so a base left unread shows), original context 256:
    # wavelengths fall in all three llama3 scaling regimes.
    cfg = transformers.LlamaConfig(**COMMON, rope_theta=50000.0, tie_word_embeddings=False,
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

    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="is not a JSON object"):
        from_hf(folder)
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


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_5_config_gives_the_same_logits(tmp_path: Path, family: str) -> None:
    folder = _llama(tmp_path) if family == "llama" else _qwen2(tmp_path, tied=True)
    v4 = json.loads((folder / "config.json").read_text())
    assert "rope_theta" in v4 and "rope_parameters" not in v4  # the pinned reference writes the 4.x format
    x = _ids()
    ref = _hf_logits(folder, x)
    v5 = json.loads((HF5 / f"{family}.json").read_text())
    assert v5["transformers_version"].startswith("5.") and "rope_theta" not in v5 and "rope_scaling" not in v5
    assert v5["rope_parameters"]["rope_theta"] == v4["rope_theta"] != 10000.0
    (folder / "config.json").write_text(json.dumps(v5))
    model = from_hf(folder)
    assert model.args == args_from_hf_config(v4)[1]
    with torch.no_grad():
        assert (model(x) - ref).abs().max() < 1e-4


def _base(family: str) -> dict[str, object]:
    return json.loads((HF5 / f"{family}.json").read_text())


def _v4(family: str) -> dict[str, object]:
    """The 5.x fixture rewritten in the 4.x layout (top-level rope_theta, rope_scaling or null)."""
    cfg = _base(family)
    rope = dict(cfg.pop("rope_parameters"))  # type: ignore[arg-type]
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return cfg


def _rope5(**changes: object) -> dict[str, object]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, **changes}}


# (family, base format, changed fields, the field the error must name): every field that would change the
# model's math and that bimetal does not implement.
REFUSED = [
    ("llama", "4.x", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
    ("llama", "4.x", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
    ("llama", "5.x", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
    ("qwen2", "5.x", _rope5(rope_type="longrope"), "rope_parameters.rope_type 'longrope'"),
    ("qwen2", "5.x", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_parameters.full_attention.rope_type 'yarn'"),
    ("qwen2", "5.x", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                          "sliding_attention": {"rope_type": "default"}}}, "per layer type"),
    ("qwen2", "5.x", _rope5(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ("llama", "4.x", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("llama", "5.x", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e4, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0}}, "no 'factor'"),
    ("llama", "4.x", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}, "both rope_parameters"),
    ("qwen2", "4.x", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "disagree"),
    ("llama", "5.x", {"head_dim": 32}, "head_dim 32"),
    ("qwen2", "4.x", {"head_dim": 8}, "head_dim 8"),
    ("llama", "4.x", {"attention_bias": True}, "attention_bias true"),
    ("llama", "5.x", {"mlp_bias": True}, "mlp_bias true"),
    ("qwen2", "5.x", {"attention_bias": False}, "attention_bias false"),
    ("qwen2", "4.x", {"mlp_bias": True}, "mlp_bias true"),
    ("qwen2", "4.x", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window true"),
    ("qwen2", "5.x", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("llama", "5.x", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("qwen2", "5.x", {"attention_dropout": 0.1}, "attention_dropout 0.1"),
]


@pytest.mark.parametrize(("family", "fmt", "changes", "field"), REFUSED,
                         ids=[f"{f}-{v}-{'+'.join(c)}" for f, v, c, _ in REFUSED])
def test_unsupported_field_is_refused_by_name(family: str, fmt: str, changes: dict[str, object], field: str) -> None:
    base = _v4(family) if fmt == "4.x" else _base(family)
    args_from_hf_config(base)  # the unchanged config loads
    with pytest.raises(UserError, match=re.escape(field)) as err:
        args_from_hf_config({**base, **changes})
    assert str(err.value).count(". ") == 0 and "\n" not in str(err.value)  # one sentence


def test_absent_fields_take_the_reference_defaults() -> None:
    # A sparse config means what it means to transformers (Qwen2: 32 kv heads; both: base 10000, eps 1e-6).
    for family, config_cls in (("llama", transformers.LlamaConfig), ("qwen2", transformers.Qwen2Config)):
        cfg = {k: v for k, v in _v4(family).items() if k not in ("num_key_value_heads", "rope_theta",
                                                                  "rms_norm_eps", "rope_scaling")}
        cfg.update(num_attention_heads=32, hidden_size=512)  # head size 16, as head_dim says
        ref = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")})
        args = args_from_hf_config(cfg)[1]
        assert (args.n_kv_heads, args.rope_theta, args.norm_eps) == (ref.num_key_value_heads, ref.rope_theta,
                                                                     ref.rms_norm_eps)
