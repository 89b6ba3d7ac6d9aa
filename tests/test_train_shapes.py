"""Stages of different shapes train exactly like one process, and move the bytes of equal shapes.

Rows (``bimetal train --simulate``, the debug LLaMA-3 of ``configs/demo.toml`` with its split [3, 1], float32 on
CPU, 10 steps, a global batch of 16 rows of 32 tokens in 4 global microbatches, cpu-forward across vendors):

* stage 0 dp=2 / stage 1 dp=1 / stage 2 dp=1 (``nvidia:2,amd:2``, split [2, 1, 1]): each "amd" microbatch joins the
  rows of two "nvidia" senders; stage 1 is a middle stage, and its boundary to stage 2 stays inside the vendor;
* stage 0 tp=2 / stage 1 tp=1 (``nvidia:2,amd:1``): each "nvidia" tp rank sends its half of the hidden columns;
* stage 0 dp_shard=2 / stage 1 dp=2 replicated (``nvidia:2,amd:2``): FSDP on one island, plain dp on the other;
  dp and tp agree, so this is the uniform pipeline (torch's 1F1B) and serves as the equal-shapes reference;
* the dp 2/1/1 row again on device-direct, uninterrupted: the cpu-forward dp 2/1/1 run has its "amd" rank kill
  itself after step 6 and be restarted (``--max-restarts=1``) from the step-5 checkpoint, and its losses must
  equal these bit for bit. The tp row runs GPipe's order, the others 1F1B.

Checked: losses at every step within 1e-5 relative of the one-process run of the same global batch, final weights
within 1e-5, the HF export equal to the final checkpoint; cross-vendor bytes per step (the transport's own
counters, summed over ranks) equal to the equal-shapes row's; a kill and restart, and a resume from the step-5
checkpoint, bit-identical; the step-5 checkpoint moved to a uniform pp=2 x dp=2 layout continues with the same
losses (relative 1e-5, ``docs/moving-a-run.md``).

The reference and the rows run through ``python -m bimetal.train`` (the command's own ``main``), forked one after
another from one interpreter that imported the trainer once (tests/forked_runs.py); the resumes through the
``bimetal train`` command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_train_fsdp import COMMON, STEPS, _flat
from test_train_parity import DEMO, EXE, RTOL, SINGLE, _losses, _transport_missing, _weights

from bimetal.train.shards import assemble

pytestmark = pytest.mark.timeout(900)  # the first test waits for every run of the file
SEQ = 32  # test_train_fsdp's COMMON: 10 steps of 32 tokens, checkpoints of steps 5 and 10
BATCH = ["--data.global_batch_size=16", "--parallel.microbatches=4", "--training.dtype=float32"]
THREE = ["--parallel.pp=3", "--parallel.layers_per_stage=[2,1,1]", "--parallel.dp_per_stage=[2,1,1]"]
"""Three stages: nvidia dp=2, then two amd stages of dp=1 (a middle stage, and a boundary inside a vendor)."""
ROWS = {
    "dp2-dp1-dp1": ("nvidia:2,amd:2", THREE),
    "tp2-tp1": ("nvidia:2,amd:1", ["--parallel.tp_per_stage=[2,1]", "--parallel.dp_per_stage=[1,1]",
                                   "--parallel.schedule=gpipe"]),
    "shard2-dp2": ("nvidia:2,amd:2", ["--parallel.dp_per_stage=[2,2]", "--parallel.dp_shard_per_stage=[2,1]"]),
    "dp2-dp1-dp1-dd": ("nvidia:2,amd:2", [*THREE, "--parallel.pp_transport=device-direct"]),
}
KILLED = {"dp2-dp1-dp1": "2:6"}
"""Rows whose rank kills itself after a step (``BIMETAL_FAULT_KILL``); torchrun restarts it from step 5."""
_RUNS: dict[str, tuple[Path, str] | str] = {}


def _shaped_argv(name: str, run: Path, *extra: str, kill: str = "") -> tuple[list[str], dict[str, str]]:
    """The arguments after ``bimetal train`` of row ``name`` run in ``run``, and its environment."""
    simulate, layout = ROWS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BIMETAL_FAULT")}
    if kill:
        env["BIMETAL_FAULT_KILL"] = kill
        extra = (*extra, "--max-restarts=1")
    return ["--config", str(DEMO), *COMMON, *BATCH, "--parallel.pp_transport=cpu-forward", *layout,
            f"--metrics.run_dir={run}", "--simulate", simulate, *extra], env


def _shaped(name: str, run: Path, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    """Row ``name`` through the ``bimetal train`` command."""
    args, env = _shaped_argv(name, run, *extra, kill=kill)
    return subprocess.run([EXE, "train", *args], capture_output=True, text=True, timeout=240, cwd=run.parent,
                          env=env)


def _all_runs(factory: pytest.TempPathFactory) -> None:
    """The single-process reference and every row, once for the file, one after another, each ``python -m
    bimetal.train`` (the ``bimetal train`` command's own ``main``; with ``--simulate`` the job's launcher, forking its
    ranks) forked from one interpreter that imported the trainer once (tests/forked_runs.py). A row whose transport
    cannot be tested here is kept as the reason."""
    if _RUNS:
        return
    from forked_runs import runs

    todo: list[tuple[str, Path, list[str], dict[str, str]]] = []
    single = factory.mktemp("single") / "run"
    todo.append(("single", single, ["--config", str(DEMO), *COMMON, f"--metrics.run_dir={single}", *SINGLE],
                 dict(os.environ)))
    for name in ROWS:
        transport = "device-direct" if "-dd" in name else "cpu-forward"
        if (why := _transport_missing(transport)) is not None:
            _RUNS[name] = f"transport {transport} not testable: {why}"
            continue
        run = factory.mktemp(name) / "run"
        todo.append((name, run, *_shaped_argv(name, run, f"--checkpoint.export_hf={run.with_name('hf')}",
                                              kill=KILLED.get(name, ""))))
    done = runs([(["-m", "bimetal.train", *args], run.parent) for _, run, args, _ in todo],
                envs=[env for *_, env in todo], at_once=False, timeout=800)
    for (name, run, _, _), r in zip(todo, done):
        assert r.returncode == 0, (name, r.stdout[-2000:] + r.stderr[-3000:])
        _RUNS[name] = (run, r.stdout + r.stderr)


def _run(name: str, factory: pytest.TempPathFactory) -> tuple[Path, str]:
    _all_runs(factory)
    got = _RUNS[name]
    if isinstance(got, str):
        pytest.skip(got)
    return got


def _all_weights(run: Path) -> dict[str, torch.Tensor]:
    """Every stage's weights at the last step: whole-tensor stages as saved, FSDP stages reassembled from their
    parts."""
    weights = _weights(run, STEPS)
    weights.update(_sharded(run))
    return weights


def _sharded(run: Path) -> dict[str, torch.Tensor]:
    """The FSDP stages' weights at the last step, reassembled from their shard parts (``test_train_fsdp``'s way)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run / "checkpoints" / f"step-{STEPS:06d}"
    extras = [json.loads(p.read_text()) for p in sorted(folder.glob("extra-rank*.json"))]
    layouts = {e["shards"]["part"]: e["shards"]["tensors"] for e in extras if "shards" in e}
    out: dict[str, torch.Tensor] = {}
    for stage in sorted({p.name.split("-")[0] for p in folder.glob("stage*-shard*")}):
        parts, lays = [], []
        for part_dir in sorted(folder.glob(f"{stage}-shard*")):
            pt = run / f"{part_dir.name}.pt"
            dcp_to_torch_save(str(part_dir), str(pt))
            parts.append(_flat(torch.load(pt, weights_only=False)))  # our own file
            lays.append(layouts[part_dir.name])
        whole = assemble(parts, lays)  # type: ignore[arg-type]
        prefix = "model."  # keyed by the whole model's names
        out.update({k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)})
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run("single", tmp_path_factory)[0]


@pytest.mark.parametrize("name", list(ROWS))
def test_stage_shapes_match_single_process(name: str, single: Path, tmp_path_factory: pytest.TempPathFactory,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run, stdout = _run(name, tmp_path_factory)
    ref, got = _losses(single), _losses(run)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert abs(got[step] - ref[step]) <= RTOL * abs(ref[step]), (step, got[step], ref[step])
    w_ref, w_got = _weights(single, STEPS), _all_weights(run)
    assert sorted(w_got) == sorted(w_ref)
    for n, t in w_ref.items():
        assert float((w_got[n] - t).norm() / t.norm()) <= RTOL, n
    from bimetal.models import from_hf

    exported = dict(from_hf(run.with_name("hf")).named_parameters())
    assert sorted(exported) == sorted(w_got) and all(torch.equal(exported[n], w_got[n]) for n in w_got)
    if name == "dp2-dp1-dp1":  # the group table shows each stage's shape and the boundary pairs
        assert "stage 0: nvidia dp=2 x tp=1 ranks [0, 1]" in stdout and "stage 2: amd dp=1 x tp=1 ranks [3]" in stdout
        lines = stdout.splitlines()
        assert any(line.startswith("pp.b0.dp1tp0-dp0tp0") and "bimetal_cpu_forward" in line for line in lines), stdout
        assert any(line.startswith("pp.b1.dp0tp0-dp0tp0") and "homogeneous-amd" in line for line in lines), stdout
        # the dry-run's receive term for bimetal's runner: each in-flight microbatch's gathered input (1F1B: two on
        # the middle stage, one on the last), as the ranks measured it
        from bimetal.cli import main

        assert main(["train", "--config", str(DEMO), *COMMON, *BATCH, *THREE, "--simulate", "nvidia:2,amd:2",
                     f"--metrics.run_dir={run}-dry", "--dry-run", "--json"]) == 0
        dry = json.loads(capsys.readouterr().out)["stages"]
        for rank, stage in ((2, 1), (3, 2)):
            held = json.loads((run / f"memory-rank{rank}.json").read_text())["recv_buffers"]
            assert held == dry[stage]["recv_buffers"] == (3 - stage) * 4 * SEQ * 128 * 4, (rank, held, dry[stage])


def test_cross_vendor_bytes_equal_those_of_equal_shapes(tmp_path_factory: pytest.TempPathFactory) -> None:
    per_step = {name: {r["step"]: r["xvendor_bytes"] for r in map(json.loads, (_run(name, tmp_path_factory)[0] /
                                                                                "metrics.jsonl").read_text().splitlines())}
                for name in ROWS if "-dd" not in name or _transport_missing("device-direct") is None}
    payload = 4 * 2 * (4 * SEQ * 128 * 4)  # 4 microbatches x (activation + gradient) of 4 rows x SEQ x 128 float32
    equal = per_step["shard2-dp2"]
    for name in sorted(set(per_step) - {"shard2-dp2"}):
        assert set(per_step[name].values()) == {payload}, per_step[name]
        # torch's pipeline stage exchanges a few bytes once, in step 1; every step after moves the same bytes
        assert {s: b for s, b in per_step[name].items() if s > 1} == {s: b for s, b in equal.items() if s > 1}
        assert 0 <= equal[1] - per_step[name][1] <= 64
    summary = json.loads((_run("tp2-tp1", tmp_path_factory)[0] / "summary.json").read_text())
    assert summary["xvendor_source"] == "pp: transport counters" and summary["pp_transport"] == "bimetal_cpu_forward"


def test_a_killed_rank_restarts_and_stays_bit_identical(tmp_path_factory: pytest.TempPathFactory) -> None:
    run, out = _run("dp2-dp1-dp1", tmp_path_factory)
    assert "rank 2 kills itself after step 6" in out and "resumed from" in out, out[-3000:]
    if (why := _transport_missing("device-direct")) is not None:
        pytest.skip(f"the uninterrupted twin runs on device-direct: {why}")
    twin, _ = _run("dp2-dp1-dp1-dd", tmp_path_factory)
    killed, uninterrupted = _losses(run), _losses(twin)
    assert sorted(killed) == list(range(1, STEPS + 1))
    assert all(killed[s] == uninterrupted[s] for s in killed), [(s, killed[s], uninterrupted[s]) for s in killed]


def test_resume_is_identical_and_moves_to_a_uniform_layout(tmp_path_factory: pytest.TempPathFactory,
                                                           tmp_path: Path) -> None:
    run, _ = _run("dp2-dp1-dp1", tmp_path_factory)
    full = _losses(run)
    for name, extra in (("same", []),  # the same shapes: bit for bit
                        ("uniform", ["--parallel.pp=2", "--parallel.layers_per_stage=[3,1]", "--parallel.dp=2",
                                     "--parallel.dp_per_stage=[]", "--data.batch_size=8"])):  # pp 3 -> 2, dp 2
        resumed = tmp_path / name / "run"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run / "checkpoints" / "step-000005", resumed / "checkpoints" / "step-000005")
        r = _shaped("dp2-dp1-dp1", resumed, "--resume", *extra)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        again = _losses(resumed)
        assert sorted(again) == list(range(6, STEPS + 1))
        if not extra:
            assert all(again[s] == full[s] for s in again), [(s, again[s], full[s]) for s in again]
            continue
        assert "on a new layout: layers_per_stage [2, 1, 1] -> [3, 1]" in r.stderr, r.stderr[-3000:]
        assert all(abs(again[s] - full[s]) <= RTOL * full[s] for s in again), [(s, again[s], full[s]) for s in again]
