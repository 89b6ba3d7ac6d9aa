"""Nothing silent, one sentence: issue 38's cases of values ignored without a word and of refusals that were not
one sentence, through the commands users type (``bimetal.cli.main`` in this process: each case is decided
before any rank would start, so nothing is launched).

Every refusal is one line on stderr starting "bimetal ", exit status 2, no traceback, and nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bimetal.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.toml")
SPEC = ROOT / "configs" / "clusters" / "h100_mi300x.toml"


@pytest.fixture(autouse=True)
def _not_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR", "BIMETAL_SIMULATE_DEVICE"):
        monkeypatch.delenv(key, raising=False)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-1500:], err[-1500:])
    assert len(lines) == 1 and lines[0].startswith("bimetal "), err
    assert "Traceback" not in err and "usage:" not in err + out, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _one_gpu_nodes(tmp_path: Path) -> Path:
    """The H100/MI300X spec with each island as two nodes of one GPU."""
    spec = tmp_path / "one_gpu_nodes.toml"
    text = SPEC.read_text().replace("count = 1", "count = 2")
    spec.write_text(text.replace("gpus_per_node = 8", "gpus_per_node = 1"))
    return spec


UNIFORM_BESIDE_LIST = [
    ("dp-both-on-the-command-line", ["--parallel.pp=2", "--parallel.dp=2", "--parallel.dp_per_stage=[2,1]"],
     "parallel.dp=2 (the command line) is set beside parallel.dp_per_stage=[2, 1] (the command line)"),
    ("tp", ["--parallel.pp=2", "--parallel.tp=2", "--parallel.tp_per_stage=[1,1]", "--parallel.dp_per_stage=[2,1]"],
     "parallel.tp=2 (the command line) is set beside parallel.tp_per_stage=[1, 1]"),
    ("dp_shard", ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.dp_per_stage=[2,1]",
                  "--parallel.dp_shard_per_stage=[1,1]"], "parallel.dp_shard=2 (the command line) is set beside"),
    ("ac-mode", ["--parallel.pp=2", "--parallel.dp_per_stage=[2,1]", "--activation_checkpoint.mode=full",
                 "--activation_checkpoint.mode_per_stage=[full,none]"],
     "activation_checkpoint.mode='full' (the command line) is set beside activation_checkpoint.mode_per_stage"),
]


@pytest.mark.parametrize("case", UNIFORM_BESIDE_LIST, ids=[c[0] for c in UNIFORM_BESIDE_LIST])
def test_a_uniform_key_beside_its_per_stage_list_is_refused(case: tuple[str, list[str], str], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, args, fragment = case
    run_dir = tmp_path / "run"
    line = _refused(capsys, ["train", "--simulate", "nvidia:2,amd:1", "--data.global_batch_size=16", *args,
                             f"--metrics.run_dir={run_dir}"], fragment)
    assert "would be ignored" in line
    assert not run_dir.exists()


def test_a_uniform_key_in_the_file_under_a_list_on_the_command_line_is_overridden_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """demo.toml's dp=2 under --parallel.dp_per_stage=[2,1]: the command line wins (CLI > file), in a sentence;
    the same pair written in one file is refused naming the file, and a list that agrees passes silently."""
    base = ["train", "--simulate", "nvidia:2,amd:1", "--data.global_batch_size=16", "--dry-run"]
    assert main([*base[:1], "--config", DEMO, *base[1:], "--parallel.dp_per_stage=[2,1]"]) == 0
    out = capsys.readouterr().out
    assert ("bimetal train: parallel.dp_per_stage=[2, 1] (the command line) overrides parallel.dp=2 "
            f"({DEMO}) for every stage.") in out, out
    both = tmp_path / "both.toml"
    both.write_text("[parallel]\npp = 2\ndp = 2\ndp_per_stage = [2, 1]\n[data]\nglobal_batch_size = 16\n")
    _refused(capsys, [*base[:1], "--config", str(both), *base[1:]], f"parallel.dp=2 ({both}) is set beside")
    assert main(["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", "--data.global_batch_size=16",
                 "--dry-run", "--parallel.dp_per_stage=[2,2]"]) == 0
    assert "overrides" not in capsys.readouterr().out


def test_meta_records_no_uniform_key_of_a_per_stage_layout() -> None:
    from bimetal.config import load_config
    from bimetal.train.ckpt_files import run_meta

    cfg = load_config(DEMO, ["--parallel.dp_per_stage=[2,1]", "--data.global_batch_size=16"])
    meta = run_meta(cfg, [3, 1])
    assert (meta["dp"], meta["tp"], meta["dp_shard"]) == (None, None, None)
    assert meta["stage_shapes"] == [[1, 2, 1], [1, 1, 1]]


def test_plan_per_stage_or_explain_beside_a_fixed_layout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, ["plan", str(SPEC), "--per-stage", "--pp", "2"], "--per-stage", "--pp 2")
    _refused(capsys, ["plan", str(SPEC), "--explain", "--pp", "2"], "--explain", "--pp 2")
    _refused(capsys, ["plan", str(SPEC), "--per-stage", "--config", DEMO], "--per-stage", "--config")


def test_the_dry_run_reports_the_dtype_the_ranks_train_in(capsys: pytest.CaptureFixture[str]) -> None:
    """On the CPU (--simulate) training.dtype auto trains in float32: the dry-run says so and sizes that; a
    torchrun job (GPUs elsewhere) trains in bf16; the trainer asks the same function."""
    from bimetal.config import load_config

    assert main(["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", "--dry-run"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "float32, no autocast (training.dtype auto on the CPU), stage boundary float32" in head, head
    assert "bf16" not in head, head
    assert main(["train", "--config", DEMO, "--dry-run"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "bf16 autocast, float32 master weights and AdamW (training.dtype auto on GPUs), stage boundary bf16" in head
    assert main(["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == {"compute": "float32", "autocast": False, "device": "cpu",
                                                             "boundary": "float32"}
    cfg = load_config(DEMO)
    assert (cfg.compute_dtype("cpu"), cfg.compute_dtype("cuda")) == ("float32", "bfloat16")


def test_one_layout_check_for_train_dry_run_slurm_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """tp=2 on nodes of one GPU: refused by the dry-run, the run's preparation, `bimetal slurm` and `bimetal
    plan` in the same sentence (before, the dry-run accepted it)."""
    spec = _one_gpu_nodes(tmp_path)
    config = tmp_path / "tp2.toml"
    config.write_text(f'[parallel]\npp = 2\ntp = 2\ncluster = "{spec}"\n')
    why = "tp=2 does not divide the 1 nvidia ranks on host 'h100-0'; a tensor-parallel group must stay inside one node"
    _refused(capsys, ["train", "--config", str(config), "--dry-run"], why)
    _refused(capsys, ["train", "--config", str(config), "--simulate", "nvidia:2,amd:2",
                      f"--metrics.run_dir={tmp_path / 'run'}"], why)
    _refused(capsys, ["slurm", "--config", str(config)], why)
    _refused(capsys, ["plan", str(spec), "--pp", "2", "--tp", "2"], why)
    assert not (tmp_path / "run").exists()


def test_pipeline_refusals_name_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    # 1F1B with fewer microbatches than stages: torch's schedule raised on every rank; now refused before them
    _refused(capsys, ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", "--parallel.dp=1", "--parallel.pp=4",
                      "--parallel.layers_per_stage=[1,1,1,1]", "--parallel.microbatches=2",
                      f"--metrics.run_dir={run_dir}"],
             "parallel.schedule='1f1b' needs at least one microbatch per stage", "parallel.pp=4",
             "parallel.microbatches=2", "parallel.schedule='gpipe'")
    # more stages than layers: the split it would make, not a sum that looks right
    _refused(capsys, ["train", "--simulate", "nvidia:4,amd:4", "--parallel.pp=8", "--parallel.dp=1",
                      "--parallel.microbatches=8", "--data.batch_size=8", f"--metrics.run_dir={run_dir}"],
             "parallel.pp=8 stages split model llama3/debug's 4 layers as [1, 1, 1, 1, 0, 0, 0, 0]",
             "use at most 4 stages")
    assert not run_dir.exists()


def test_a_data_path_that_is_a_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    _refused(capsys, ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", f"--data.path={tmp_path}",
                      f"--metrics.run_dir={run_dir}"], f"data file {tmp_path} is a folder, not a file")
    _refused(capsys, ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", f"--data.tokenizer={tmp_path}",
                      f"--metrics.run_dir={run_dir}"], f"tokenizer file {tmp_path} is a folder, not a file")
    _refused(capsys, ["plan", str(tmp_path)], f"{tmp_path} is a folder, not a file")
    assert not run_dir.exists()
