"""Planner cost terms against hand-computed values, search behaviour, CLI and spec validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bimetal.errors import UserError
from bimetal.plan import cost
from bimetal.plan.cli import main
from bimetal.plan.search import evaluate, search
from bimetal.plan.spec import ClusterSpec, load_spec, parse_spec

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "configs" / "clusters").glob("*.toml"))


def test_flops_per_token() -> None:
    llama = cost.MODELS["llama3-8b"]
    assert cost.flops_per_token(llama, 8192) / 1e9 == pytest.approx(57.9, abs=0.05)
    # Qwen2-7B by hand: per layer 2*3584^2 + 2*3584*512 + 3*3584*18944 + 2*3584
    # = 25,690,112 + 3,670,016 + 203,685,888 + 7,168 = 233,053,184 (qkv biases ignored); 28 layers,
    # plus head 3584*152064 + 3584; attention 12*28*3584*8192.
    q = cost.MODELS["qwen2-7b"]
    n = 28 * 233_053_184 + 3584 * 152064 + 3584
    assert q.layer_params == 233_053_184
    assert cost.flops_per_token(q, 8192) == pytest.approx(6 * n + 12 * 28 * 3584 * 8192)


def test_activation_bubble_allreduce() -> None:
    assert cost.activation_bytes(1, 8192, 4096) == 64 * 2**20
    assert cost.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cost.bubble_fraction(1, 8) == 0.0
    assert cost.ring_allreduce_seconds(8e9, 8, 100) == pytest.approx(8e9 * 2 * 7 / 8 / 100e9)


def test_memory_per_stage() -> None:
    m = cost.MODELS["llama3-8b"]
    got = cost.stage_memory(m, 4, first=False, last=False, tp=1, micro_batch=1, seq=8192, in_flight=2)
    # By hand: per token a block keeps 26*4096 + 4*(4096 + 1024) + 8*14336 + 8 + 4*32 = 241,800 bytes (q and the
    # attention output whole, k and v as 8 grouped heads of 128); the stage adds
    # the RoPE tables (2 * 8192 * 128 * 4) and its output in bf16 (the boundary dtype); bf16 copies of the block
    # matrices; AdamW
    # keeps a float32 step counter for each of the 4 x 9 parameter tensors.
    assert got["params"] == got["grads"] == (got["optimizer"] - 4 * 36) // 2 == 4 * 4 * m.layer_params
    assert got["activations"] == 2 * (4 * 8192 * 241_800 + 8 * 8192 * 128 + 8192 * 4096 * 2)
    assert got["weight_copies"] == 2 * 4 * 2 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert got["gathered"] == got["unsharded_grads"] == 0
    assert got["transient"] == 0 and got["total"] == cost.stage_memory_bytes(m, 4, False, False, 1, 1, 8192, 2)
    # FSDP over 8 divides the parameter state and drops the per-microbatch copies; tp=2 halves the matrices.
    # Under a pipeline the stage's tp slices stay gathered in bf16 through the step, and with more than one
    # microbatch per reduction their float32 unsharded gradients accumulate; blocks compute on a bf16
    # residual stream (16*4096 instead of 26*4096 per token).
    sharded = cost.stage_memory(m, 4, False, False, tp=2, micro_batch=1, seq=8192, in_flight=2, dp_shard=8)
    norms = 2 * 4096
    local = 4 * ((m.layer_params - norms) // 2 + norms)
    assert sharded["params"] == 4 * -(-local // 8)
    assert sharded["gathered"] == 2 * local and sharded["unsharded_grads"] == 4 * local
    assert sharded["weight_copies"] == 0 and sharded["activations"] < got["activations"]
    block = 16 * 4096 + 4 * (4096 + 1024) // 2 + 8 * 14336 // 2 + 8 + 4 * 32 // 2
    # The stage output the schedule holds is this tp rank's half; torch's stage keeps a bf16 receive buffer
    # per microbatch (2 here) for the activation in and one for the gradient back, each a tp share.
    assert sharded["activations"] == 2 * (4 * 8192 * block + 4 * 8192 * 128 + 8192 * 4096 * 2 // 2)
    assert sharded["recv_buffers"] == 2 * 2 * 8192 * 4096 * 2 // 2 == got["recv_buffers"] // 2
    # A float32 boundary (parallel.pp_boundary_dtype = "float32") doubles the buffers and the held output.
    f32 = cost.stage_memory(m, 4, False, False, tp=1, micro_batch=1, seq=8192, in_flight=2, boundary_size=4)
    assert f32["recv_buffers"] == 2 * got["recv_buffers"]
    assert f32["activations"] - got["activations"] == 2 * 8192 * 4096 * 2
    one_mb = cost.stage_memory(m, 4, False, False, 2, 1, 8192, 1, dp_shard=8, backwards=1)
    assert one_mb["unsharded_grads"] == 0 and one_mb["gathered"] == 2 * local
    # Without a pipeline each block is resharded after its forward: two gathered blocks are transient.
    flat = cost.stage_memory(m, 4, False, False, 2, 1, 8192, 1, dp_shard=8, pipelined=False)
    assert flat["gathered"] == 0 and flat["transient"] == local // 4 * (2 * 2 + 2 + 4)
    full = cost.stage_memory(m, 4, False, False, 1, 1, 8192, 2, ac="full")
    assert full["activations"] == 2 * (4 * 8192 * 4096 * 4 + 8 * 8192 * 128 + 8192 * 4096 * 2)
    # tp splits the vocabulary matrices too: the last stage's output projection is 1/tp per rank.
    last1 = cost.stage_memory(m, 1, False, True, 1, 1, 8192, 1)
    last2 = cost.stage_memory(m, 1, False, True, 2, 1, 8192, 1)
    assert last1["params"] - last2["params"] == 4 * (m.layer_params - norms) // 2 + 4 * 4096 * 128256 // 2


def _spec(nv_eff: float, amd_eff: float, mem_gb: float = 141.0) -> ClusterSpec:
    g = {"count": 1, "gpus_per_node": 8, "nics_per_node": 8, "nic_gbps": 400, "intra_gbps": 400,
         "gpudirect": True, "memory_gb": mem_gb}
    return parse_spec({"group": [g | {"vendor": "nvidia", "gpu": "H200", "efficiency": nv_eff, "name": "nv"},
                                 g | {"vendor": "amd", "gpu": "MI325X", "efficiency": amd_eff, "name": "amd"}]},
                      "test.toml")


def test_uneven_split_when_one_vendor_faster() -> None:
    # MI325X peak 1307 * 0.3 = 392 TF/s vs H200 989 * 0.6 = 593: the NVIDIA stage must get more layers.
    p = evaluate(_spec(0.6, 0.3), "llama3-8b", 8192, 256, pp=2, dp=8, tp=1, micro_batch=1, transport="cpu-forward")
    assert p is not None
    assert p.layer_split[0] > p.layer_split[1] and sum(p.layer_split) == 32
    even = evaluate(_spec(0.6, 0.3), "llama3-8b", 8192, 256, 2, 8, 1, 1, "cpu-forward", split=[16, 16])
    assert even is not None and p.tokens_per_s > even.tokens_per_s * 1.05


def test_memory_rejection_has_reason() -> None:
    ok, rejected = search(_spec(0.6, 0.6, mem_gb=24.0), "llama3-8b", 8192, 256)
    assert rejected
    assert "GB per GPU" in rejected[0].rejected and "24 GB" in rejected[0].rejected
    assert all(max(p.memory) <= 24e9 * 0.9 for p in ok)


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
@pytest.mark.parametrize("model", ["llama3-8b", "qwen2-7b"])
def test_cli_ranks_plans_and_writes_config(spec: Path, model: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best.toml"
    assert main([str(spec), "--model", model, "--json", "--write", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    tps = [p["tokens_per_s"] for p in data["plans"]]
    assert tps == sorted(tps, reverse=True) and tps[0] > 0
    assert data["homogeneous_tokens_per_s"]["nvidia"] > 0 and data["homogeneous_tokens_per_s"]["amd"] > 0
    import tomllib
    cfg = tomllib.loads(out.read_text())
    assert cfg["model"]["flavour"] == model
    assert sum(cfg["parallel"]["layers_per_stage"]) == cost.MODELS[model].layers
    assert cfg["parallel"]["pp"] > 1  # dp across vendors only with --allow-cross-vendor-dp
    from bimetal.config import load_config
    from bimetal.train.dryrun import report
    tc = load_config(str(out), [])
    assert tc.stage_split(cost.MODELS[model].layers) == cfg["parallel"]["layers_per_stage"]
    best = next(p for p in data["plans"] if p["pp"] > 1)
    assert (tc.parallel.tp, tc.parallel.dp_shard, tc.activation_checkpoint.mode) == (
        best["tp"], best["dp_shard"], best["ac"])
    # Every plan the planner writes is sized by the dry-run as the planner sized it (within 10 %).
    for stage, planned in zip(report(tc), best["memory"]):
        assert stage.fits and abs(stage.total - planned) <= 0.1 * stage.total


def test_write_cross_vendor_dp_only_when_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib
    spec = str(ROOT / "configs" / "clusters" / "h200_mi325x.toml")
    out = tmp_path / "x.toml"
    ok, rejected = search(load_spec(spec), "qwen2-7b", 4096, 128)
    assert ok[0].pp == 1  # the best plan spans vendors with dp
    assert main([spec, "--model", "qwen2-7b", "--seq", "4096", "--global-batch", "128", "--write", str(out),
                 "--allow-cross-vendor-dp"]) == 0
    par = tomllib.loads(out.read_text())["parallel"]
    assert par["pp"] == 1 and par["allow_cross_vendor_dp"] is True
    assert 8 % par["dp_shard"] == 0  # FSDP shards stay inside one 8-GPU island, replicas cross vendors
    # qwen2-7b has 4 key/value heads: no plan splits them 8 ways.
    assert all(p.tp <= 4 for p in ok + rejected)


def test_bad_spec_names_key_and_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[group]]\nvendor = "nvidia"\ngpu = "H200"\ngpus_per_node = 8\nnics_per_node = "eight"\n')
    with pytest.raises(UserError, match=r"bad\.toml.*nics_per_node"):
        load_spec(bad)
    bad.write_text('[[group]]\nvendor = "intel"\n')
    with pytest.raises(UserError, match=r"bad\.toml.*'vendor'"):
        load_spec(bad)
    bad.write_text('[[group]]\nvendor = "amd"\ngpu = "X9000"\ngpus_per_node = 8\n')
    with pytest.raises(UserError, match=r"bad\.toml.*peak_bf16_tflops"):
        load_spec(bad)
    with pytest.raises(UserError, match="not found"):
        load_spec(tmp_path / "missing.toml")


def test_lab_spec_from_profile(tmp_path: Path) -> None:
    (tmp_path / "cpu.json").write_text(json.dumps({"achieved_flops": 1e10}))
    g = {"vendor": "cpu", "gpu": "cpu", "gpus_per_node": 1, "nics_per_node": 1, "nic_gbps": 1.0,
         "intra_gbps": 1.0, "memory_gb": 4.0, "profile": "cpu.json"}
    spec = parse_spec({"group": [g | {"name": "fast"}, g | {"name": "slow", "cpu_share": 0.5}]},
                      str(tmp_path / "lab.toml"))
    assert [x.achieved_flops for x in spec.groups] == [1e10, 5e9]
    p = evaluate(spec, "debug", 128, 8, pp=2, dp=1, tp=1, micro_batch=1, transport="cpu-forward")
    assert p is not None and p.layer_split == [3, 1]  # the capped rank holds fewer layers (and the head)
    (tmp_path / "cpu.json").write_text("{}")
    with pytest.raises(UserError, match=r"lab\.toml.*'profile'"):
        parse_spec({"group": [g]}, str(tmp_path / "lab.toml"))


def test_profile_writes_usable_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bimetal.plan.profile import profile_main
    out = tmp_path / "p.json"
    assert profile_main(["--model", "debug", "--seq", "32", "--repeats", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["layer_fwd_bwd_s"] > 0 and data["achieved_flops"] > 1e6


def test_text_table_and_explain(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(ROOT / "configs" / "clusters" / "h200_mi325x.toml")
    assert main([spec, "--model", "qwen2-7b", "--explain", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "tok/s" in text and "pipeline bubble" in text and "dp all-reduce" in text
    with pytest.raises(UserError, match="unknown model flavour"):
        main([spec, "--model", "gpt5"])


def test_each_pipeline_hop_is_priced_on_its_own_link(capsys: pytest.CaptureFixture[str]) -> None:
    """pp=4 over two nodes of each vendor: the hops inside an island go over the vendor's library between nodes
    (RDMA at line rate), only the hop between the islands over the transport; a stage pays for its own hops only."""
    from bimetal.plan import hostpath

    spec = parse_spec({"group": [{"vendor": v, "gpu": gpu, "name": n, "count": 2, "gpus_per_node": 8,
                                  "nics_per_node": 8, "nic_gbps": 400, "intra_gbps": 400, "gpudirect": True}
                                 for v, gpu, n in (("nvidia", "H200", "nv"), ("amd", "MI325X", "amd"))]}, "four.toml")
    p = evaluate(spec, "llama3-8b", 8192, 256, pp=4, dp=8, tp=1, micro_batch=1, transport="cpu-forward")
    assert p is not None
    assert [(h.stages, h.link, h.cross_vendor) for h in p.hops] == [
        ((0, 1), "native (between nodes)", False), ((1, 2), "cpu-forward", True),
        ((2, 3), "native (between nodes)", False)]
    nv, amd = spec.groups
    act = 8192 * 4096 * 2  # one bf16 activation of a 1 x 8192 microbatch
    assert p.hops[0].seconds == hostpath.pair_transfer_seconds(act, "device-direct", nv, nv, "per-gpu", 8)
    assert p.hops[1].seconds == hostpath.pair_transfer_seconds(act, "cpu-forward", nv, amd, "per-gpu", 8)
    assert p.hops[1].seconds > 10 * p.hops[0].seconds  # TCP and host copies against RDMA
    assert p.stage_comm[0] == 2 * p.hops[0].seconds and p.stage_comm[3] == 2 * p.hops[2].seconds
    assert p.stage_comm[1] == 2 * (p.hops[0].seconds + p.hops[1].seconds)
    # two stages per node: the hop inside a node takes the node's GPU fabric
    same = evaluate(spec, "llama3-8b", 8192, 256, pp=8, dp=4, tp=1, micro_batch=1, transport="device-direct")
    assert same is not None and same.hops[0].link == "native (node fabric)"
    assert same.hops[0].seconds == act / (400 * 1e9) and same.hops[3].link == "device-direct"
    # the ladder's all-Gloo rung: hops inside an island on stock Gloo too
    gloo = evaluate(spec, "llama3-8b", 8192, 256, 4, 8, 1, 1, "gloo", homogeneous="gloo")
    assert gloo is not None and [h.link for h in gloo.hops] == ["gloo"] * 3
    main([str(ROOT / "configs/clusters/h100_mi300x.toml"), "--pp", "2", "--dp", "8", "--tp", "1"])
    assert "hop 0->1 h100->mi300x: cpu-forward" in capsys.readouterr().out
