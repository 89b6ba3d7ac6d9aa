"""The simulated native back-end on one GPU (``BIMETAL_SIMULATE_DEVICE=cuda``) is cpu-forward's staged path.

Two ranks on threads call the sim-native creator torch would call, with CPU tensors and staging forced (the
same code a GPU run takes with device tensors): the group they get, what the group table says about it, and
that its collectives went through the staging pool with the results Gloo gives. Without the setting the
creator still returns plain Gloo. The trainer rows of ``scripts/gpu_check.sh --cpu`` run FSDP, HSDP, tensor
parallelism and the hierarchical all-reduce on this path end to end (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import run_threads

from bimetal.comm.cpu_forward import StagedNativeGroup
from bimetal.comm.registry import _create_sim_native
from bimetal.parallel.groups import GroupSpec, format_group_table
from bimetal.transports import SIM_NATIVE

pytestmark = pytest.mark.timeout(60)


def _create_pair(body: Any) -> None:
    store = dist.HashStore()

    def rank(r: int) -> None:
        opts = SimpleNamespace(store=dist.PrefixStore("g", store), group_rank=r, group_size=2,
                               global_ranks_in_group=[0, 1], timeout=timedelta(seconds=20))
        body(_create_sim_native(opts, None), r)

    run_threads(rank)


def test_native_groups_take_the_staged_path_when_vendors_share_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIMETAL_SIMULATE", "nvidia:2")
    monkeypatch.setenv("BIMETAL_SIMULATE_DEVICE", "cuda" if torch.cuda.is_available() else "cpu-staged")
    monkeypatch.setenv("BIMETAL_CF_FORCE_STAGING", "1")
    got: dict[int, tuple[str, str, int, torch.Tensor, torch.Tensor]] = {}

    def body(pg: Any, r: int) -> None:
        assert isinstance(pg, StagedNativeGroup)
        x = torch.arange(50_000, dtype=torch.float32) * (r + 1)
        pg.allreduce([x]).wait()
        shard = torch.empty(25_000)
        pg.reduce_scatter_single(shard, torch.arange(50_000, dtype=torch.float32)).wait()  # FSDP's gradient op
        got[r] = (pg.getBackendName(), pg.native_path, pg.comm_stats()["bytes_staged"], x, shard)
        pg.shutdown()

    _create_pair(body)
    for r in (0, 1):
        name, path, staged, x, shard = got[r]
        assert (name, path) == (SIM_NATIVE, "staged") and staged > 0
        assert torch.equal(x, torch.arange(50_000, dtype=torch.float32) * 3)
        assert torch.equal(shard, torch.arange(25_000, dtype=torch.float32) * 2 + 25_000 * 2 * r)
    table = format_group_table([GroupSpec("dp.stage0", "dp", (0, 1), ("nvidia", "nvidia"), "homogeneous-nvidia",
                                          SIM_NATIVE)])
    assert "bimetal_sim_native (staged: device tensors)" in table


def test_native_groups_stay_gloo_without_the_shared_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIMETAL_SIMULATE", "nvidia:2")
    monkeypatch.delenv("BIMETAL_SIMULATE_DEVICE", raising=False)
    kinds: list[type] = []
    _create_pair(lambda pg, r: kinds.append(type(pg)))
    assert kinds == [dist.ProcessGroupGloo] * 2
    table = format_group_table([GroupSpec("dp.stage0", "dp", (0, 1), ("nvidia", "nvidia"), "homogeneous-nvidia",
                                          SIM_NATIVE)])
    assert "staged" not in table
