"""Nothing lost, round 2: a checkpoint is never trained over, an export never replaces the run's folders, and
every file a command writes is checked first, through the ``bimetal`` command.

One tiny single-process run of 4 steps (checkpoints at steps 2 and 4) is shared by every test; each test copies
its run folder and damages the copy as a disk, a copy or a hand would: a data file with a byte changed (size
kept), a ``meta.json`` changed in place (size kept, checksum not), a step folder whose save never finished.
Each refusal is asserted the same way: exit status 2, one line on stderr starting ``bimetal``, no traceback,
and every file of the folder byte for byte as before (hashed before and after). Refusals happen before any
rank starts, so they cost no training; each test runs one of its refusals through the executable and the others
by ``bimetal.cli.main`` in this process (``cli_inprocess``: no interpreter start). The two tests that do train
(a resume past a damaged checkpoint, a change accepted with ``--resume-changed``) train 4 steps or none.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_inprocess import cli_main
from launcher import clean_env

from bimetal.cli import main

ROOT = Path(__file__).resolve().parents[1]
BIMETAL = str(Path(sys.executable).parent / "bimetal")
TINY = ["--data.seq_len=32", "--data.batch_size=2", "--parallel.microbatches=2"]
pytestmark = pytest.mark.timeout(240)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([BIMETAL, *args], env=clean_env(), cwd=cwd, capture_output=True, text=True, timeout=200)


def _one_sentence(code: int, out: str, err: str, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("bimetal "), err
    assert "Traceback" not in err + out, err
    assert "step " not in out and "resumed from" not in out, out  # nothing trained
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    return _one_sentence(proc.returncode, proc.stdout, proc.stderr, *fragments)


def _refused_here(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], cwd: Path,
                  *fragments: str) -> str:
    """``bimetal ARGS`` refused as ``_refused`` asserts, run by ``bimetal.cli.main`` in this process (the refusal
    comes before any rank starts; each test keeps one of its refusals through the executable)."""
    return _one_sentence(*cli_main(args, capsys, monkeypatch, cwd=cwd), *fragments)


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (and every folder, as ``/``) with the SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "/"
            for p in sorted(folder.rglob("*"))}


def _flip(path: Path) -> None:
    """One byte in the middle changed, the size kept: only a checksum finds it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _seed_in_place(step: Path) -> None:
    """``meta.json`` edited by hand: another seed, same size (a reader that trusts it blames the config)."""
    meta = step / "meta.json"
    text = meta.read_text()
    assert '"model.seed": 0,' in text
    meta.write_text(text.replace('"model.seed": 0,', '"model.seed": 7,'))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of 4 steps in one process, checkpointed at steps 2 and 4: its run folder."""
    run = tmp_path_factory.mktemp("trained") / "run"
    proc = _run(["train", *TINY, "--training.steps=4", "--checkpoint.every=2", f"--metrics.run_dir={run}"],
                cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """This test's own copy of the trained run folder."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_a_run_that_is_not_a_resume_is_refused_where_checkpoints_are(run: Path, capsys, monkeypatch) -> None:
    before = _hashes(run)
    why = (f"='{run}/checkpoints' already holds checkpoints (step-000002, step-000004)", "--resume", "move them away")
    # the launcher of simulated ranks through the executable, one process in this one
    lines = [_refused(_run(["train", *TINY, "--simulate", "nvidia:1,amd:1", f"--metrics.run_dir={run}"],
                           cwd=run.parent), *why),
             _refused_here(capsys, monkeypatch, ["train", *TINY, f"--metrics.run_dir={run}"], run.parent, *why)]
    assert all("checkpoint.folder" in line for line in lines), lines
    assert _hashes(run) == before


def test_a_resume_that_finds_no_usable_checkpoint_stops_and_changes_nothing(run: Path, capsys, monkeypatch) -> None:
    ckpts = run / "checkpoints"
    _seed_in_place(ckpts / "step-000004")
    _flip(next((ckpts / "step-000002" / "stage0").glob("*.distcp")))
    (ckpts / "step-000006" / "stage0").mkdir(parents=True)  # a save that never finished: no marker
    (ckpts / "step-000006" / "meta.json").write_text("{}")
    before = _hashes(run)
    why = ("found no usable checkpoint in", "step-000006: it has no COMPLETE marker",
           "step-000004: meta.json is not what was written: its checksum differs",
           "step-000002: stage0/", "nothing was changed", "to start from step 0")
    for extra in ([], ["--dry-run"], ["--simulate", "nvidia:1,amd:1"]):  # the first through the executable
        args = ["train", *TINY, f"--metrics.run_dir={run}", "--resume", *extra]
        line = _refused(_run(args, cwd=run.parent), *why) if not extra else \
            _refused_here(capsys, monkeypatch, args, run.parent, *why)
        # the hand-edited meta.json is damage, not a config that changed the seed
        assert "--resume-changed" not in line and "model.seed" not in line, line
    assert _hashes(run) == before


def test_the_ranks_refuse_alike_where_no_launcher_checked(run: Path) -> None:
    """Under a launcher that does not check (torchrun; here bimetal launch running the rank module itself),
    every rank reads the folder, they agree on each verdict, and every one stops with the same sentence."""
    ckpts = run / "checkpoints"
    for step in ("step-000002", "step-000004"):
        _flip(next((ckpts / step / "stage0").glob("*.distcp")))
    before = _hashes(run)
    proc = _run(["launch", "--simulate", "nvidia:1,amd:1", "--", "-m", "bimetal.train", "--parallel.pp=2", *TINY,
                 f"--metrics.run_dir={run}", "--resume"], cwd=run.parent)
    _refused(proc, "--resume found no usable checkpoint", "step-000004: stage0/", "step-000002: stage0/")
    assert _hashes(run) == before


def test_a_resume_past_a_damaged_checkpoint_keeps_it(run: Path, capsys, monkeypatch) -> None:
    """The check before ranks passes over a hand-edited meta.json as the ranks do (it used to blame the config);
    the run resumes from step 2, and neither the save of step 4 nor pruning touches the damaged folder: it is
    set aside whole as step-000004.damaged."""
    ckpts = run / "checkpoints"
    _seed_in_place(ckpts / "step-000004")
    damaged = _hashes(ckpts / "step-000004")
    # the dry-run by bimetal.cli.main in this process (it starts no rank); the trainer is imported first, since its
    # import sets torch's TORCHINDUCTOR_CACHE_DIR once per process, which cli_main would take for the command's doing
    import bimetal.train.trainer  # noqa: F401

    code, _, err = cli_main(["train", *TINY, "--training.steps=4", f"--metrics.run_dir={run}", "--resume",
                             "--dry-run"], capsys, monkeypatch, cwd=run.parent)
    assert code == 0 and "model.seed" not in err, err[-2000:]
    proc = _run(["train", *TINY, "--training.steps=6", "--checkpoint.every=2", "--checkpoint.keep_last=1",
                 f"--metrics.run_dir={run}", "--resume", "--resume-changed"], cwd=run.parent)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "step-000004 is damaged (meta.json is not what was written" in out and "resumed from" in out, out[-3000:]
    assert f"{ckpts / 'step-000002'} at step 2" in out, out[-3000:]
    assert "kept as step-000004.damaged" in out, out[-3000:]
    # keep_last=1 pruned the intact step 2 and the new step 4; the damaged one stays, byte for byte
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000004.damaged", "step-000006"]
    assert _hashes(ckpts / "step-000004.damaged") == damaged
    # and a later run that is not a resume names it too
    _refused_here(capsys, monkeypatch, ["train", *TINY, f"--metrics.run_dir={run}"], run.parent, "step-000004.damaged")


def test_pp_boundary_dtype_is_kept_on_a_resume_unless_accepted(run: Path, capsys, monkeypatch) -> None:
    before = _hashes(run)
    change = ["train", *TINY, "--training.steps=4", f"--metrics.run_dir={run}", "--resume",
              "--parallel.pp_boundary_dtype=float32"]
    _refused_here(capsys, monkeypatch, [*change, "--dry-run"], run.parent,
                  "was written with parallel.pp_boundary_dtype='compute' but this run has "
                  "parallel.pp_boundary_dtype='float32'", "--resume-changed")
    assert _hashes(run) == before
    proc = _run([*change, "--resume-changed"], cwd=run.parent)  # resumed at step 4 of 4: nothing trains
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "with changed settings" in line]
    assert proc.returncode == 0 and len(said) == 1, proc.stderr[-2000:]
    assert "parallel.pp_boundary_dtype 'compute' -> 'float32'" in said[0], said


def test_an_export_into_the_working_directory_is_refused_before_ranks_start(tmp_path: Path, capsys,
                                                                             monkeypatch) -> None:
    """The case of the issue: a relative export path naming the folder the run works in."""
    (tmp_path / "keep.txt").write_text("the user's")
    before = _hashes(tmp_path)
    # refused before any rank starts: by bimetal.cli.main in this process (an export refused through the executable:
    # test_nothing_lost.py's export-beside-other-weights)
    _refused_here(capsys, monkeypatch, ["train", *TINY, "--simulate", "nvidia:1,amd:1", "--metrics.run_dir=run",
                                        "--checkpoint.export_hf=."], tmp_path,
                  f"checkpoint.export_hf='.' is the working directory {tmp_path}")
    assert _hashes(tmp_path) == before


def test_an_unwritable_sbatch_script_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    before = _hashes(tmp_path)
    _refused(_run(["slurm", "--config", str(ROOT / "configs" / "llama3-8b-h100-mi300x.toml"), "--partition",
                   "nvidia=gpu-h100", "--partition", "amd=gpu-mi300", "--out", f"{tmp_path}/a-file/job.sbatch"],
                  cwd=ROOT), "--out=", "a-file is a file")
    assert _hashes(tmp_path) == before


# ---- the other variants in-process, through the same entry function as the executable (no interpreter start) ----

Case = tuple[str, Callable[[Path], list[str]], tuple[str, ...]]
SLURM = ["slurm", "--config", str(ROOT / "configs" / "llama3-8b-h100-mi300x.toml"), "--partition", "nvidia=a",
         "--partition", "amd=b"]
IN_PROCESS: list[Case] = [
    # exports that are, hold or lie in the run's folders (relative to the working directory, the case folder)
    ("export-is-the-run-folder", lambda t: ["train", "--metrics.run_dir=run", "--checkpoint.export_hf=run"],
     ("checkpoint.export_hf='run' is metrics.run_dir='run'",)),
    ("export-is-the-run-folder-spelled-otherwise", lambda t: ["train", "--metrics.run_dir=run",
                                                              f"--checkpoint.export_hf={t}/x/../run/"],
     ("is metrics.run_dir='run'",)),
    ("export-holds-the-run-folder", lambda t: ["train", "--metrics.run_dir=out/run", "--checkpoint.export_hf=out"],
     ("checkpoint.export_hf='out' holds metrics.run_dir='out/run'",)),
    ("export-in-the-run-folder", lambda t: ["train", "--metrics.run_dir=run", "--checkpoint.export_hf=run/hf"],
     ("lies inside metrics.run_dir='run'",)),
    ("export-is-the-checkpoint-folder", lambda t: ["train", "--metrics.run_dir=run", "--checkpoint.folder=ck",
                                                   "--checkpoint.export_hf=ck"], ("is checkpoint.folder='ck'",)),
    ("export-in-the-checkpoint-folder", lambda t: ["train", "--metrics.run_dir=run", "--checkpoint.folder=ck",
                                                   "--checkpoint.export_hf=ck/hf"],
     ("lies inside checkpoint.folder='ck'",)),
    ("export-holds-the-working-directory", lambda t: ["train", "--metrics.run_dir=run", "--checkpoint.export_hf=.."],
     ("checkpoint.export_hf='..' holds the working directory",)),
    ("export-through-a-link", lambda t: ["train", "--metrics.run_dir=run", f"--checkpoint.export_hf={_link(t)}"],
     ("is metrics.run_dir='run'",)),
    # outputs of other commands, checked by bimetal.outputs before any work
    ("slurm-out-is-a-folder", lambda t: [*SLURM, "--out", str(t)], ("is a folder",)),
    ("slurm-out-under-a-file", lambda t: [*SLURM, "--out", f"{_file(t)}/job.sbatch"], ("--out=", "is a file")),
    ("gpu-ladder-out-under-a-file", lambda t: ["bench", "gpu-ladder", "--cpu", "--out", f"{_file(t)}/ladder"],
     ("--out=", "is a file")),
]


def _file(t: Path) -> Path:
    (t / "a-file").write_text("x")
    return t / "a-file"


def _link(t: Path) -> str:
    (t / "run").mkdir()
    (t / "link").symlink_to(t / "run")
    return "link"


@pytest.mark.parametrize(("build", "fragments"), [c[1:] for c in IN_PROCESS], ids=[c[0] for c in IN_PROCESS])
def test_output_refused_in_one_sentence_with_nothing_written(build, fragments: tuple[str, ...], tmp_path: Path,
                                                             capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path)
    before = _hashes(tmp_path)
    code = main(argv)
    captured = capsys.readouterr()
    _one_sentence(code, captured.out, captured.err, *fragments)
    assert _hashes(tmp_path) == before
