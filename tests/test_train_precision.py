"""Pipeline boundaries in the compute dtype: bf16 training sends bf16 activations and gradients across vendors.

One scenario, two runs of the command a user types (``bimetal train --simulate nvidia:1,amd:1``: stage 0 on the
"nvidia" rank, stage 1 on the "amd" rank, the pipeline group crossing vendors on cpu-forward), by its own ``main``
in ``python -m bimetal.train`` forked from one preloaded interpreter (tests/forked_runs.py): the debug LLaMA-3 of
``configs/demo.toml`` trained 10 steps of 32 tokens in bf16 autocast on the CPU, once with the default
boundary (``parallel.pp_boundary_dtype = "compute"``: bf16) and once with ``float32``. Checked: the losses agree at
every step within bf16's relative rounding (2**-8); the cross-vendor bytes of every step (metrics.jsonl, from the
transport's own counters) are the payload of 4 microbatches x (activation + gradient) in each dtype, so the bf16
run moves half; what each rank holds after its first step (parameter state, the schedule's receive buffers and
the stage outputs it held at once, read from the tensors) equals ``bimetal train --dry-run`` of the same config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dryrun import assert_state_matches_dry_run
from test_train_parity import DEMO

from bimetal.config import load_config
from bimetal.errors import UserError
from bimetal.models import FLAVOURS
from bimetal.train.pipeline import StageModule

pytestmark = pytest.mark.timeout(300)
SEQ, STEPS, MB, DIM = 32, 10, 4, 128  # the demo's 8 rows in 4 microbatches of 2; the debug model's width
ARGS = ["--parallel.dp=1", f"--training.steps={STEPS}", f"--data.seq_len={SEQ}", "--training.dtype=bfloat16",
        "--checkpoint.every=0", "--metrics.log_every=100", "--parallel.pp_transport=cpu-forward"]


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both jobs at once, each ``python -m bimetal.train`` (the ``bimetal train`` command's own ``main``, the job's
    launcher under ``--simulate``) forked from one interpreter that imported the trainer once (tests/forked_runs.py):
    each job is mostly start-up, which they share."""
    from forked_runs import runs as forked

    out = {boundary: tmp_path_factory.mktemp(f"boundary-{boundary}") / "run" for boundary in ("compute", "float32")}
    done = forked([(["-m", "bimetal.train", "--config", str(DEMO), *ARGS, f"--parallel.pp_boundary_dtype={boundary}",
                     f"--metrics.run_dir={run}", "--simulate", "nvidia:1,amd:1"], run.parent)
                   for boundary, run in out.items()], timeout=240)
    for boundary, r in zip(out, done):
        assert r.returncode == 0, f"{boundary}: " + r.stdout[-2000:] + r.stderr[-3000:]
    return out


def test_bf16_boundary_matches_float32_and_halves_the_bytes(runs: dict[str, Path]) -> None:
    bf16, f32 = _rows(runs["compute"]), _rows(runs["float32"])
    assert sorted(bf16) == sorted(f32) == list(range(1, STEPS + 1))
    for s in f32:
        assert abs(bf16[s]["loss"] - f32[s]["loss"]) <= 2**-8 * abs(f32[s]["loss"]), (s, bf16[s], f32[s])
    assert bf16[STEPS]["loss"] < bf16[1]["loss"] - 1.0  # it learns
    # Per step: 4 microbatches x (activation forward + gradient back) of [2, SEQ, DIM]; the transport's
    # counters also see the loss broadcast and the clip all-reduce (a few bytes, equal in both runs).
    payload = {run: MB * 2 * (2 * SEQ * DIM) * size for run, size in (("compute", 2), ("float32", 4))}
    for s in f32:
        extra = f32[s]["xvendor_bytes"] - payload["float32"]
        assert 0 <= extra <= 64 and bf16[s]["xvendor_bytes"] - payload["compute"] == extra, (s, bf16[s], f32[s])
    totals = {run: json.loads((runs[run] / "summary.json").read_text())["xvendor_bytes"] for run in runs}
    assert totals["float32"] - totals["compute"] == STEPS * payload["compute"]


@pytest.mark.parametrize("boundary", ["compute", "float32"])
def test_held_memory_matches_dry_run(runs: dict[str, Path], boundary: str) -> None:
    # bf16 receive buffers and held outputs (the last stage's logits) with "compute", float32 ones with "float32".
    assert_state_matches_dry_run(runs[boundary], DEMO, [*ARGS, f"--parallel.pp_boundary_dtype={boundary}"], 2,
                                 dtype="bfloat16")
    held = json.loads((runs[boundary] / "memory-rank1.json").read_text())
    vocab = FLAVOURS["llama3"]["debug"].vocab_size  # the logits' last dimension
    size = 2 if boundary == "compute" else 4
    assert held["held_outputs"] == 2 * SEQ * vocab * size  # one microbatch's logits: 1F1B's last stage holds one


def test_stage_module_widens_the_input_and_casts_the_output() -> None:
    seen: list[torch.dtype] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.dtype)
            return x * 2

    stage = StageModule(Probe(), torch.bfloat16, "cpu", torch.bfloat16)
    x = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)
    out = stage(x)
    out.sum().backward()
    assert seen == [torch.float32] and out.dtype == torch.bfloat16 and x.grad is not None
    assert x.grad.dtype == torch.bfloat16  # the gradient sent back is in the boundary dtype too
    assert StageModule(Probe(), torch.bfloat16, "cpu", torch.float32)(x).dtype == torch.float32


def test_unknown_boundary_dtype_is_refused() -> None:
    with pytest.raises(UserError, match="parallel.pp_boundary_dtype='bf16' is unknown"):
        load_config(DEMO, ["--parallel.pp_boundary_dtype=bf16"])
