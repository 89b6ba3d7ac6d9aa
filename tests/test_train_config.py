"""Config, tokenizer and data-stream checks that need no process group."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bimetal.config import load_config
from bimetal.errors import UserError
from bimetal.train.data import SHIPPED_CORPUS, TokenStream, load_tokens
from bimetal.train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)


def test_precedence_cli_over_file_over_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[optim]\nlr = 0.01\nwarmup_steps = 3\n[parallel]\npp = 2\nlayers_per_stage = [3, 1]\n")
    cfg = load_config(f, ["--optim.lr=0.5"])
    assert cfg.optim.lr == 0.5 and cfg.optim.warmup_steps == 3 and cfg.optim.weight_decay == 0.1
    assert cfg.parallel.layers_per_stage == [3, 1]
    assert cfg.stage_split(4) == [3, 1]


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[optim]\nlearning_rate = 1\n")
    with pytest.raises(UserError, match=r"optim\.learning_rate.*bad\.toml"):
        load_config(f)


def test_split_must_sum_to_layers() -> None:
    cfg = load_config(None, ["--parallel.pp=2", "--parallel.layers_per_stage=2,1"])
    with pytest.raises(UserError, match="sums to 3.*4 layers"):
        cfg.stage_split(4)


def test_missing_data_file() -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_tokens("/nonexistent/corpus.txt", ByteTokenizer())


def test_byte_tokenizer_roundtrip_and_corpus() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("To be, or not — to be")) == "To be, or not — to be"
    assert SHIPPED_CORPUS.stat().st_size > 300_000
    assert len(load_tokens("", tok)) == SHIPPED_CORPUS.stat().st_size


def test_jsonl_loader(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    assert load_tokens(str(f), ByteTokenizer()).tolist() == [97, 98, 256, 99, 256]


def test_replicas_disjoint_and_resumable() -> None:
    tokens = np.arange(10_001, dtype=np.int64)
    a, b = TokenStream(tokens, 10, 4, 0, 2, seed=3), TokenStream(tokens, 10, 4, 1, 2, seed=3)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert (ya[:, :-1] == xa[:, 1:]).all()
    assert not set(xa[:, 0].tolist()) & set(xb[:, 0].tolist())
    state = a.state_dict()
    want = a.next_batch()[0]
    c = TokenStream(tokens, 10, 4, 0, 2, seed=3)
    c.load_state_dict(state)
    assert (c.next_batch()[0] == want).all()


def test_lr_schedule_warmup_then_cosine() -> None:
    from bimetal.train.optim import lr_factor

    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(55, 100, 10, 0.1) == pytest.approx(0.55)


def test_clip_single_process_matches_torch() -> None:
    import torch

    from bimetal.train.optim import clip_global_norm

    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        (m(torch.ones(2, 3)) * 10).sum().backward()
    want = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5))
    got = clip_global_norm(a, 0.5, None, 1)
    assert got == pytest.approx(want, rel=1e-6)
    grads = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())]
    assert all(g is not None and h is not None and torch.allclose(g, h, rtol=1e-5) for g, h in grads)


@pytest.mark.parametrize("name", ["demo.toml", "llama3-8b-2x8.toml", "qwen2-7b-2x8.toml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / name)
    assert sum(cfg.parallel.layers_per_stage) in (4, 28, 32) and cfg.parallel.pp == 2


def test_bin_shard_is_memory_mapped_and_checked(tmp_path: Path) -> None:
    import torch

    f = tmp_path / "shard.bin"
    np.arange(70_000, 70_000 + 2_001, dtype=np.uint32).tofile(f)
    tokens = load_tokens(str(f), ByteTokenizer(), "uint32")
    assert isinstance(tokens, np.memmap) and int(tokens[0]) == 70_000 and len(tokens) == 2_001
    x, y = TokenStream(tokens, 10, 2).next_batch()
    assert x.dtype == torch.int64 and int(x.min()) >= 70_000 and (y[:, :-1] == x[:, 1:]).all()
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(UserError, match="bin_dtype"):
        load_tokens(str(tmp_path / "odd.bin"), ByteTokenizer(), "uint32")
