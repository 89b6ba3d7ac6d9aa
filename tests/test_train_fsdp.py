"""Sharded data parallel (FSDP2/HSDP) and activation checkpointing train exactly like one process.

Scenarios, one run each, all on the parity harness of ``test_train_parity`` (debug LLaMA-3 of
``configs/demo.toml``, split [3, 1], float32 on CPU, fixed seed) at half its steps and sequence length (10 steps
of 32 tokens: a run's cost is mostly its start), compared at every step with one single-process run of the same
global batch within 1e-5 relative:

* ``fsdp-cpu-forward``: pp=2 x dp=2 with dp_shard=2 (each stage fully sharded inside its vendor), 1F1B over
  cpu-forward; rank 3 is SIGKILLed after step 6 and torchrun restarts the job, which resumes from the
  sharded step-5 checkpoint; it also exports the HF model;
* ``fsdp-device-direct``: the same layout and schedule over device-direct, uninterrupted: the killed run
  equals it bit for bit at every step, before and after the kill (resume after a kill is exact);
* ``ac-full``: pp=2 x dp=2 replicated with activation checkpointing on every block, and two gradient
  accumulation steps per optimizer step (a pipeline once scaled the first one's gradients twice); its
  per-rank optimizer state (read by the trainer from the state tensors) is the reference the sharded run
  must halve;
* ``hsdp-across-vendors``: pp=1 x dp=4 with dp_shard=2 on nvidia:2,amd:2, 5 steps: shard groups are the vendor
  islands on the native back-end, the replicate all-reduce crosses vendors on cpu-forward.

* ``hsdp-8-ranks``: pp=2 x (replicate 2 x shard 2) on nvidia:4,amd:4, 5 steps (8 ranks cost about as much
  as 4 here: the stage compute is split over twice the ranks);
* ``fsdp-tp-8-ranks``: pp=2 x (shard 2 x tp 2) on nvidia:4,amd:4, 5 steps: FSDP over the dp dimension of
  the mesh whose tp dimension tensor parallelism splits over (the ready H100 + MI300X configs' shape), with
  its HF export.

Every run goes through ``python -m bimetal.train`` (the ``bimetal train`` command's own ``main``; with ``--simulate``
the job's launcher, forking its ranks), one after another, forked from one interpreter that imported the trainer
once (tests/forked_runs.py): the file pays that import once, not once per run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_dryrun import assert_state_matches_dry_run
from test_train_parity import DEMO, RTOL, SINGLE, _transport_missing

from bimetal.errors import UserError
from bimetal.train import checkpoint
from bimetal.train.shards import assemble

pytestmark = pytest.mark.timeout(900)  # the first test waits for every run of the file (JOBS)
STEPS, SHORT = 10, 5
"""Steps of the 4-rank pipelined runs (checkpoints of steps 5 and 10) and of the others (HSDP, 8 ranks)."""
COMMON = [f"--training.steps={STEPS}", f"--checkpoint.every={SHORT}", "--metrics.log_every=100", "--data.seq_len=32"]
"""``test_train_parity``'s harness at half its steps and sequence length: a run's cost is mostly its start."""
FSDP = ["--parallel.dp_shard=2", "--parallel.schedule=1f1b"]
AC_FULL = ["--activation_checkpoint.mode=full", "--optim.grad_accum=2", "--data.batch_size=4",
           "--parallel.microbatches=2"]
HSDP = ["--parallel.pp=1", "--parallel.dp=4", "--parallel.dp_shard=2", "--parallel.layers_per_stage=[]",
        "--parallel.microbatches=2", "--data.batch_size=4", "--parallel.allow_cross_vendor_dp=true",
        "--parallel.dp_transport=cpu-forward", f"--training.steps={SHORT}"]


HSDP_PP2 = ["--parallel.dp=4", "--parallel.dp_shard=2", "--parallel.microbatches=2", "--data.batch_size=4",
            f"--training.steps={SHORT}", "--checkpoint.every=0"]
FSDP_TP = ["--parallel.tp=2", "--parallel.dp_shard=2", f"--training.steps={SHORT}"]
JOBS: dict[str, tuple[list[str], str | None, dict[str, str], str | None]] = {
    # name: (arguments, --simulate, environment, the transport it needs)
    "single": ([*SINGLE], None, {}, None),
    "fsdp-cf": ([*FSDP, "--parallel.pp_transport=cpu-forward", "--max-restarts=1"], "nvidia:2,amd:2",
                {"BIMETAL_FAULT_KILL": "3:6"}, "cpu-forward"),
    "fsdp-dd": ([*FSDP, "--parallel.pp_transport=device-direct"], "nvidia:2,amd:2", {}, "device-direct"),
    "ac-full": ([*AC_FULL, "--parallel.pp_transport=cpu-forward"], "nvidia:2,amd:2", {}, None),
    "hsdp": ([*HSDP], "nvidia:2,amd:2", {}, "cpu-forward"),
    "hsdp-pp2": ([*HSDP_PP2], "nvidia:4,amd:4", {}, None),
    "fsdp-tp": ([*FSDP_TP], "nvidia:4,amd:4", {}, None),
}
"""Every run of this file; the ones exporting an HF model write it beside their run folder (``hf``)."""
EXPORTS = ("fsdp-cf", "fsdp-tp")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess] | str]:
    """Every run of ``JOBS``, one after another, each ``python -m bimetal.train ARGS`` (the ``bimetal train``
    command's own ``main``; with ``--simulate`` the launcher of the job, forking its ranks) forked from one
    interpreter that imported the trainer once (tests/forked_runs.py): ``{name: (run folder, result)}``, or why the
    run could not be tested."""
    from forked_runs import runs

    out: dict[str, tuple[Path, subprocess.CompletedProcess] | str] = {}
    todo: list[tuple[str, Path]] = []
    base = {k: v for k, v in os.environ.items() if not k.startswith("BIMETAL_FAULT")}
    for name, (_, _, _, transport) in JOBS.items():
        if transport is not None and (why := _transport_missing(transport)) is not None:
            out[name] = f"{transport} not testable: {why}"
        else:
            todo.append((name, tmp_path_factory.mktemp(name) / "run"))
    argvs = []
    for name, run in todo:
        args, simulate, _, _ = JOBS[name]
        export = [f"--checkpoint.export_hf={run.with_name('hf')}"] if name in EXPORTS else []
        argvs.append((["-m", "bimetal.train", "--config", str(DEMO), *COMMON, f"--metrics.run_dir={run}", *args,
                       *export, *(["--simulate", simulate] if simulate else [])], run.parent))
    done = runs(argvs, envs=[{**base, **JOBS[name][2]} for name, _ in todo], at_once=False, timeout=800)
    for (name, run), r in zip(todo, done):
        assert r.returncode == 0, (name, r.stdout[-2000:] + r.stderr[-3000:])
        out[name] = (run, r)
    return out


def _job(jobs: dict[str, tuple[Path, subprocess.CompletedProcess] | str], name: str
         ) -> tuple[Path, subprocess.CompletedProcess]:
    got = jobs[name]
    if isinstance(got, str):
        pytest.skip(got)
    return got


def _rows(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order logged (a restarted run's replayed steps replace the first attempt's)."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _assert_parity(ref: Path, run: Path, steps: int = STEPS) -> None:
    want = dict(_rows(ref))
    got = _rows(run)
    assert sorted(dict(got)) == list(range(1, steps + 1))
    for step, loss in got:
        assert abs(loss - want[step]) <= RTOL * abs(want[step]), (step, loss, want[step])


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else key).items()}
    return {prefix: tree}


def _stage_weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Every stage's model weights at ``step``, reassembled from the shard parts with their JSON layout."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run / "checkpoints" / f"step-{step:06d}"
    extras = [json.loads(p.read_text()) for p in sorted(folder.glob("extra-rank*.json"))]
    layouts = {e["shards"]["part"]: e["shards"]["tensors"] for e in extras}
    weights: dict[str, torch.Tensor] = {}
    for stage in sorted({p.name.split("-")[0] for p in folder.glob("stage*-shard*")}):
        parts, lays = [], []
        for part_dir in sorted(folder.glob(f"{stage}-shard*")):
            out = run / f"{part_dir.name}.pt"
            dcp_to_torch_save(str(part_dir), str(out))
            parts.append(_flat(torch.load(out, weights_only=False)))  # our own file
            lays.append(layouts[part_dir.name])
        whole = assemble(parts, lays)  # type: ignore[arg-type]
        prefix = "model."  # keyed by the whole model's names
        weights.update({k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)})
    assert weights, f"no sharded stage under {folder}"
    return weights


def _param_tensors(stage: int) -> int:
    """Parameter tensors of a stage of the demo split [3, 1] (one AdamW step counter each)."""
    from bimetal.models import build_model, prune_to_stage

    model = build_model("llama3", "debug", device="meta")
    return len(list(prune_to_stage(model, [[0, 1, 2], [3]][stage], stage == 0, stage == 1).parameters()))


@pytest.fixture(scope="module")
def single(jobs) -> Path:
    return _job(jobs, "single")[0]


@pytest.fixture(scope="module")
def fsdp_killed(jobs) -> tuple[Path, str]:
    run, r = _job(jobs, "fsdp-cf")
    return run, r.stdout + r.stderr


@pytest.fixture(scope="module")
def fsdp_dd(jobs) -> Path:
    return _job(jobs, "fsdp-dd")[0]


@pytest.fixture(scope="module")
def ac_full(jobs) -> Path:
    # Two accumulation steps of 4 rows per replica read the same windows as the single run's batch of 16.
    return _job(jobs, "ac-full")[0]


def test_fsdp_cpu_forward_matches_single_process_and_exports_gathered_shards(
        single: Path, fsdp_killed: tuple[Path, str]) -> None:
    run, out = fsdp_killed
    assert "dp.stage0" in out and "bimetal FSDP mesh groups" in out
    _assert_parity(single, run)
    # Each shard owner wrote its own part; reassembled, the parts are the single-process weights.
    from test_train_parity import _weights

    w_ref, w_got = _weights(single, STEPS), _stage_weights(run)
    assert sorted(w_got) == sorted(w_ref)
    for name, t in w_ref.items():
        assert float((w_got[name] - t).norm() / t.norm()) <= RTOL, name
    # The HF export all-gathered the shards of both stages: exactly the final checkpoint's weights.
    from bimetal.models import from_hf

    exported = dict(from_hf(run.with_name("hf")).named_parameters())
    assert sorted(exported) == sorted(w_got) and all(torch.equal(exported[n], w_got[n]) for n in w_got)


def test_fsdp_resume_after_kill_is_bit_identical(fsdp_killed: tuple[Path, str], fsdp_dd: Path,
                                                 single: Path) -> None:
    run, out = fsdp_killed
    assert "rank 3 kills itself after step 6" in out and "step-000005 at step 5" in out, out[-3000:]
    _assert_parity(single, fsdp_dd)
    # Same layout and schedule, another transport, no kill: every logged step (1-5 from the first attempt,
    # 6-10 replayed after the restart from the sharded step-5 checkpoint) is the same float.
    uninterrupted = dict(_rows(fsdp_dd))
    rows = _rows(run)
    assert [s for s, _ in rows] == list(range(1, STEPS + 1))
    assert all(loss == uninterrupted[s] for s, loss in rows), [(s, loss, uninterrupted[s]) for s, loss in rows]


def test_sharding_halves_optimizer_state_per_rank(fsdp_killed: tuple[Path, str], ac_full: Path) -> None:
    run, _ = fsdp_killed
    for rank in range(4):
        sharded = json.loads((run / f"memory-rank{rank}.json").read_text())
        replicated = json.loads((ac_full / f"memory-rank{rank}.json").read_text())
        assert replicated["optim"] > 0 and replicated["params"] > 0
        # AdamW's two moments halve; each parameter's step counter (one float32) stays whole on both ranks.
        steps_bytes = 4 * _param_tensors(rank // 2)
        assert sharded["optim"] - steps_bytes == (replicated["optim"] - steps_bytes) // 2, (sharded, replicated)
        assert sharded["params"] == replicated["params"] // 2 and sharded["grads"] == replicated["grads"] // 2
    # The dry-run of the same config says what each rank holds, sharded and replicated.
    assert_state_matches_dry_run(run, DEMO, [*COMMON, *FSDP], 4)
    assert_state_matches_dry_run(ac_full, DEMO, [*COMMON, *AC_FULL], 4)


def test_full_activation_checkpointing_matches_single_process(single: Path, ac_full: Path) -> None:
    _assert_parity(single, ac_full)


def test_hsdp_replicates_across_vendors_and_shards_inside(single: Path, jobs) -> None:
    run, r = _job(jobs, "hsdp")
    out = r.stdout
    table = out.split("bimetal FSDP mesh groups")[1]
    # Shard groups are the vendor islands (native); replicate groups join the islands on cpu-forward.
    assert any(line.startswith("dp.stage0.island-nvidia") and "bimetal_sim_native" in line for line in
               table.splitlines()), table
    assert any(line.startswith("dp.stage0.cross0") and "cross-vendor" in line and "bimetal_cpu_forward" in line
               for line in table.splitlines()), table
    _assert_parity(single, run, steps=SHORT)


def test_resume_onto_another_shard_degree_is_refused(tmp_path: Path) -> None:
    meta = {"family": "llama3", "flavour": "debug", "layers_per_stage": [3, 1], "dp": 2, "dp_shard": 2}
    checkpoint.save(tmp_path, 10, {"x": {"w": torch.zeros(2)}}, {}, meta)
    path = checkpoint.latest(tmp_path)
    assert path is not None
    checkpoint.check_meta(path, meta)
    with pytest.raises(UserError, match="dp_shard=2"):
        checkpoint.check_meta(path, {**meta, "dp_shard": 1})


def test_hsdp_pp2_replicate2_shard2_on_8_ranks(single: Path, fsdp_killed: tuple[Path, str], jobs) -> None:
    run, r = _job(jobs, "hsdp-pp2")  # HSDP_PP2
    out = r.stdout
    table = out.split("bimetal FSDP mesh groups")[1]
    for name, ranks in (("dp.stage0.shard1", "2,3"), ("dp.stage0.replicate1", "1,3"), ("dp.stage1.replicate0", "4,6")):
        assert any(line.split()[:2] == [name, ranks] and "bimetal_sim_native" in line
                   for line in table.splitlines()), table
    _assert_parity(single, run, steps=SHORT)
    # Shards of 2 as in the 4-rank sharded run: the same bytes per rank, whatever the replica count (but the
    # schedule's receive buffers, one per microbatch: 2 here, 4 there).
    for rank in (0, 4):
        got, ref = (json.loads((r / f"memory-rank{n}.json").read_text())
                    for r, n in ((run, rank), (fsdp_killed[0], rank // 2)))
        assert got.pop("recv_buffers") * 2 == ref.pop("recv_buffers") and got == ref, (got, ref)


def test_fsdp_composes_with_tensor_parallel_on_8_ranks(single: Path, jobs) -> None:
    run, r = _job(jobs, "fsdp-tp")
    layout = FSDP_TP
    out = r.stdout
    table = out.split("bimetal FSDP mesh groups")[1]
    assert any(line.split()[:2] == ["dp.stage1.tp1", "5,7"] for line in table.splitlines()), table
    _assert_parity(single, run, steps=SHORT)
    from test_train_parity import _weights

    from bimetal.models import from_hf

    w_ref = _weights(single, step=SHORT)
    exported = {n: p.detach() for n, p in from_hf(run.with_name("hf")).named_parameters()}
    assert sorted(exported) == sorted(w_ref)
    for name, t in w_ref.items():
        assert float((exported[name] - t).norm() / t.norm()) <= RTOL, name
    # tp splits every matrix (the vocabulary ones too), FSDP shards the tp slices: as the dry-run counts them.
    assert_state_matches_dry_run(run, DEMO, [*COMMON, *layout], 8)
