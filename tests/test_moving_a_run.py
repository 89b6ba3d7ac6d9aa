"""One checkpoint, any layout: a run moves to another pp split, dp, tp and vendor mix, its trajectory kept.

Through ``bimetal train`` (issue 40), the debug LLaMA-3 of ``configs/demo.toml`` in float32 on CPU, sequences of
32 tokens, a global batch of 16 rows. One uninterrupted run of 20 steps on ``nvidia:2,amd:2`` (pp=2 x dp=2,
split [3, 1]) is the reference; its step-10 checkpoint is resumed for 10 more steps on

* ``amd:1,nvidia:1`` under torchrun with ``parallel.layout = "auto"``: the ranks pick pp=2 x dp=1, split [2, 2], 8
  microbatches of 2 rows (dp=2 -> dp=1, the same global batch; the one line rank 0 logs is checked);
* ``nvidia:2`` as pp=1 x tp=2 (pp=2 -> pp=1, a vendor mix -> one vendor, tp=1 -> tp=2), whose step-15
  checkpoint is resumed again by one process (tp=2 -> tp=1);
* ``nvidia:2`` as pp=1 x dp=2 sharded (FSDP, dp_shard=2), whose step-15 checkpoint (shard parts) is resumed
  again by one process;

and its step-15 checkpoint for 5 more on ``nvidia:4`` with ``auto`` keeping the split [3, 1] as written: the
same pp and dp, only the vendor mix moves.

Each resumed run's losses equal the reference's (relative 1e-5). The optimizer state travels with the weights:
the same step-15 checkpoint with its AdamW moments and step counts zeroed (a test double of "the optimizer was
reset", written through ``checkpoint.save``) gives the reference's loss at step 16 (same weights) and other
losses after it. A checkpoint in the format before global keys (a test double: the same tensors under
``stage0.``, ``meta.json`` without ``keys``, as the trainer wrote them before) resumes on its own layout with the
reference's losses and is refused on another one; during a layout change (a fixed one, or one ``auto`` picks), a
resume of another model, another global batch or another sequence length, and one whose only checkpoint is
damaged, are refused. Each refusal: exit 2, one line on stderr, nothing written (the folder hashed before and
after); a refusal comes before any rank starts, so it runs ``bimetal.cli.main`` in this process.
The reference and the torchrun move go through their commands; the moves under ``--simulate`` (one after another)
and the one-process resumes (all at once) run ``python -m bimetal.train`` (the ``bimetal train`` command's own
``main``; under ``--simulate`` the job's launcher) forked from one interpreter that imported the trainer once
(tests/forked_runs.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import clean_env
from test_train_parity import DEMO, EXE

from bimetal.cli import main

pytestmark = pytest.mark.timeout(600)  # the first test waits for the reference and every move
RUN = ["train", "--config", str(DEMO), "--training.steps=20", "--checkpoint.every=10", "--metrics.log_every=100",
       "--data.seq_len=32", "--training.dtype=float32"]
ONE = ["--parallel.pp=1", "--parallel.layers_per_stage=[]", "--parallel.dp=1", "--data.batch_size=16",
       "--parallel.microbatches=8"]
"""One process holding the whole model and the whole global batch."""
PP1 = ["--simulate", "nvidia:2", "--parallel.pp=1", "--parallel.layers_per_stage=[]"]
"""Both stages' layers on one stage of ``nvidia:2``."""
TORCHRUN = "torchrun"
"""The move run by torchrun (the ranks find their world with no launcher's check first)."""
MOVES = {
    "amd1-nvidia1-auto": (10, [TORCHRUN, "amd:1,nvidia:1", "--parallel.layout=auto"]),
    "nvidia2-tp2": (10, [*PP1, "--parallel.dp=1", "--data.batch_size=16", "--parallel.microbatches=8",
                         "--parallel.tp=2", "--checkpoint.every=5"]),
    "nvidia2-shard2": (10, [*PP1, "--parallel.dp_shard=2", "--checkpoint.every=5"]),
    "nvidia4-vendors-only": (15, ["--simulate", "nvidia:4", "--parallel.layout=auto",
                                  "--parallel.layers_per_stage=[3,1]"]),
}
"""Moves of the reference's checkpoint of that step; nvidia2-* write step-15 checkpoints, moved again to one process."""
PICKED = {
    "amd1-nvidia1-auto": ("parallel.layout='auto' on amd:1,nvidia:1 on 1 node: pp=2 x dp=1 x tp=1, layers per stage "
                          "[2, 2], 8 microbatch(es) of 2 rows per replica, global batch 16 kept (the fewest pipeline "
                          "stages whose stages are each one vendor)"),
    "nvidia4-vendors-only": ("parallel.layout='auto' on nvidia:4 on 1 node: pp=2 x dp=2 x tp=1, layers per stage "
                             "[3, 1], 4 microbatch(es) of 2 rows per replica, global batch 16 kept (the fewest "
                             "pipeline stages whose stages are each one vendor, keeping parallel.layers_per_stage, "
                             "parallel.pp as written)"),
}
"""The line rank 0 logs for each move whose layout the ranks pick."""
RTOL = 1e-5


def _bimetal(run: Path, *args: str) -> subprocess.CompletedProcess:
    """``bimetal train`` of the test's config with ``args``; ``TORCHRUN VENDORS ...``: its rank module under torchrun,
    one rank per simulated vendor."""
    head = [EXE, *RUN]
    env = None
    if args and args[0] == TORCHRUN:
        vendors, args = args[1], args[2:]
        head = [str(Path(EXE).parent / "torchrun"), "--standalone", f"--nproc-per-node={len(vendors.split(','))}",
                "-m", "bimetal.train", *RUN[1:]]
        env = clean_env(BIMETAL_SIMULATE=vendors)
    return subprocess.run([*head, f"--metrics.run_dir={run}", *args], capture_output=True, text=True,
                          timeout=240, cwd=run.parent, env=env)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _from(ckpt: Path, run: Path) -> Path:
    """A run folder holding a copy of the checkpoint ``ckpt`` alone."""
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    return run


def _same(got: dict[int, float], ref: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), sorted(got)
    bad = [(s, got[s], ref[s]) for s in steps if abs(got[s] - ref[s]) > RTOL * abs(ref[s])]
    assert not bad, bad


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "/"
            for p in sorted(folder.rglob("*"))}


def _refused(run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, fragment: str,
             *args: str) -> None:
    """``bimetal train ARGS`` on ``run`` is refused: exit 2, one line on stderr naming ``fragment``, nothing trained.
    Run by ``bimetal.cli.main`` in this process (a refusal comes before any rank starts: no process to pay for)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(run.parent)
    capsys.readouterr()
    code = main([*RUN, f"--metrics.run_dir={run}", *args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("bimetal ") and fragment in lines[0], err
    assert "Traceback" not in err + out and "resumed from" not in out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference run and every move of its step-10 checkpoint, each run once for all the tests."""
    base = tmp_path_factory.mktemp("moving")
    ref = base / "reference"
    r = _bimetal(ref, "--simulate", "nvidia:2,amd:2", "--checkpoint.every=5")  # keeps steps 10, 15 and 20
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out: dict[str, Any] = {"reference": ref, "base": base}
    # The moves under --simulate: python -m bimetal.train (the command's own main, the job's launcher), one after
    # another, forked from one interpreter that imported the trainer once (tests/forked_runs.py).
    from forked_runs import runs as forked

    simulated = {}
    for name, (step, args) in MOVES.items():
        run = _from(ref / "checkpoints" / f"step-{step:06d}", base / name)
        if args[0] == TORCHRUN:
            r = _bimetal(run, *args, "--resume")
            assert r.returncode == 0, (name, r.stdout[-2000:] + r.stderr[-3000:])
            out[name] = (run, r.stdout + r.stderr)
        else:
            simulated[name] = (["-m", "bimetal.train", *RUN[1:], f"--metrics.run_dir={run}", *args, "--resume"], run)
    done = forked([(argv, run.parent) for argv, run in simulated.values()], at_once=False, timeout=600)
    for (name, (_, run)), r in zip(simulated.items(), done):
        assert r.returncode == 0, (name, r.stdout[-2000:] + r.stderr[-3000:])
        out[name] = (run, r.stdout + r.stderr)
    return out


@pytest.mark.parametrize("name", list(MOVES))
def test_a_checkpoint_resumes_on_another_layout_and_vendor_mix_with_the_same_losses(runs, name: str) -> None:
    run, log = runs[name]
    step = MOVES[name][0]
    _same(_losses(run), _losses(runs["reference"]), range(step + 1, 21))
    moved = [line for line in log.splitlines() if "on a new layout" in line]
    assert len(moved) == 1 and "the trajectory" in moved[0], log[-3000:]
    assert "vendors nvidia:2,amd:2 -> " in moved[0], moved[0]  # every move here leaves the AMD pair
    if name in PICKED:  # one line, by rank 0, says the layout the ranks picked for the world they found
        picked = [line for line in log.splitlines() if "parallel.layout='auto' on " in line]
        assert picked == [f"bimetal train: {PICKED[name]}"], log[-3000:]
    if name == "nvidia4-vendors-only":  # the same pp, dp and split: the vendor mix is the whole move
        assert moved[0].endswith("on a new layout: vendors nvidia:2,amd:2 -> nvidia:4; the trajectory (model, "
                                 "global batch, data order, optimizer state) is kept."), moved[0]


ONE_PROCESS = ("nvidia2-tp2-to-one", "nvidia2-shard2-to-one", "reset", "legacy")
"""The one-process resumes: the tp=2 and FSDP moves' step-15 checkpoints, the double of a reset optimizer, the double
of an old checkpoint."""


@pytest.fixture(scope="module")
def one_process(runs) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every one-process resume, started at once: ``python -m bimetal.train`` (the ``bimetal train`` command's own
    ``main``, one process without ``--simulate``) forked from one interpreter that imported the trainer once
    (tests/forked_runs.py)."""
    from forked_runs import runs as forked

    folders = {f"{name}-to-one": _from(runs[name][0] / "checkpoints" / "step-000015", runs["base"] / f"{name}-to-one")
               for name in ("nvidia2-tp2", "nvidia2-shard2")}
    # The double of a reset optimizer: the same checkpoint with AdamW's moments and step counts zeroed.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from bimetal.train import checkpoint

    ckpt = runs["nvidia2-tp2"][0] / "checkpoints" / "step-000015"
    dcp_to_torch_save(str(ckpt / "stage0"), str(runs["base"] / "tp2-15.pt"))
    state = torch.load(runs["base"] / "tp2-15.pt", weights_only=False)  # our own file
    for per_param in state["optim"]["state"].values():
        for t in per_param.values():
            t.zero_()
    folders["reset"] = runs["base"] / "reset"
    checkpoint.save(folders["reset"] / "checkpoints", 15, state, json.loads((ckpt / "extra-rank0.json").read_text()),
                    json.loads((ckpt / "meta.json").read_text()))
    folders["legacy"] = _legacy(ckpt, runs["base"] / "legacy")
    done = forked([(["-m", "bimetal.train", *RUN[1:], f"--metrics.run_dir={folders[name]}", *ONE, "--resume"],
                    folders[name].parent) for name in ONE_PROCESS])
    return {name: (folders[name], r) for name, r in zip(ONE_PROCESS, done)}


def test_tp2_and_fsdp_shards_to_one_process_and_the_optimizer_state_travels(runs, one_process) -> None:
    ref = _losses(runs["reference"])
    for name, moved in (("nvidia2-tp2", "tp 2 -> 1"), ("nvidia2-shard2", "dp_shard 2 -> 1")):
        run, r = one_process[f"{name}-to-one"]
        assert r.returncode == 0 and moved in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
        _same(_losses(run), ref, range(16, 21))
    reset, r = one_process["reset"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = _losses(reset)
    _same({16: got[16]}, ref, range(16, 17))  # the weights of step 15 are the same
    assert all(abs(got[s] - ref[s]) > 1e-3 * ref[s] for s in range(17, 21)), (got, ref)


def _legacy(ckpt: Path, folder: Path) -> Path:
    """A checkpoint as the trainer wrote it before the global keys (a test double built from ``ckpt``, a
    one-part checkpoint): its tensors under ``stage0.``, ``meta.json`` without ``keys`` nor ``global_batch``,
    for one process of the global batch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from bimetal.train.ckpt_files import MARKER, manifest

    pt = folder.parent / "legacy.pt"
    dcp_to_torch_save(str(ckpt / "stage0"), str(pt))
    state = torch.load(pt, weights_only=False)  # our own file
    out = folder / "checkpoints" / ckpt.name
    out.mkdir(parents=True)
    with warnings.catch_warnings():  # one process, as the trainer's parts are written
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"stage0": state}, checkpoint_id=str(out / "stage0"), no_dist=True)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["keys"], meta["trajectory"]["global_batch"]
    meta |= {"tp": 1, "dp": 1, "layers_per_stage": [4]}
    (out / "meta.json").write_text(json.dumps(meta))
    extra = json.loads((ckpt / "extra-rank0.json").read_text())
    del extra["data"]["position"]
    (out / "extra-rank0.json").write_text(json.dumps(extra))
    (out / MARKER).write_text(json.dumps({"step": int(ckpt.name[5:]), **manifest(out)}))
    return folder


def test_an_old_checkpoint_loads_on_its_own_layout_and_is_refused_on_another(runs, one_process, capsys,
                                                                            monkeypatch) -> None:
    ref = _losses(runs["reference"])
    tp_run, _ = runs["nvidia2-tp2"]
    # refused on another layout: a second copy of the double, untouched by the resume that the fixture ran
    old = _legacy(tp_run / "checkpoints" / "step-000015", runs["base"] / "legacy-refused")
    before = _hashes(old)
    _refused(old, capsys, monkeypatch, "before checkpoints were keyed by global names", "--simulate", "nvidia:2", *ONE,
             "--parallel.dp=2", "--data.batch_size=8", "--resume")
    assert _hashes(old) == before
    old, r = one_process["legacy"]
    assert r.returncode == 0 and "on a new layout" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    _same(_losses(old), ref, range(16, 21))


def test_a_move_that_changes_the_trajectory_or_finds_damage_is_refused(runs, capsys, monkeypatch) -> None:
    ckpt = runs["reference"] / "checkpoints" / "step-000010"
    run = _from(ckpt, runs["base"] / "refused")
    before = _hashes(run)
    auto = ["--simulate", "nvidia:2", "--parallel.layout=auto"]  # pp=1 x dp=2 picked: a layout change too
    for args, why in (([*PP1, "--data.batch_size=4"], "global_batch=16"),
                      ([*auto, "--data.batch_size=4"], "global_batch=16"),
                      ([*auto, "--data.seq_len=16"], "data.seq_len=32"),
                      ([*PP1, "--model.flavour=debug", "--model.family=qwen2"], "family='llama3'")):
        _refused(run, capsys, monkeypatch, why, *args, "--resume")
        assert _hashes(run) == before
    part = next((run / "checkpoints" / "step-000010" / "stage1").glob("*.distcp"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x5A
    part.write_bytes(bytes(data))
    before = _hashes(run)
    _refused(run, capsys, monkeypatch, "found no usable checkpoint", *PP1, "--resume")
    assert _hashes(run) == before
