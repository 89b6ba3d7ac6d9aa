"""Models: shapes, grouped-query attention, causality, stage pruning, deterministic init, FLOPs, refusals."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from bimetal import models
from bimetal.errors import UserError
from bimetal.models import FLAVOURS, LlamaArgs, Qwen2Args, build_model, build_stage, prune_to_stage

torch.set_num_threads(1)
TINY = LlamaArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_dim=48, max_seq_len=64)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_debug_shapes_and_param_count(family: str) -> None:
    m = build_model(family, "debug")
    args = FLAVOURS[family]["debug"]
    x = torch.randint(0, args.vocab_size, (2, 24))
    assert m(x).shape == (2, 24, args.vocab_size)
    assert sorted(m.layers.keys(), key=int) == [str(i) for i in range(args.n_layers)]
    assert m.num_params() == args.num_params()
    assert m.num_params(exclude_embedding=True) == args.num_params() - args.vocab_size * args.dim
    assert ("layers.0.attention.wq.bias" in dict(m.named_parameters())) == (family == "qwen2")
    assert args.vocab_size >= 258  # byte tokenizer: 256 bytes + <eos> + <pad>


def test_gqa_equals_attention_with_repeated_kv_heads() -> None:
    """A GQA model equals a full multi-head model whose k/v weights repeat each kv head for its query group."""
    gqa = build_model("llama3", TINY, seed=3)
    mha = build_model("llama3", dataclasses.replace(TINY, n_kv_heads=TINY.n_heads), seed=4)
    rep, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    state = gqa.state_dict()
    for k, v in list(state.items()):
        if k.endswith(("wk.weight", "wv.weight")):
            state[k] = v.view(TINY.n_kv_heads, hd, TINY.dim).repeat_interleave(rep, 0).reshape(-1, TINY.dim)
    mha.load_state_dict(state)
    x = torch.randint(0, TINY.vocab_size, (2, 10))
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)
    assert gqa.get_parameter("layers.0.attention.wk.weight").shape == (TINY.n_kv_heads * hd, TINY.dim)


def test_gqa_keeps_key_value_heads_grouped() -> None:
    """SDPA takes the grouped heads itself (enable_gqa): nothing saved for the backward has a key/value tensor
    repeated to the query heads; the output equals that of explicitly repeated heads bit for bit, the gradients
    within float32 rounding (a group's key/value gradient is summed in another order)."""
    block = build_model("llama3", TINY, seed=3).layers["0"].attention
    b, s, hd = 2, 10, TINY.head_dim
    x = torch.randn(b, s, TINY.dim, requires_grad=True)
    cos, sin = torch.ones(s, hd), torch.zeros(s, hd)
    shapes: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        out = block(x, cos, sin)
    assert (b, TINY.n_kv_heads, s, hd) in shapes and (b, TINY.n_heads, s, hd) in shapes  # k/v grouped, q whole
    assert shapes.count((b, TINY.n_heads, s, hd)) == 2  # q and the attention output: no repeated k or v
    out.sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    q = block.wq(x).view(b, s, -1, hd).transpose(1, 2)
    k, v = (w(x).view(b, s, -1, hd).transpose(1, 2).repeat_interleave(2, dim=1) for w in (block.wk, block.wv))
    ref = block.wo(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                   .reshape(b, s, -1))
    x.grad = None
    block.zero_grad()
    ref.sum().backward()
    assert torch.equal(out, ref)
    for g, r in zip(grads, [x.grad, *(p.grad for p in block.parameters())]):  # summed over a group in another order
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    m = build_model("qwen2", "debug")
    x = torch.randint(0, 258, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 258
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


@pytest.mark.parametrize("split", [[3, 1], [1, 1, 2], [2, 2]])
def test_stages_chained_equal_full_model(split: list[int]) -> None:
    full = build_model("llama3", "debug", seed=7)
    x = torch.randint(0, 258, (2, 20))
    expected = full(x)
    h: torch.Tensor = x
    start = 0
    for i, n in enumerate(split):
        ids = list(range(start, start + n))
        stage = prune_to_stage(build_model("llama3", "debug", seed=7), ids, i == 0, i == len(split) - 1)
        assert list(stage.layers.keys()) == [str(j) for j in ids]  # global keys kept
        assert (stage.tok_embeddings is not None) == (i == 0)
        assert (stage.output is not None) == (stage.norm is not None) == (i == len(split) - 1)
        h = stage(h)
        if i < len(split) - 1:
            assert h.shape == (2, 20, full.args.dim)
        start += n
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_stage_gradients_match_full_model() -> None:
    full = build_model("qwen2", "debug", seed=1)
    s0 = prune_to_stage(copy.deepcopy(full), [0, 1], True, False)
    s1 = prune_to_stage(copy.deepcopy(full), [2, 3], False, True)
    x = torch.randint(0, 258, (2, 12))
    full(x).square().mean().backward()
    s1(s0(x)).square().mean().backward()
    g_full = {n: p.grad for n, p in full.named_parameters()}
    for stage in (s0, s1):
        for n, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, g_full[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_build_stage_equals_pruned_full_model(family: str) -> None:
    for ids, first, last in [([0, 1, 2], True, False), ([3], False, True), ([1, 2], False, False)]:
        a = prune_to_stage(build_model(family, "debug", seed=2), ids, first, last)
        b = build_stage(family, "debug", ids, first, last, seed=2)
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
        assert torch.equal(a.rope_inv_freq, b.rope_inv_freq)


def test_deterministic_init_independent_of_global_rng() -> None:
    torch.manual_seed(1)
    a = build_model("llama3", "debug", seed=5)
    torch.manual_seed(2)
    b = build_model("llama3", "debug", seed=5)
    c = build_model("llama3", "debug", seed=6)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if not n.endswith(("norm.weight", ".bias")):
            assert not torch.equal(p, r), n
    # Different tensors of one model are not copies of one stream.
    wq0, wq1 = a.get_parameter("layers.0.attention.wq.weight"), a.get_parameter("layers.1.attention.wq.weight")
    assert not torch.equal(wq0, wq1)
    assert abs(float(wq0.detach().std()) - 0.02) < 0.002


def test_flops_per_token_llama3_8b_and_qwen2_7b() -> None:
    llama = FLAVOURS["llama3"]["llama3-8b"]
    assert llama.num_params() == 8_030_261_248  # Meta-Llama-3-8B, as published
    assert llama.flops_per_token(8192) == pytest.approx(57.9e9, rel=1e-3)  # ../shared/HARDWARE.md
    # Qwen2-7B by hand: per layer q/o 3584^2 each, k/v 3584*512 each, qkv bias 3584+2*512,
    # SwiGLU 3*3584*18944, two norms 2*3584; 28 layers, final norm, untied 152064x3584 embedding and head.
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
    assert layer == 233_057_792
    qwen = FLAVOURS["qwen2"]["qwen2-7b"]
    n_prime = 28 * layer + 3584 + 152064 * 3584
    assert qwen.num_params() == n_prime + 152064 * 3584 == 7_615_616_512
    assert qwen.flops_per_token(4096) == 6 * n_prime + 12 * 28 * 3584 * 4096
    # The model's method gives the whole model's figure even on a pruned stage.
    m = prune_to_stage(build_model("llama3", "debug"), [3], False, True)
    assert m.flops_per_token(128) == FLAVOURS["llama3"]["debug"].flops_per_token(128)
    assert m.num_params() < FLAVOURS["llama3"]["debug"].num_params()


def test_tied_embeddings_share_one_matrix_and_refuse_split() -> None:
    args = Qwen2Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, ffn_dim=48, tie_embeddings=True)
    m = build_model("qwen2", args)
    assert m.output is not None and m.tok_embeddings is not None
    assert m.output.weight is m.tok_embeddings.weight
    assert m.num_params() == args.num_params() == m.num_params(exclude_embedding=True)
    prune_to_stage(copy.deepcopy(m), [0, 1], True, True)  # one stage holding both ends is fine
    with pytest.raises(UserError, match="tied embeddings"):
        prune_to_stage(m, [0], True, False)


def test_refusals() -> None:
    with pytest.raises(UserError, match="family"):
        build_model("gpt2", "debug")
    with pytest.raises(UserError, match="flavour"):
        build_model("llama3", "qwen2-7b")
    with pytest.raises(UserError, match="Qwen2Args"):
        build_model("qwen2", FLAVOURS["llama3"]["debug"])
    with pytest.raises(UserError, match="layers_per_stage"):
        prune_to_stage(build_model("llama3", TINY), [2, 3], False, True)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaArgs(n_heads=4, n_kv_heads=3)


def test_meta_build_allocates_nothing() -> None:
    m = build_model("llama3", "llama3-8b", device="meta")
    assert m.get_parameter("layers.31.feed_forward.w1.weight").is_meta
    assert m.num_params() == models.FLAVOURS["llama3"]["llama3-8b"].num_params()
