"""Nothing lost, nothing silent: output folders, exports, the dry-run, resumes, through the ``bimetal`` executable.

Every refusal here is asserted alike: exit status 2, one line on stderr starting ``bimetal``, no traceback, nothing
written, no rank started; most are a subprocess of the command a user types, a few (whose class has such a row
already) run ``bimetal.cli.main`` in this process (``cli_inprocess``). Read-only folders are made by the test: a
read-only tmpfs mounted by root (permission bits do not stop root), else a folder without write permission;
a folder "under a regular file" needs neither and runs everywhere. The few runs that train are single
processes of a few steps, shared by the export and resume tests; the in-process catalogue of the same
mistakes is ``test_bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cli_inprocess import cli_main
from launcher import clean_env

from bimetal.outputs import folder_problem

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.toml")
BIG = str(ROOT / "configs" / "llama3-8b-h100-mi300x.toml")
SPEC = str(ROOT / "configs" / "clusters" / "h200_mi325x.toml")
BIMETAL = str(Path(sys.executable).parent / "bimetal")
TINY = ["--data.seq_len=32", "--data.batch_size=2", "--parallel.microbatches=2"]
pytestmark = pytest.mark.timeout(240)


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([BIMETAL, *args], env=env or clean_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=200)


def _one_sentence(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    err = proc.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("bimetal "), err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], err
    assert "bimetal cluster view" not in proc.stdout and "step " not in proc.stdout, proc.stdout  # no rank started
    return lines[0]


@contextlib.contextmanager
def read_only_folder(parent: Path) -> Iterator[Path]:
    """An existing folder no file can be created in: a read-only tmpfs as root, else mode 0555; skips where
    neither stops a write (the probe of bimetal.outputs says whether it did)."""
    folder = parent / "ro"
    folder.mkdir()
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0
    if not mounted:
        folder.chmod(0o555)
    try:
        if folder_problem(folder) is None:
            pytest.skip("neither a read-only tmpfs (needs root and mount) nor mode 0555 stops writes here")
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)
        else:
            folder.chmod(0o755)


# (case id, argv builder taking (tmp folder, a read-only folder, a regular file), environment additions,
# fragments of the one sentence)
Builder = Callable[[Path, Path, Path], list[str]]
REFUSALS: list[tuple[str, Builder, dict[str, str], tuple[str, ...]]] = [
    # 1. every output location, before any rank starts
    ("checkpoint-folder-read-only", lambda t, ro, f: ["train", "--simulate", "nvidia:1,amd:1", *TINY,
                                                      f"--checkpoint.folder={ro}/ck"], {},
     ("checkpoint.folder=", "Read-only file system" if os.geteuid() == 0 else "Permission denied")),
    ("plan-write-read-only", lambda t, ro, f: ["plan", SPEC, "--write", f"{ro}/plan.toml"], {}, ("--write=",)),
    ("titan-dump-folder-under-a-file", lambda t, ro, f: ["titan", "--module", "llama3", "--simulate",
                                                         "nvidia:1,amd:1", f"--dump_folder={f}/out"], {},
     ("--dump_folder=", "is a file")),
    # 2. an export that would leave two models
    ("export-beside-other-weights", lambda t, ro, f: ["train", f"--checkpoint.export_hf={_foreign(t)}"], {},
     ("pytorch_model.bin", "two models")),
    # 3. the dry-run refuses what the run refuses: the layout against the simulated world, checked
    ("dry-run-16-ranks-on-2", lambda t, ro, f: ["train", "--config", BIG, "--simulate", "nvidia:1,amd:1",
                                                "--dry-run"], {}, ("needs 16 ranks but --simulate gives 2",)),
    # 5. an option that needs another, a GPU asked for and absent, a value in a file named with the file
    ("json-without-dry-run", lambda t, ro, f: ["train", "--json"], {}, ("--json formats the --dry-run report",)),
    ("simulate-device-cuda-without-gpu", lambda t, ro, f: ["train", "--simulate", "nvidia:1,amd:1"],
     {"BIMETAL_SIMULATE_DEVICE": "cuda"}, ("BIMETAL_SIMULATE_DEVICE=cuda", "sees no GPU")),
    ("config-file-value-names-the-file", lambda t, ro, f: ["train", "--config", _config(t, "[data]\nbatch_size = 7\n")],
     {}, ("cfg.toml: data.batch_size=7 must be a multiple",)),
]
"""One row per class through the executable; the other variants of each class run in-process in
``test_bad_inputs.py`` (``NOTHING_LOST``), where a case costs no interpreter start."""

IN_PROCESS = ("plan-write-read-only", "dry-run-16-ranks-on-2")
"""Rows run by ``bimetal.cli.main`` in this process (``cli_inprocess``), asserted as the others: their class has a
row through the executable already (an output folder refused: checkpoint-folder-read-only; a layout against the
world: test_first_contact's no-simulate-outside-torchrun; the plan command: test_plan_views)."""


def _foreign(t: Path) -> str:
    folder = t / "hf"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"not ours")
    return str(folder)


def _config(t: Path, text: str) -> str:
    (t / "cfg.toml").write_text(text)
    return str(t / "cfg.toml")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every case run once, three at a time; each case's folder afterwards, to see that nothing was written."""
    base = tmp_path_factory.mktemp("refusals")
    with read_only_folder(base) as ro:
        def one(case: tuple[str, Builder, dict[str, str], tuple[str, ...]]):
            name, build, extra, _ = case
            folder = base / name
            folder.mkdir()
            regular = folder / "a-file"
            regular.write_text("x")
            args = build(folder, ro, regular)
            if args[0] == "train" and not any(a.startswith("--metrics.run_dir") for a in args):
                args.append(f"--metrics.run_dir={folder / 'run'}")
            return name, (_run(args, clean_env(**extra), cwd=folder), folder)

        with ThreadPoolExecutor(3) as pool:
            done = dict(pool.map(one, [c for c in REFUSALS if c[0] not in IN_PROCESS]))
        assert not any(ro.iterdir())
    return done


@pytest.mark.parametrize(("name", "fragments"), [(c[0], c[3]) for c in REFUSALS if c[0] not in IN_PROCESS],
                         ids=[c[0] for c in REFUSALS if c[0] not in IN_PROCESS])
def test_refused_in_one_sentence_with_nothing_written(refusals, name: str, fragments: tuple[str, ...]) -> None:
    proc, folder = refusals[name]
    if name == "simulate-device-cuda-without-gpu" and torch.cuda.is_available():
        pytest.skip("the case is a GPU asked for and absent; this machine has one")
    _one_sentence(proc, *fragments)
    written = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    assert set(written) <= {"a-file", "hf", "cfg.toml"}, written  # what the case itself put there
    if (folder / "hf").is_dir():
        assert sorted(p.name for p in (folder / "hf").iterdir()) == ["pytorch_model.bin"]


@pytest.mark.parametrize("case", [c for c in REFUSALS if c[0] in IN_PROCESS], ids=list(IN_PROCESS))
def test_refused_in_one_sentence_with_nothing_written_in_process(case, tmp_path: Path, capsys, monkeypatch) -> None:
    name, build, extra, fragments = case
    folder = tmp_path / name
    folder.mkdir()
    regular = folder / "a-file"
    regular.write_text("x")
    with read_only_folder(tmp_path) as ro:
        args = build(folder, ro, regular)
        if args[0] == "train" and not any(a.startswith("--metrics.run_dir") for a in args):
            args.append(f"--metrics.run_dir={folder / 'run'}")
        code, out, err = cli_main(args, capsys, monkeypatch, env=extra, cwd=folder)
        assert not any(ro.iterdir())
    _one_sentence(subprocess.CompletedProcess(args, code, out, err), *fragments)
    assert sorted(p.name for p in folder.iterdir()) == ["a-file"]


def test_master_port_is_honoured_and_a_busy_one_is_one_sentence(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = _run(["launch", "--simulate", "nvidia:1,amd:1", "--master-port", str(port), "--", "-c", "pass"])
        _one_sentence(proc, f"--master-port {port} cannot be used", "in use")
    # free again: the ranks' store is on it (it was silently ignored before)
    proc = _run(["launch", "--nproc-per-node", "1", "--master-port", str(port), "--", "-c",
                 "import os; print('port', os.environ['MASTER_PORT'])"])
    assert proc.returncode == 0 and f"port {port}" in proc.stdout, (proc.stdout, proc.stderr)


def test_unwritable_checkpoint_folder_is_found_by_the_ranks_before_step_1(tmp_path: Path) -> None:
    """Under a launcher that does not check (torchrun, here bimetal launch running the rank module directly),
    each rank checks the folders it writes before its first step: one sentence, nothing trained."""
    with read_only_folder(tmp_path) as ro:
        run_dir = tmp_path / "run"
        proc = _run(["launch", "--simulate", "nvidia:1,amd:1", "--", "-m", "bimetal.train", "--parallel.pp=2", *TINY,
                     f"--metrics.run_dir={run_dir}", f"--checkpoint.folder={ro}/ck"])
        _one_sentence(proc, "checkpoint.folder=")
        assert not run_dir.exists() and not any(ro.iterdir())


# ---- the dry-run sees what the run does ----

def test_dry_run_sizes_the_layout_the_run_trains(capsys, monkeypatch) -> None:
    # by bimetal.cli.main in this process: a dry-run starts no rank (the console script's --dry-run --json, its
    # stdout read as JSON: test_dryrun.py). The trainer is imported first: the import sets torch's
    # TORCHINDUCTOR_CACHE_DIR, once per process, which cli_main would take for the command's doing.
    import bimetal.train.trainer  # noqa: F401

    code, out, err = cli_main(["train", "--simulate", "nvidia:2,amd:2", "--dry-run", "--json"], capsys, monkeypatch,
                              cwd=ROOT)
    assert code == 0, err
    report = json.loads(out)
    assert len(report["stages"]) == 2 and report["files_checked"] is True  # pp=2, checked as the run checks
    assert "layout chosen from the 4 simulated ranks: pp=2 x dp=2" in err  # JSON stays alone on stdout


# ---- exports replace, never mix ----

def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from bimetal.models import from_hf

    return {k: v.detach().clone() for k, v in from_hf(folder).named_parameters()}


def _transformers_embedding(folder: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.model.embed_tokens.weight.detach().clone()


def _checkpoint_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"weights-{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{step:06d}" / "stage0"), str(out))
    return torch.load(out, weights_only=False)["model"]


def test_python_export_replaces_sharded_single_and_back(tmp_path: Path) -> None:
    from bimetal import models
    from bimetal.models import export_hf

    args = models.FLAVOURS["llama3"]["debug"]
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # not weights: kept through every export
    for seed, shard in ((1, 200_000), (2, 0), (3, 150_000), (4, 0)):
        torch.manual_seed(seed)
        model = models.build_model("llama3", args)
        export_hf(model, args, folder, max_shard_bytes=shard)
        names = sorted(p.name for p in folder.iterdir())
        shards = [n for n in names if n.startswith("model-")]
        if shard:
            assert "model.safetensors" not in names and "model.safetensors.index.json" in names and len(shards) > 1
            assert all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards), names
        else:
            assert shards == [] and "model.safetensors.index.json" not in names and "model.safetensors" in names
        assert {"config.json", "tokenizer.json"} <= set(names) and not any(n.startswith(".") for n in names), names
        assert not any(p.name.startswith(".hf.bimetal") for p in tmp_path.iterdir())  # the swap left nothing
        back = _hf_weights(folder)
        assert back.keys() == dict(model.named_parameters()).keys()
        assert all(torch.equal(back[k], v) for k, v in model.named_parameters())
        assert torch.equal(_transformers_embedding(folder), model.tok_embeddings.weight)


def test_python_export_inside_a_folder_whose_parent_is_read_only(tmp_path: Path) -> None:
    """A folder that is a mount point cannot be swapped: the files are staged inside it and moved in."""
    if os.geteuid() != 0:
        pytest.skip("mounting the export folder needs root")
    from bimetal import models
    from bimetal.models import export_hf

    args = models.FLAVOURS["llama3"]["debug"]
    folder = tmp_path / "mnt"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        for seed, shard in ((1, 200_000), (2, 0), (3, 150_000)):
            torch.manual_seed(seed)
            model = models.build_model("llama3", args)
            export_hf(model, args, folder, max_shard_bytes=shard)
            names = sorted(p.name for p in folder.iterdir())
            assert ("model.safetensors" in names) == (shard == 0) and \
                ("model.safetensors.index.json" in names) == (shard > 0), names
            assert not any(n.startswith(".") for n in names), names
            back = _hf_weights(folder)
            assert all(torch.equal(back[k], v) for k, v in model.named_parameters())
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One single-process run of 2 steps, checkpointed, its export sharded: (run folder, export folder)."""
    base = tmp_path_factory.mktemp("trained")
    run, hf = base / "run", base / "hf"
    proc = _run(["train", *TINY, "--training.steps=2", f"--metrics.run_dir={run}", f"--checkpoint.export_hf={hf}",
                 "--checkpoint.export_shard_bytes=200000"], cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, hf


def test_resume_with_a_changed_setting_is_refused_then_accepted_and_the_export_replaced(trained, capsys,
                                                                                          monkeypatch) -> None:
    run, hf = trained
    first = _hf_weights(hf)
    assert (hf / "model.safetensors.index.json").is_file() and not (hf / "model.safetensors").exists()
    changed = ["train", "--data.seq_len=16", "--data.batch_size=2", "--training.steps=3", f"--metrics.run_dir={run}",
               f"--checkpoint.export_hf={hf}", "--resume"]
    why = ("was written with data.seq_len=32 but this run has data.seq_len=16", "--resume-changed")
    # the run and its dry-run refuse alike, before anything starts (the dry-run by bimetal.cli.main here)
    _one_sentence(_run(changed, cwd=run.parent), *why)
    dry = [*changed, "--dry-run"]
    _one_sentence(subprocess.CompletedProcess(dry, *cli_main(dry, capsys, monkeypatch, cwd=run.parent)), *why)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    proc = _run([*changed, "--resume-changed"], cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "with changed settings" in line]
    assert len(said) == 1 and "data.seq_len 32 -> 16" in said[0] and "training.steps 2 -> 3" in said[0], said
    # the folder now holds the single-file export of step 3 alone: from_hf and transformers read those weights
    names = sorted(p.name for p in hf.iterdir())
    assert names == ["config.json", "model.safetensors"], names
    last, ckpt = _hf_weights(hf), _checkpoint_weights(run, 3)
    assert all(torch.equal(last[k], ckpt[k]) for k in last) and not torch.equal(last["norm.weight"],
                                                                                first["norm.weight"])
    assert torch.equal(_transformers_embedding(hf), ckpt["tok_embeddings.weight"])


def test_every_damaged_file_of_a_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    """Each file of a checkpoint cut short or changed in place: the checkpoint is passed over in one sentence."""
    from bimetal.train import checkpoint

    lin = torch.nn.Linear(4, 3)
    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"model": lin.state_dict()}, {"step": step}, {"family": "llama3"})
    newest = tmp_path / "step-000002"
    files = sorted(str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file())
    assert {"COMPLETE", "meta.json", "extra-rank0.json", "stage0/.metadata"} <= set(files), files
    pristine = {name: (newest / name).read_bytes() for name in files}
    for name in files:
        for how in ("cut", "flip"):
            data = bytearray(pristine[name])
            if how == "cut":
                data = data[: len(data) // 2]
            else:
                for i in range(len(data) // 2, min(len(data) // 2 + 4, len(data))):
                    data[i] ^= 0x5A
            (newest / name).write_bytes(bytes(data))
            notes: list[str] = []
            found = checkpoint.latest(tmp_path, warn=notes.append, verify=True)
            assert found == tmp_path / "step-000001", (name, how, notes)
            assert len(notes) == 1 and "step-000002 is damaged" in notes[0], (name, how, notes)
            assert notes[0].endswith("resuming from step-000001 instead."), notes
            (newest / name).write_bytes(pristine[name])
    assert checkpoint.latest(tmp_path, verify=True) == newest
