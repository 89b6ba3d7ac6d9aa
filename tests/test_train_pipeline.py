"""Two-stage pipeline (uneven split) over Gloo matches a single-process run, for 1F1B and GPipe.

One spawned pair of ranks runs both schedules one after the other on its Gloo group, so the two
interpreter starts are paid once for the module; each schedule is still its own test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launcher import free_port, spawn
from torch import nn

from bimetal.train.pipeline import PipelineRunner, stage_layer_ids

pytestmark = pytest.mark.timeout(200)  # both schedules run in the first test's fixture; a loaded machine is slow
DIM, MB, N_MB, LAYERS = 8, 2, 4, 4


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(LAYERS))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(MB * N_MB, DIM, generator=g), torch.randn(MB * N_MB, DIM, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


SCHEDULES = ("1f1b", "gpipe")


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for schedule in SCHEDULES:
            _stage_step(rank, schedule, out)
    finally:
        dist.destroy_process_group()
    # the stage and its schedule hold the group in a reference cycle: tests/launcher.py collects it before exit


def _stage_step(rank: int, schedule: str, out: str) -> None:
    split = [3, 1]
    layers = _layers()
    mod = nn.Sequential(*[layers[i] for i in stage_layer_ids(split, rank)])
    ex = torch.zeros(MB, DIM)
    runner = PipelineRunner(mod, rank, 2, dist.group.WORLD, N_MB, schedule, _mse, torch.device("cpu"), ex, ex)
    x, y = _data()
    loss = runner.step(x if rank == 0 else None, y if rank == 1 else None)
    grads = {f"{i}": _grad(p).clone() for i, p in enumerate(mod.parameters())}
    torch.save({"loss": loss, "grads": grads}, Path(out) / f"{schedule}-r{rank}.pt")


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "a parameter got no gradient"
    return p.grad


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where both ranks saved, per schedule, their loss and their stage's gradients."""
    out = tmp_path_factory.mktemp("pipeline")
    spawn(_rank, (free_port(), str(out)))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_matches_single_process(schedule: str, stages: Path) -> None:
    layers = _layers()
    x, y = _data()
    ref = torch.stack([_mse(nn.Sequential(*layers)(xc), yc) for xc, yc in zip(x.chunk(N_MB), y.chunk(N_MB))])
    ref.mean().backward()
    r0, r1 = torch.load(stages / f"{schedule}-r0.pt"), torch.load(stages / f"{schedule}-r1.pt")
    assert torch.allclose(r0["loss"], ref.mean().detach(), rtol=1e-5) and torch.equal(r0["loss"], r1["loss"])
    ref_grads = [_grad(p) for i in range(3) for p in layers[i].parameters()]
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(r0["grads"].values(), ref_grads))
    ref_last = [_grad(p) for p in layers[3].parameters()]
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(r1["grads"].values(), ref_last))
