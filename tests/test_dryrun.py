"""``bimetal train --dry-run``: the memory report of the real 8B/7B configs, checked against the planner's
estimate; the fake-tensor measurement against real tensors; the help text against the config dataclasses."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from bimetal.cli import main as bimetal_main
from bimetal.config import TrainConfig, load_config
from bimetal.plan.search import evaluate
from bimetal.plan.spec import load_spec

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def assert_state_matches_dry_run(run: Path, config: Path, args: list[str], world: int, dtype: str = "float32"
                                 ) -> None:
    """What a finished ``bimetal train`` run wrote in ``memory-rank<R>.json`` (parameter, gradient and AdamW
    bytes read from each rank's tensors after its first step; with a pipeline, the bytes of the schedule's
    receive buffers, read from them) against ``bimetal train --dry-run --json`` of the same config and
    arguments in ``dtype`` (a simulated run trains in float32 on the CPU unless told otherwise).

    Under FSDP with a pipeline the JSON also holds what FSDP kept unsharded before the first step's last
    backward (gathered parameters, accumulated gradients), compared with the dry-run's terms. The dry-run
    sizes the largest rank of a stage: FSDP's shards of a dim that does not divide evenly (the
    debug model's 129 vocabulary rows per tp rank over 2 shards: 65 and 64) differ by a row, and FSDP pads
    the smaller one to the larger in memory; every rank is within 1 %, the largest equal.
    """
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bimetal_main(["train", "--config", str(config), *args, f"--training.dtype={dtype}", "--dry-run", "--json"])
    stages = json.loads(out.getvalue())["stages"]
    per_stage = world // len(stages)
    for s in stages:
        ranks = [json.loads((run / f"memory-rank{r}.json").read_text())
                 for r in range(s["stage"] * per_stage, (s["stage"] + 1) * per_stage)]
        for ours, theirs in (("params", "params"), ("grads", "grads"), ("optimizer", "optim")):
            got = [r[theirs] for r in ranks]
            assert max(got) == s[ours] and min(got) >= 0.99 * s[ours], (s["stage"], ours, got, s[ours])
        if len(stages) > 1:  # the receive buffers and the outputs held at once, in the boundary dtype, exactly
            for key in ("recv_buffers", "held_outputs"):
                assert [r[key] for r in ranks] == [s[key]] * len(ranks), (s["stage"], key, ranks, s[key])
        # Under FSDP with a pipeline the trainer also measured FSDP's unsharded buffers at the first step's last
        # backward (all-gather outputs are padded to whole shards: within 1 %).
        measured = [r for r in ranks if "gathered" in r]
        assert len(measured) in (0, len(ranks)) and (measured or not s["gathered"])
        for r in measured:
            for key in ("gathered", "unsharded_grads"):
                assert s[key] > 0 and abs(r[key] - s[key]) <= 0.01 * s[key], (s["stage"], key, r[key], s[key])


def _planner_memory(cfg: TrainConfig) -> list[int]:
    """The planner's per-stage estimate for exactly the layout of ``cfg``."""
    p = cfg.parallel
    mb = cfg.data.batch_size // p.microbatches
    plan = evaluate(load_spec(ROOT / p.cluster), cfg.model.flavour, cfg.data.seq_len, cfg.data.batch_size * p.dp,
                    p.pp, p.dp, p.tp, mb, p.pp_transport, split=p.layers_per_stage, dp_shard=p.dp_shard,
                    ac=cfg.activation_checkpoint.mode, bf16=cfg.training.dtype != "float32",
                    boundary=cfg.parallel.pp_boundary_dtype)
    assert plan is not None and not plan.rejected, plan
    return plan.memory


def test_llama3_8b_h100_mi300x_fits_and_matches_planner(tmp_path: Path) -> None:
    config = "configs/llama3-8b-h100-mi300x.toml"
    run_dir = tmp_path / "run"
    exe = str(Path(sys.executable).parent / "bimetal")
    r = subprocess.run([exe, "train", "--config", config, "--dry-run", "--json", f"--metrics.run_dir={run_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert not run_dir.exists()  # nothing written
    stages = json.loads(r.stdout)["stages"]
    cfg = load_config(ROOT / config)
    assert [s["device"] for s in stages] == ["H100", "MI300X"]
    for s, planned in zip(stages, _planner_memory(cfg)):
        assert s["fits"] is True and s["total"] < 80e9 * 0.9, s
        assert s["total"] == sum(s[k] for k in PARTS) and s["activations"] > 0
        assert abs(s["total"] - planned) <= 0.10 * s["total"], (s["total"], planned)
    _assert_terms_match_planner(cfg, stages)


PARTS = ("params", "grads", "optimizer", "weight_copies", "gathered", "unsharded_grads", "recv_buffers", "activations",
         "transient")


def _assert_terms_match_planner(cfg: TrainConfig, stages: list[dict]) -> None:
    """Term for term: the planner's parts of each stage against the dry-run's (activations within 10 %, the
    parameter-state terms within 1 %: both count the same tensors, the planner without qkv biases)."""
    from bimetal.plan import cost
    from bimetal.train.dryrun import boundary_size

    p = cfg.parallel
    m = cost.model_dims(cfg.model.flavour)
    split = cfg.stage_split(m.layers)
    for s in stages:
        j = s["stage"]
        est = cost.stage_memory(m, split[j], j == 0, j == p.pp - 1, p.tp, cfg.data.batch_size // p.microbatches,
                                cfg.data.seq_len, s["in_flight"], p.dp_shard, cfg.activation_checkpoint.mode,
                                cfg.activation_checkpoint.every, cfg.training.dtype != "float32",
                                pipelined=p.pp > 1, backwards=p.microbatches, boundary_size=boundary_size(cfg))
        for k in PARTS:
            tol = 0.10 if k in ("activations", "transient") else 0.01
            assert abs(s[k] - est[k]) <= tol * max(s[k], 1), (j, k, s[k], est[k])


@pytest.mark.parametrize("overrides", [
    [],
    ["--parallel.dp_shard=1", "--activation_checkpoint.mode=full", "--parallel.pp_boundary_dtype=float32"],
    ["--parallel.tp=4", "--parallel.dp=2", "--parallel.dp_shard=2", "--activation_checkpoint.mode=selective",
     "--training.dtype=float32"],
], ids=["as-written", "replicated-full-ac", "tp4-hsdp-selective-fp32"])
def test_qwen2_7b_report_matches_planner(overrides: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "configs" / "qwen2-7b-h100-mi300x.toml")
    cluster = f"--parallel.cluster={ROOT / 'configs/clusters/h100_mi300x.toml'}"
    rc = bimetal_main(["train", "--config", config, "--dry-run", "--json", cluster, *overrides])
    stages = json.loads(capsys.readouterr().out)["stages"]
    cfg = load_config(config, [cluster, *overrides])
    planned = _planner_memory(cfg)
    assert rc == (0 if all(s["fits"] for s in stages) else 1)
    for s, est in zip(stages, planned):
        assert abs(s["total"] - est) <= 0.10 * s["total"], (s, est)
    _assert_terms_match_planner(cfg, stages)
    if overrides[1:2] == ["--activation_checkpoint.mode=full"]:
        assert all(s["weight_copies"] == 0 or s["stage"] == 1 for s in stages)  # checkpointed blocks hold none
        # A float32 boundary: float32 receive buffers of [mb, seq, dim] each way, the last stage's logits float32.
        mb, seq = cfg.data.batch_size // cfg.parallel.microbatches, cfg.data.seq_len
        assert stages[0]["recv_buffers"] == cfg.parallel.microbatches * mb * seq * 3584 * 4 // cfg.parallel.tp
        assert stages[-1]["held_outputs"] == stages[-1]["in_flight"] * mb * seq * 152064 * 4


def test_text_report_and_not_fitting(capsys: pytest.CaptureFixture[str]) -> None:
    # The same model unsharded (tp=1, dp=8 replicas) on 80 GB parts: the report names the stage that does not fit.
    cluster = f"--parallel.cluster={ROOT / 'configs/clusters/h100_mi300x.toml'}"
    rc = bimetal_main(["train", "--config", str(ROOT / "configs/llama3-8b-h100-mi300x.toml"), "--dry-run", cluster,
                       "--parallel.tp=1", "--parallel.dp=8", "--parallel.dp_shard=1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "H100" in out and "MI300X" in out and " NO" in out and "stage 0 does not fit its H100" in out


def test_simulated_dry_run_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rc = bimetal_main(["train", "--config", str(ROOT / "configs/demo.toml"), "--simulate", "nvidia:2,amd:2",
                       "--dry-run", f"--metrics.run_dir={run_dir}"])
    out = capsys.readouterr().out
    assert rc == 0 and "unknown (set parallel.cluster)" in out and not run_dir.exists()


def test_cluster_must_match_layout(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bimetal_main(["train", "--config", str(ROOT / "configs/llama3-8b-h100-mi300x.toml"), "--dry-run",
                       f"--parallel.cluster={ROOT / 'configs/clusters/h100_mi300x.toml'}", "--parallel.dp=2",
                       "--parallel.dp_shard=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "has 16" in err and err.count("\n") == 1


@pytest.mark.parametrize(("bf16", "fsdp"), [(True, False), (False, False), (True, True)],
                         ids=["bf16-autocast", "float32", "fsdp-bf16"])
def test_fake_measurement_equals_real_tensors(bf16: bool, fsdp: bool) -> None:
    """The bytes measured on fake tensors are those a real forward of the same stage saves (under FSDP in
    bf16: the block's weights and its input in bf16, as FSDP gathers and casts them)."""
    from bimetal.models import build_model, build_stage, prune_to_stage
    from bimetal.train.memory import measure_saved, measure_stage

    meta = prune_to_stage(build_model("llama3", "debug", device="meta"), [2, 3], False, True)
    fake = measure_stage(meta, 1, 2, 64, bf16, fsdp=fsdp)
    real = build_stage("llama3", "debug", [2, 3], False, True)
    low = torch.bfloat16 if fsdp else torch.float32
    block = real.layers["2"].to(low)
    x = torch.randn(2, 64, real.args.dim, requires_grad=True, dtype=low)
    cos, sin = real._rope(64, x.device, x.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        got = measure_saved(block, lambda: block(x, cos, sin).sum(), skip=(cos, sin))
    assert (got.activations, got.weight_copies) == (fake.block.activations, fake.block.weight_copies)
    assert got.activations > 0 and (got.weight_copies > 0) == (bf16 and not fsdp)
    if fsdp:
        return
    # The dry-run's copy of the loss is the trainer's: the same head bytes with the trainer's own function.
    from bimetal.train.trainer import _loss_fn
    assert measure_stage(meta, 1, 2, 64, bf16, loss=_loss_fn).head == fake.head


def test_help_lists_every_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bimetal_main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    for sec in dataclasses.fields(TrainConfig):
        assert f"[{sec.name}]" in text
        body = text.split(f"[{sec.name}]", 1)[1]
        for f in dataclasses.fields(typing.get_type_hints(TrainConfig)[sec.name]):
            assert f"\n  {f.name} = " in body, f"{sec.name}.{f.name} missing from bimetal train --help"
    assert "FSDP2 shard degree" in flat and "checkpoint every k-th block" in flat
    from bimetal.train.keys import config_keys
    sections, keys = config_keys()
    assert set(sections) == {f.name for f in dataclasses.fields(TrainConfig)} and all(sections.values())
    assert [k for k in keys if not k.doc] == []  # every key says what it means


def test_dry_run_prices_each_hop_on_its_own_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pp=4 on two nodes of each vendor: the dry-run's hops are the planner's, native inside an island."""
    spec = tmp_path / "four.toml"
    spec.write_text((ROOT / "configs/clusters/h100_mi300x.toml").read_text().replace("count = 1", "count = 2"))
    layout = [f"--parallel.cluster={spec}", "--parallel.pp=4", "--parallel.layers_per_stage=[8,8,8,8]",
              "--parallel.dp=4", "--parallel.dp_shard=4", "--parallel.tp=2"]
    config = str(ROOT / "configs/llama3-8b-h100-mi300x.toml")
    bimetal_main(["train", "--config", config, *layout, "--dry-run", "--json"])
    hops = json.loads(capsys.readouterr().out)["hops"]
    assert [(h["stages"], h["groups"], h["link"]) for h in hops] == [
        ([0, 1], ["h100", "h100"], "native (between nodes)"), ([1, 2], ["h100", "mi300x"], "device-direct"),
        ([2, 3], ["mi300x", "mi300x"], "native (between nodes)")]
    cfg = load_config(config, layout)
    plan = evaluate(load_spec(spec), "llama3-8b", cfg.data.seq_len, cfg.data.batch_size * 4, 4, 4, 2,
                    cfg.data.batch_size // cfg.parallel.microbatches, "device-direct", split=[8, 8, 8, 8], dp_shard=4)
    assert plan is not None and [h["seconds"] for h in hops] == [h.seconds for h in plan.hops]
    bimetal_main(["train", "--config", config, *layout, "--parallel.pp_transport=cpu-forward", "--dry-run"])
    assert "hop 1->2 h100->mi300x: cpu-forward" in capsys.readouterr().out
