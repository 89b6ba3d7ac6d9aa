"""torchtitan 0.3.0's own trainer on bimetal (``bimetal titan``), on simulated vendors, against Gloo.

The reference for every mixed run is the same torchtitan run with every group on plain Gloo
(``--all-gloo``): per-step losses must be identical. The trained runs go through ``python -m
bimetal.integrations.torchtitan --simulate`` (the ``bimetal titan`` command's own ``main``: it checks the config and
the mesh and forks the ranks from itself), one after another, forked from one interpreter that imported torch and
torchtitan once (tests/forked_runs.py); the resumed run through ``bimetal launch ... -m
bimetal.integrations.torchtitan`` (its launcher imports torchtitan once and forks the ranks, or, on GPUs, each rank
imports it itself, as under torchrun); the refusal through ``bimetal titan`` itself. The command's successful runs
are test_titan_output.py's. Each rank writes
``<dump>/bimetal/rank<r>.json``: losses, and each mesh dimension's back-end, ranks and byte counters.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from launcher import ROOT, bimetal, clean_env

from bimetal.integrations.torchtitan import available
from bimetal.integrations.torchtitan.mesh import MixedVendorDimensionError, preflight, unflatten_groups
from bimetal.plan.titan_split import module_fqns_per_model_part

needs_titan = pytest.mark.skipif(not available(),
                                 reason="torchtitan is not installed: pip install torchtitan==0.3.0")

COMMON = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len=32",
          "--training.local_batch_size=4", "--validator.no-enable", "--training.disable_cuda_graphs",
          "--parallelism.spmd_backend=partial_dtensor", "--debug.seed=7"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
VENDOR_OF = {"nvidia:1,amd:1": ["nvidia", "amd"], "nvidia:2,amd:2": ["nvidia", "nvidia", "amd", "amd"]}


def _run(args: list[str], timeout: int = 200) -> subprocess.CompletedProcess:
    return bimetal(*args, timeout=timeout)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from bimetal.integrations.torchtitan.cpu_support import write_assets

    tok, data = write_assets(tmp_path_factory.mktemp("titan_assets"))
    return [f"--hf_assets_path={tok}", f"--dataloader.dataset_path={data}"]


PP2 = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B",
       "--training.steps=3"]
PP2_CKPT = ["--checkpoint.enable", "--checkpoint.interval=2", "--checkpoint.folder=ckpt"]
PP_TP = ["--training.steps=2", "--checkpoint.no-enable", "--parallelism.pipeline_parallel_degree=2",
         "--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=GPipe",
         "--layers-per-stage=4,2"]
TITAN_RUNS = {  # name: (--simulate, arguments before COMMON and the assets, arguments after them)
    "pp2": ("nvidia:1,amd:1", ["--layers-per-stage", "4,2"], [*PP2, *PP2_CKPT]),
    "pp_tp-gloo": ("nvidia:2,amd:2", ["--all-gloo"], PP_TP),
    "pp_tp": ("nvidia:2,amd:2", [], PP_TP),
    "seed": ("nvidia:1", [], ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]),
}


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory: pytest.TempPathFactory, assets: list[str]
               ) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every ``TITAN_RUNS`` job, one after another: ``python -m bimetal.integrations.torchtitan --simulate ...`` (the
    ``bimetal titan`` command's own ``main``: it checks the mesh, writes the CPU assets and launches the ranks,
    forked from itself) forked from one interpreter that imported torch and torchtitan once (tests/forked_runs.py),
    not a new ``bimetal titan`` launcher importing them for each job. ``{name: (dump folder, result)}``; the
    refusal above goes through the command itself, for its exit status and its one sentence."""
    from forked_runs import runs

    dumps = {name: tmp_path_factory.mktemp(f"titan-{name}") for name in TITAN_RUNS}
    done = runs([(["-m", "bimetal.integrations.torchtitan", "--simulate", simulate, *head, *COMMON, *assets, *tail,
                   f"--dump_folder={dumps[name]}"], ROOT) for name, (simulate, head, tail) in TITAN_RUNS.items()],
                env=clean_env(), at_once=False, timeout=850)
    for name, r in zip(TITAN_RUNS, done):
        assert r.returncode == 0, (name, r.stdout[-3000:], r.stderr[-3000:])
    return {name: (dumps[name], r) for name, r in zip(TITAN_RUNS, done)}


def _launch(simulate: str, args: list[str], dump: Path) -> dict[int, dict[str, Any]]:
    """Ranks through ``bimetal launch``; returns each rank's report."""
    proc = _run(["launch", "--simulate", simulate, "--", "-m", "bimetal.integrations.torchtitan", *args,
                 f"--dump_folder={dump}"])
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return _reports(dump)


def _reports(dump: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (dump / "bimetal").glob("rank*.json")}


def _losses(reports: dict[int, dict[str, Any]]) -> list[float]:
    last = [r for r in reports.values() if r["last_stage"]]
    assert last, "no rank reported the last pipeline stage"
    return [entry["loss"] for entry in last[0]["losses"]]


def _check_groups(reports: dict[int, dict[str, Any]], vendors: list[str]) -> None:
    """pp is a bimetal transport whose bytes moved; every other group is native and one vendor."""
    for rank, report in reports.items():
        groups = report["groups"]
        assert groups["pp"]["backend"] == "bimetal_cpu_forward", (rank, groups["pp"])
        assert groups["pp"]["counters"]["bytes_sent"] > 0 and groups["pp"]["counters"]["bytes_received"] > 0
        assert len({vendors[r] for r in groups["pp"]["ranks"]}) == 2
        for name, group in groups.items():
            if name != "pp":
                assert group["backend"] == "bimetal_sim_native", (rank, name, group)
                assert len({vendors[r] for r in group["ranks"]}) == 1, (rank, name, group)


# ---- pure Python: the split and the mesh rules (no process group) ----

def test_uneven_split_single_and_interleaved() -> None:
    assert module_fqns_per_model_part(6, [4, 2]) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"], ["layers.4", "layers.5", "norm", "lm_head"]]
    # loop style: parts 0, 2 on rank 0 (2 + 2 layers), parts 1, 3 on rank 1 (1 + 1)
    parts = module_fqns_per_model_part(6, [4, 2], 2, "Interleaved1F1B")
    assert [len([n for n in p if n.startswith("layers.")]) for p in parts] == [2, 1, 2, 1]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    # V style: rank 0 holds parts 0 and 3
    v = module_fqns_per_model_part(6, [4, 2], 2, "ZBVZeroBubble")
    assert [len([n for n in p if n.startswith("layers.")]) for p in v] == [2, 1, 1, 2]


def test_mesh_rules_without_a_process_group() -> None:
    assert unflatten_groups((2, 2), ("pp", "batch")) == {"pp": [(0, 2), (1, 3)], "batch": [(0, 1), (2, 3)]}
    vendors = VENDOR_OF["nvidia:2,amd:2"]
    ok = preflight({"pp": 2, "dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1}, vendors, "device-direct", True)
    assert {g.name: g.backend for g in ok.made}["pp.0"] == "bimetal_device_direct"
    with pytest.raises(MixedVendorDimensionError, match="'tp'"):
        preflight({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 4}, vendors, "cpu-forward", True)


def test_plan_writes_a_torchtitan_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan is written in this process (``bimetal.cli.main``: it starts no rank); its refusal goes through the
    command, for the exit status and the one sentence."""
    import tomllib

    from bimetal.cli import main
    from bimetal.integrations.torchtitan.cli import _plan_args

    out = tmp_path / "titan.toml"
    cluster = str(Path(__file__).resolve().parents[1] / "configs/clusters/h100_mi300x.toml")
    assert main(["plan", cluster, "--model", "llama3-8b", "--write-titan", str(out)]) == 0, capsys.readouterr().err
    doc = tomllib.loads(out.read_text())
    tt, bm = doc["torchtitan"], doc["bimetal"]
    pp, dp, tp = (tt[f"parallelism.{k}_degree"]
                  for k in ("pipeline_parallel", "data_parallel_shard", "tensor_parallel"))
    assert pp * dp * tp == 16 and pp == len(bm["layers_per_stage"]) > 1 and (bm["module"], bm["config"]) == (
        "llama3", "llama3_8b")
    parts = tt["parallelism.module_fqns_per_model_part"]
    layers = [n for part in parts for n in part if n.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(32)] and parts[0][0] == "tok_embeddings"
    assert [sum(n.startswith("layers.") for n in p) for p in parts] == bm["layers_per_stage"]
    args = _plan_args(doc, ["--training.seq_len=64"])
    assert f"--parallelism.pipeline_parallel_degree={pp}" in args and "--module=llama3" in args
    assert not any(a.startswith("--training.seq_len") for a in args)  # the command line wins over the file
    bad = _run(["plan", "configs/clusters/h100_mi300x.toml", "--model", "qwen2-7b", "--write-titan", str(out)], 150)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


# ---- torchtitan's parser and the entry point's refusals (in this process: torchtitan imported once) ----

@needs_titan
def test_bad_titan_arguments_are_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A value torchtitan's parser (tyro) refuses and a misspelled key: one sentence with tyro's message and its
    suggestion, naming only what the user typed (not the paths bimetal adds), exit 2, nothing written; what the CPU
    cannot run (context parallelism, compile with tp), expert parallelism the mesh cannot hold and a seed checkpoint
    on two ranks: one sentence each; a rank
    started by hand without a launcher: one sentence, not torchtitan's LOCAL_RANK traceback."""
    from bimetal.cli import main

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "BIMETAL_SIMULATE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    titan = ["titan", "--module", "llama3", "--config", "llama3_debugmodel"]
    cases = [
        ([*titan, "--simulate", "nvidia:1,amd:1", "--training.steps=abc"],
         "bimetal titan: torchtitan: Error parsing --training.steps: invalid literal for int() with base 10: 'abc'."),
        ([*titan, "--simulate", "nvidia:1,amd:1", "--training.stepz", "3"],
         "bimetal titan: torchtitan: Unrecognized options: --training.stepz, 3; did you mean --training.steps?"),
        ([*titan, "--simulate", "nvidia:2", "--parallelism.context_parallel_degree=2"],
         "bimetal titan: context parallelism (parallelism.context_parallel_degree > 1) cannot run on a CPU"),
        ([*titan, "--simulate", "nvidia:2", "--compile.enable", "--parallelism.tensor_parallel_degree=2"],
         "bimetal titan: --compile.enable with tensor parallelism fails on CPU"),
        ([*titan, "--simulate", "nvidia:2", "--optimizer.implementation", "fused_opt_states_bf16"],
         "bimetal titan: --optimizer.implementation fused_opt_states_bf16 keeps Adam's states in bfloat16"),
        (["titan", "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--simulate", "nvidia:2,amd:2",
          "--parallelism.pipeline_parallel_degree=2", "--parallelism.tensor_parallel_degree=2",
          "--parallelism.expert_parallel_degree=4"],
         "bimetal titan: parallelism.expert_parallel_degree=4 must divide dp_shard x cp x tp, which is 1 x 1 x 2 = 2 "
         "on these 4 ranks"),
        ([*titan, "--simulate", "nvidia:1,amd:1", "--checkpoint.create_seed_checkpoint"],
         "bimetal titan: --checkpoint.create_seed_checkpoint writes the step-0 checkpoint from one unsharded rank, "
         "as torchtitan requires: run it on one rank (e.g. --simulate nvidia:1) and add --checkpoint.enable."),
        ([*titan, "--cpu"], "bimetal titan: without --simulate this process is one rank of a job that torchrun or "
                            "srun starts, but RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set;"),
    ]
    for argv, sentence in cases:
        assert main([*argv, f"--dump_folder={tmp_path / 'out'}"]) == 2, argv
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(sentence) and captured.out == "", (argv, captured)
        assert list(tmp_path.iterdir()) == [], argv  # nothing written


# ---- torchtitan runs ----

@needs_titan
@pytest.mark.timeout(300)
def test_refuses_a_mixed_native_dimension_through_the_entry_point(tmp_path: Path) -> None:
    proc = _run(["titan", "--simulate", "nvidia:1,amd:1", *COMMON, "--parallelism.data_parallel_shard_degree=2",
                 f"--dump_folder={tmp_path}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    # one sentence alone: what torchtitan logged while parsing its config (warnings about its own defaults and
    # the CPU assets not written yet) is held back and dropped with the refusal
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    last = lines[-1]
    assert last.startswith("bimetal titan: torchtitan mesh dimension 'batch'") and last.count(". ") == 0, last
    assert not (tmp_path / "bimetal").exists() and not (tmp_path / "bimetal_assets").exists()  # nothing started


@needs_titan
@pytest.mark.timeout(900)  # the first test of titan_runs waits for all its jobs
def test_pp2_1f1b_two_vendors_resumes(titan_runs: dict[str, tuple[Path, subprocess.CompletedProcess]],
                                      assets: list[str]) -> None:
    """nvidia:1,amd:1, pp=2, 1F1B, split 4/2; a checkpoint at step 2 resumed through torchtitan's checkpointer
    trains step 3 as the uninterrupted run did. (Its all-Gloo parity is held by the pipeline runs that compare
    with all-Gloo: the split 4/2 under tp below, pp=4 interleaved in test_titan_output.py.)"""
    mixed_dir, proc = titan_runs["pp2"]  # the command's main: it checks the mesh, then starts the ranks
    assert "bimetal groups (torchtitan mesh)" in proc.stdout and "bimetal_cpu_forward" in proc.stdout
    mixed = _reports(mixed_dir)
    ref = _losses(mixed)
    assert len(ref) == 3 and len(set(ref)) == 3, ref  # three steps that learned
    _check_groups(mixed, VENDOR_OF["nvidia:1,amd:1"])
    # resume: drop the step-3 checkpoint, run again; torchtitan loads step 2 and trains step 3 alone
    steps = sorted(p.name for p in (mixed_dir / "ckpt").iterdir())
    assert steps == ["step-2", "step-3"], steps
    shutil.rmtree(mixed_dir / "ckpt" / "step-3")
    shutil.rmtree(mixed_dir / "bimetal")
    resumed = _launch("nvidia:1,amd:1", ["--layers-per-stage=4,2", *COMMON, *assets, *PP2, *PP2_CKPT], mixed_dir)
    assert [e["step"] for r in resumed.values() if r["last_stage"] for e in r["losses"]] == [3]
    assert _losses(resumed) == ref[2:]


STEP_LINE = re.compile(r"^\[rank(\d+)\]:.*\bstep:\s+(\d+)\s.*\bloss:\s+(\S+)")


@needs_titan
@pytest.mark.timeout(900)
def test_pipeline_with_tensor_parallelism_matches_gloo(titan_runs: dict[str, tuple[Path, subprocess.CompletedProcess]]
                                                       ) -> None:
    """torchtitan's pp_tp_gpipe (pp 2 x tp 2, GPipe; here with the uneven split 4/2) over nvidia:2,amd:2 against the
    same run on all-Gloo in this file: the last stage's loss under tp is a DTensor, handed to the first stage as
    torchtitan logs it (the first stage's step line shows the same value, once per step). The 8-rank pp_dp_tp
    (pp 2 x FSDP 2 x tp 2) is a row of the matrix (``scripts/titan_matrix.py --run pp_dp_tp``, docs/torchtitan.md),
    not run here: CI time."""
    ref = _losses(_reports(titan_runs["pp_tp-gloo"][0]))
    mixed_dir, proc = titan_runs["pp_tp"]
    mixed = _reports(mixed_dir)
    assert len(ref) == 2 and _losses(mixed) == ref
    _check_groups(mixed, VENDOR_OF["nvidia:2,amd:2"])
    # every rank's step losses, first stages' included, are the last stage's
    assert {tuple(e["loss"] for e in r["losses"]) for r in mixed.values()} == {tuple(ref)}
    # the console: rank 0 (the default filter) alone, one step line per step, showing the last stage's loss
    steps = [m.groups() for m in map(STEP_LINE.match, ANSI.sub("", proc.stdout).splitlines()) if m]
    assert steps == [("0", "1", f"{ref[0]:.5f}"), ("0", "2", f"{ref[1]:.5f}")], steps


@needs_titan
@pytest.mark.timeout(900)
def test_seed_checkpoint_is_step_zero_untrained(titan_runs: dict[str, tuple[Path, subprocess.CompletedProcess]]
                                                ) -> None:
    """``--checkpoint.create_seed_checkpoint`` as torchtitan's own entry point runs it: one rank saves step 0 and
    trains nothing."""
    dump = titan_runs["seed"][0]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-0"]
    assert _reports(dump)[0]["losses"] == []
