"""Activation checkpointing on a real stage, and the FSDP mesh's groups planned on in-memory cluster views."""

from __future__ import annotations

import pytest
import torch
from test_layout import _view

from bimetal.comm.registry import CPU_FORWARD, SIM_NATIVE
from bimetal.config import ActivationCheckpointConfig
from bimetal.errors import UserError
from bimetal.models import build_stage
from bimetal.parallel.layout import ParallelDims, plan_layout
from bimetal.parallel.mesh import dp_mesh_ranks, plan_dp_mesh_groups
from bimetal.train.parallelize import apply_activation_checkpointing, param_name

pytestmark = pytest.mark.timeout(60)


def _stage() -> torch.nn.Module:
    return build_stage("llama3", "debug", [0, 1, 2, 3], True, True, seed=0)


def _grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {param_name(n): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("mode", "every", "wrapped"), [("full", 2, ["0", "1", "2", "3"]),
                                                        ("selective", 2, ["1", "3"]),
                                                        ("selective", 3, ["2"]),
                                                        ("none", 2, [])])
def test_checkpointed_blocks_recompute_and_give_the_same_gradients(mode: str, every: int, wrapped: list[str]) -> None:
    x = torch.randint(0, 256, (2, 16))
    ref_loss, ref_grads = _grads(_stage(), x)
    model = _stage()
    got = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode, every=every))
    assert got == wrapped
    calls: dict[str, int] = {}
    for key, block in model.layers.items():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        # a pre-hook: the recompute stops early once it has every saved tensor, before a forward hook would run
        inner.register_forward_pre_hook(lambda *_, k=key: calls.__setitem__(k, calls.get(k, 0) + 1))
    loss, grads = _grads(model, x)
    # A checkpointed block runs its forward again in the backward; the others once.
    assert calls == {k: 2 if k in wrapped else 1 for k in model.layers}
    assert torch.equal(loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads) and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_hsdp_groups_inside_each_stage() -> None:
    view = _view(("nvidia", 4), ("amd", 4))
    layout = plan_layout(view, ParallelDims(pp=2, dp=4))
    assert dp_mesh_ranks(layout, 1, 0, 2) == [[4, 5], [6, 7]]
    specs = {g.name: g for g in plan_dp_mesh_groups(view, layout, 2)}
    assert specs["dp.stage0.shard1"].ranks == (2, 3) and specs["dp.stage0.replicate1"].ranks == (1, 3)
    assert specs["dp.stage1.shard0"].ranks == (4, 5) and specs["dp.stage1.replicate0"].ranks == (4, 6)
    assert all(g.backend == SIM_NATIVE for g in specs.values()) and len(specs) == 8
    # Fully sharded: one shard group per stage (the dp group), no replicate group.
    assert sorted(plan_dp_mesh_groups(view, layout, 4)[i].ranks for i in range(2)) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_replicate_crosses_vendors_on_the_transport_and_shard_never_does() -> None:
    view = _view(("nvidia", 2), ("amd", 2))
    layout = plan_layout(view, ParallelDims(pp=1, dp=4, allow_cross_vendor_dp=True))
    specs = {g.name: g for g in plan_dp_mesh_groups(view, layout, 2, {"dp": "cpu-forward"})}
    assert specs["dp.stage0.shard0"].ranks == (0, 1) and specs["dp.stage0.shard0"].backend == SIM_NATIVE
    assert specs["dp.stage0.replicate0"].ranks == (0, 2) and specs["dp.stage0.replicate0"].backend == CPU_FORWARD
    with pytest.raises(UserError, match="shard group stays inside one vendor island"):
        plan_dp_mesh_groups(view, layout, 4)
