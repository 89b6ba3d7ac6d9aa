"""The main job is correct: pp=2 x dp=2 across simulated vendors trains exactly like one process.

Scenarios (one row each, below): the debug LLaMA-3 of ``configs/demo.toml`` with its uneven split [3, 1],
10 steps, run as 4 ranks (``--simulate nvidia:2,amd:2``: stage 0 on the two "nvidia" ranks, stage 1 on the
two "amd" ranks, the pipeline groups cross vendors over the transport of the row) and as a single process
with the same global batch (dp 2 x 8 rows of 64 tokens) and the same 2-row microbatches. Checked at every step: the
losses agree within 1e-5 relative (float32 on CPU); after step 10 every weight tensor agrees within 1e-5
relative (norm of the difference over the norm), and the HF export (both stages gathered into one model)
holds exactly the final checkpoint's weights. Resume: the 4-rank run restarted from its step-5
checkpoint gives the same losses at steps 6-10 as the uninterrupted run, bit for bit. A checkpoint of
another model is refused with one sentence and exit status 2.

The tensor-parallel row is pp=2 x tp=2 (each stage one vendor, its two ranks splitting every block, the
embedding and the output head): the same global batch in the same 2-row microbatches, the same checks, and
its cross-vendor bytes per step equal those of the tp=1 row (each tp rank sends only its half of the
boundary activation).

The runs but the resumes go through ``python -m bimetal.train`` (the ``bimetal train`` command's own ``main``; with
``--simulate`` the job's launcher), one after another, forked from one interpreter that imported the trainer once
(tests/forked_runs.py); the resumes through the ``bimetal train`` command.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)  # the first test waits for every run but the resumes
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
EXE = str(Path(sys.executable).parent / "bimetal")
SEQ = 64  # half the demo's 128: the same model and corpus, half the CPU time
# Steps of the pipelined runs and their reference (what is checked holds at every step; 10 steps take the loss down by
# more than a nat), the checkpoint resumed, and the steps of the runs held against the reference's first steps
# (gradient accumulation, hierarchical dp).
STEPS, RESUME_AT, SHORT = 10, 5, 5
COMMON = [f"--training.steps={STEPS}", f"--checkpoint.every={RESUME_AT}", "--metrics.log_every=100",
          f"--data.seq_len={SEQ}"]
SINGLE = ["--parallel.pp=1", "--parallel.dp=1", "--parallel.layers_per_stage=[]", "--data.batch_size=16",
          "--parallel.microbatches=8"]
RTOL = 1e-5


def _transport_missing(name: str) -> str | None:
    """Why the transport cannot be tested in this build, or None if it can."""
    module = {"cpu-forward": "bimetal.comm.cpu_forward", "device-direct": "bimetal.comm.device_direct"}.get(name)
    if module is None:
        return None
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"{module} is not importable ({e})"
    if not hasattr(mod, "create_process_group"):
        return f"{module} has no create_process_group yet"
    if name == "device-direct":
        from conftest import engine_unavailable

        return engine_unavailable()
    return None


# (transport, schedule, layout) rows: cpu-forward with the demo's 1F1B, device-direct with GPipe, so each
# transport and each schedule runs the whole loop; then pp=2 x tp=2 on cpu-forward (one dp replica of 16 rows).
TP2 = ("--parallel.dp=1", "--parallel.tp=2", "--data.batch_size=16", "--parallel.microbatches=8")
SCENARIOS: list[tuple[str, str, tuple[str, ...]]] = [("cpu-forward", "1f1b", ()), ("device-direct", "gpipe", ()),
                                                     ("cpu-forward", "1f1b", TP2)]
IDS = ["cpu-forward-1f1b", "device-direct-gpipe", "cpu-forward-1f1b-tp2"]


def _train(run_dir: Path, *args: str, simulate: bool = False) -> subprocess.CompletedProcess:
    cmd = [EXE, "train", "--config", str(DEMO), *COMMON, f"--metrics.run_dir={run_dir}", *args]
    if simulate:
        cmd += ["--simulate", "nvidia:2,amd:2"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=run_dir.parent)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Model weights of a saved step, every stage merged under the whole model's parameter names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    weights = {}
    for stage_dir in sorted((run_dir / "checkpoints" / f"step-{step:06d}").glob("stage*")):
        out = run_dir / f"weights-{step}-{stage_dir.name}.pt"
        dcp_to_torch_save(str(stage_dir), str(out))
        saved = torch.load(out, weights_only=False)  # our own file; holds optimizer param groups too
        weights.update(saved["model"])  # keyed by the whole model's names
    assert weights, f"no stage checkpoint under {run_dir}"
    return weights


GRAD_ACCUM = [*SINGLE, "--data.batch_size=8", "--parallel.microbatches=4", "--optim.grad_accum=2",
              f"--training.steps={SHORT}"]
"""2 accumulation steps of 8 rows read the same 16 windows as one batch of 16, in the same 2-row microbatches."""


DP_HIER = ["--parallel.pp=1", "--parallel.dp=4", "--parallel.layers_per_stage=[]", "--parallel.microbatches=2",
           "--data.batch_size=4", "--parallel.allow_cross_vendor_dp=true", "--parallel.dp_transport=cpu-forward",
           f"--training.steps={SHORT}", "--simulate", "nvidia:2,amd:2"]
"""pp=1 x dp=4 over nvidia:2,amd:2: the dp group spans vendors (the hierarchical path)."""
_ALL: dict[str, tuple[Path, subprocess.CompletedProcess] | str] = {}
"""Every run but the resumes, by name (``single``, ``grad_accum``, ``dp_hier``, the ``IDS``), or why it could not be
tested here."""


def _all_runs(factory: pytest.TempPathFactory) -> None:
    """Every run of the file but the resumes, once, one after another, each ``python -m bimetal.train`` (the ``bimetal
    train`` command's own ``main``; with ``--simulate`` the job's launcher, forking its ranks) forked from one
    interpreter that imported the trainer once (tests/forked_runs.py); the resumes go through the command."""
    if _ALL:
        return
    from forked_runs import runs

    base = factory.mktemp("single")
    jobs: list[tuple[str, Path, list[str]]] = [("single", base / "run", [*SINGLE]),
                                               ("grad_accum", base / "grad_accum", [*GRAD_ACCUM])]
    if (why := _transport_missing("cpu-forward")) is not None:
        _ALL["dp_hier"] = f"transport cpu-forward not testable: {why}"
    else:
        jobs.append(("dp_hier", factory.mktemp("dp-hier") / "run", [*DP_HIER]))
    for row, (transport, schedule, layout) in enumerate(SCENARIOS):
        if (why := _transport_missing(transport)) is not None:
            _ALL[IDS[row]] = f"transport {transport} not testable: {why}"
            continue
        run = factory.mktemp(f"pp-{IDS[row]}") / "run"
        jobs.append((IDS[row], run, [f"--parallel.pp_transport={transport}", f"--parallel.schedule={schedule}",
                                     *layout, f"--checkpoint.export_hf={run.with_name('hf')}", "--simulate",
                                     "nvidia:2,amd:2"]))
    done = runs([(["-m", "bimetal.train", "--config", str(DEMO), *COMMON, f"--metrics.run_dir={run}", *args],
                  run.parent) for _, run, args in jobs], at_once=False, timeout=800)
    for (name, run, _), r in zip(jobs, done):
        assert r.returncode == 0, (name, r.stdout[-2000:] + r.stderr[-3000:])
        _ALL[name] = (run, r)


def _one(name: str, factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    _all_runs(factory)
    got = _ALL[name]
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _one("single", tmp_path_factory)[0]


def _pipelined_run(row: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, str, tuple[str, ...]]:
    """Scenario ``row``'s run: (transport, run folder, stdout, layout arguments with the schedule)."""
    transport, schedule, layout = SCENARIOS[row]
    run, r = _one(IDS[row], tmp_path_factory)
    return transport, run, r.stdout, (f"--parallel.schedule={schedule}", *layout)


@pytest.fixture(scope="module", params=range(len(SCENARIOS)), ids=IDS)
def pipelined(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, Path, str, tuple[str, ...]]:
    return _pipelined_run(request.param, tmp_path_factory)


def test_pipeline_matches_single_process(single: Path, pipelined: tuple[str, Path, str, tuple[str, ...]]) -> None:
    transport, run, stdout, _ = pipelined
    ref, got = _losses(single), _losses(run)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert abs(got[step] - ref[step]) <= RTOL * abs(ref[step]), (step, got[step], ref[step])
    assert got[STEPS] < got[1] - 1.0  # it learns: 10 steps take the byte-level loss down by more than a nat
    w_ref, w_got = _weights(single), _weights(run)
    assert sorted(w_got) == sorted(w_ref)
    for name, t in w_ref.items():
        assert float((w_got[name] - t).norm() / t.norm()) <= RTOL, name
    # The group table shows cross-vendor pipeline groups on the transport asked for; the summary counts at
    # least the pipeline payload - 2 groups x 4 microbatches x (activation + gradient) of 2xSEQx128 floats,
    # every step - and, from a bimetal transport's own counters, little more (loss broadcast, clip all-reduce).
    # With tp=2 the same payload: 2 groups (one per tp rank) x 8 microbatches x half of 2xSEQx128 floats.
    backend = {"cpu-forward": "bimetal_cpu_forward", "device-direct": "bimetal_device_direct"}[transport]
    assert any(line.startswith("pp.dp0") and "cross-vendor" in line and backend in line for line in
               stdout.splitlines()), stdout
    # The HF export gathers both stages into one model: exactly the weights of the final checkpoint.
    from bimetal.models import from_hf

    exported = dict(from_hf(run.with_name("hf")).named_parameters())
    assert sorted(exported) == sorted(w_got) and all(torch.equal(exported[n], w_got[n]) for n in w_got)
    summary = json.loads((run / "summary.json").read_text())
    payload = STEPS * 2 * 4 * 2 * (2 * SEQ * 128 * 4)
    assert payload <= summary["xvendor_bytes"] <= payload + STEPS * 4096 and summary["pp_transport"] == backend
    assert summary["xvendor_source"] == "pp: transport counters"


def test_state_bytes_per_rank_match_dry_run(pipelined: tuple[str, Path, str, tuple[str, ...]]) -> None:
    # pp=2 x dp=2 replicated, and pp=2 x tp=2 (vocabulary matrices split too): as the dry-run counts them, with
    # the schedule's receive buffers and the outputs it held at once (GPipe: every microbatch's on stage 0).
    from test_dryrun import assert_state_matches_dry_run

    _, run, _, layout = pipelined
    assert_state_matches_dry_run(run, DEMO, [*COMMON, *layout], 4)


def test_resume_after_step_5_is_identical(pipelined: tuple[str, Path, str, tuple[str, ...]], tmp_path: Path
                                          ) -> None:
    transport, run, _, layout = pipelined
    if transport == "device-direct":
        pytest.skip("resume is checked once, on the cpu-forward row; it does not depend on the transport")
    resumed = tmp_path / "run"
    (resumed / "checkpoints").mkdir(parents=True)
    ckpt = f"step-{RESUME_AT:06d}"
    shutil.copytree(run / "checkpoints" / ckpt, resumed / "checkpoints" / ckpt)
    r = _train(resumed, f"--parallel.pp_transport={transport}", *layout, "--resume", simulate=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    full, again = _losses(run), _losses(resumed)
    assert sorted(again) == list(range(RESUME_AT + 1, STEPS + 1))
    assert all(again[s] == full[s] for s in again), [(s, again[s], full[s]) for s in again]


def test_checkpoint_of_another_model_is_refused(single: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before anything trains, so by ``bimetal.cli.main`` in this process (the command's own exit status and
    sentence for a refused resume: test_nothing_lost.py)."""
    from bimetal.cli import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(single.parent)
    capsys.readouterr()
    code = main(["train", "--config", str(DEMO), *COMMON, f"--metrics.run_dir={single}", "--model.family=qwen2",
                 "--resume", *SINGLE])
    out, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    assert "checkpoint" in err and "family" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_gradient_accumulation_matches_one_big_batch(single: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _one("grad_accum", tmp_path_factory)[0]  # GRAD_ACCUM
    ref, got = _losses(single), _losses(run)
    assert sorted(got) == list(range(1, SHORT + 1))
    assert all(abs(got[s] - ref[s]) <= RTOL * abs(ref[s]) for s in got), [(s, got[s], ref[s]) for s in got]


def test_dp_across_vendors_hierarchical_matches_single_process(single: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    # pp=1 x dp=4 over nvidia:2,amd:2: the dp group spans vendors, so gradients take the hierarchical path
    # (reduce-scatter in each vendor island, cross-vendor all-reduce of the shard on cpu-forward, all-gather).
    run, r = _one("dp_hier", tmp_path_factory)  # DP_HIER
    assert "dp.stage0.cross0" in r.stdout and "hierarchical" in r.stdout
    ref, got = _losses(single), _losses(run)
    assert sorted(got) == list(range(1, SHORT + 1))
    assert all(abs(got[s] - ref[s]) <= RTOL * abs(ref[s]) for s in got), [(s, got[s], ref[s]) for s in got]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["xvendor_bytes"] > 0 and summary["dp_cross_vendor_transport"].endswith("(hierarchical)")


def test_tp_keeps_cross_vendor_bytes(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Same global batch, same microbatch rows: pp=2 x tp=2 moves exactly the bytes of pp=2 x tp=1 per step,
    # read from the cpu-forward transport's own counters (all ranks summed), not twice as many.
    _, tp1, _, _ = _pipelined_run(IDS.index("cpu-forward-1f1b"), tmp_path_factory)
    _, tp2, stdout, _ = _pipelined_run(IDS.index("cpu-forward-1f1b-tp2"), tmp_path_factory)
    per_step = {name: {r["step"]: r["xvendor_bytes"] for r in map(json.loads, (run / "metrics.jsonl")
                                                                   .read_text().splitlines())}
                for name, run in (("tp1", tp1), ("tp2", tp2))}
    assert per_step["tp2"] == per_step["tp1"], per_step
    assert min(per_step["tp2"].values()) >= 2 * 4 * 2 * (2 * SEQ * 128 * 4)  # at least the tp=1 payload
    # Each stage's two ranks form one native tp group, and each tp rank has its own cross-vendor pp group.
    table = stdout.splitlines()
    assert any(line.startswith("tp.stage1.dp0") and "homogeneous-amd" in line for line in table), stdout
    assert any(line.startswith("pp.dp0.tp1") and "cross-vendor" in line for line in table), stdout
