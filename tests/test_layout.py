"""Layout and group planning on cluster views built in memory (no process group needed)."""

from __future__ import annotations

import pytest

from bimetal.comm.registry import CPU_FORWARD, DEVICE_DIRECT, SIM_NATIVE
from bimetal.errors import UserError
from bimetal.parallel.groups import format_group_table, plan_groups
from bimetal.parallel.layout import LayoutError, ParallelDims, plan_layout
from bimetal.topology.records import ClusterView, NicInfo, RankRecord


def _view(*nodes: tuple[str, int]) -> ClusterView:
    """One node per (vendor, ranks) entry, ranks numbered in order."""
    records, rank = [], 0
    for n, (vendor, count) in enumerate(nodes):
        for local in range(count):
            device = "NVIDIA H200" if vendor == "nvidia" else "AMD Instinct MI325X"
            records.append(RankRecord(rank, local, f"node{n}", vendor, device, 2**30,
                                      (NicInfo(f"eth{local}", f"10.0.{local}.{n + 1}"),)))
            rank += 1
    return ClusterView(records)


def test_pp_across_vendors_dp_inside() -> None:
    view = _view(("nvidia", 2), ("amd", 2))
    layout = plan_layout(view, ParallelDims(pp=2, dp=2))
    assert layout.mesh == (((0,), (1,)), ((2,), (3,)))
    assert layout.stage_vendors == ("nvidia", "amd")
    assert layout.pp_groups() == [(0, 2), (1, 3)]
    assert layout.dp_groups() == [(0, 1), (2, 3)]
    assert not layout.dp_spans_vendors
    assert layout.coords(3) == (1, 1, 0)


def test_vendor_order_follows_first_appearance_and_hosts() -> None:
    # AMD node listed first: stage 0 is AMD; two NVIDIA nodes fill stages 1 and 2 one node each.
    view = _view(("amd", 2), ("nvidia", 2), ("nvidia", 2))
    layout = plan_layout(view, ParallelDims(pp=3, dp=2))
    assert layout.stage_vendors == ("amd", "nvidia", "nvidia")
    assert layout.mesh[2] == ((4,), (5,))


def test_tp_stays_inside_a_node() -> None:
    view = _view(("nvidia", 4), ("amd", 4))
    layout = plan_layout(view, ParallelDims(pp=2, dp=2, tp=2))
    assert layout.tp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for shard in layout.tp_groups():
        assert len({view.host_of(r) for r in shard}) == 1


def test_world_size_mismatch_names_the_numbers() -> None:
    with pytest.raises(LayoutError, match=r"pp=2 x dp=3 x tp=1 = 6 does not match the world size 4"):
        plan_layout(_view(("nvidia", 2), ("amd", 2)), ParallelDims(pp=2, dp=3))


def test_tp_that_would_cross_a_node_is_refused() -> None:
    # 3 ranks per node: tp=2 would put one shard on two nodes.
    view = _view(("nvidia", 3), ("nvidia", 3))
    with pytest.raises(LayoutError, match=r"tp=2 does not divide the 3 nvidia ranks on host 'node0'"):
        plan_layout(view, ParallelDims(pp=3, dp=1, tp=2))


def test_mixed_stage_needs_permission_and_is_refused_in_strict_mode() -> None:
    view = _view(("nvidia", 3), ("amd", 1))
    with pytest.raises(LayoutError, match=r"nvidia:3, amd:1 \(stage size 2\).*allow_cross_vendor_dp"):
        plan_layout(view, ParallelDims(pp=2, dp=2))
    with pytest.raises(LayoutError, match=r"strict mode: 2 stages of dp\*tp = 2 ranks"):
        plan_layout(view, ParallelDims(pp=2, dp=2, strict=True))
    layout = plan_layout(view, ParallelDims(pp=2, dp=2, allow_cross_vendor_dp=True))
    assert layout.stage_vendors == ("nvidia", "mixed") and layout.dp_spans_vendors


def test_bad_degrees_are_refused() -> None:
    with pytest.raises(LayoutError, match="pp must be a positive integer, got 0"):
        ParallelDims(pp=0)
    with pytest.raises(LayoutError, match="contradict"):
        ParallelDims(strict=True, allow_cross_vendor_dp=True)


def test_groups_get_native_or_transport_backends() -> None:
    view = _view(("nvidia", 2), ("amd", 2))
    layout = plan_layout(view, ParallelDims(pp=2, dp=2))
    specs = {g.name: g for g in plan_groups(view, layout, {"pp": "device-direct"}, simulated=True)}
    assert set(specs) == {"pp.dp0", "pp.dp1", "dp.stage0", "dp.stage1"}
    assert specs["pp.dp0"].kind == "cross-vendor" and specs["pp.dp0"].backend == DEVICE_DIRECT
    assert specs["dp.stage0"].kind == "homogeneous-nvidia" and specs["dp.stage0"].backend == SIM_NATIVE
    assert specs["dp.stage1"].kind == "homogeneous-amd"
    real = {g.name: g for g in plan_groups(view, layout, None, simulated=False)}
    assert real["dp.stage1"].backend == "nccl" and real["pp.dp1"].backend == CPU_FORWARD
    table = format_group_table(list(specs.values()))
    assert "pp.dp0" in table and "cross-vendor" in table and DEVICE_DIRECT in table


def test_cross_vendor_dp_gets_hierarchical_groups() -> None:
    # 2 nvidia + 2 amd, pp=1 dp=4: one dp group spanning both islands.
    view = _view(("nvidia", 2), ("amd", 2))
    layout = plan_layout(view, ParallelDims(pp=1, dp=4, allow_cross_vendor_dp=True))
    specs = {g.name: g for g in plan_groups(view, layout, None, simulated=True)}
    assert specs["dp.stage0"].kind == "cross-vendor" and specs["dp.stage0"].backend == CPU_FORWARD
    assert specs["dp.stage0.island-nvidia"].ranks == (0, 1)
    assert specs["dp.stage0.island-amd"].backend == SIM_NATIVE
    assert specs["dp.stage0.cross0"].ranks == (0, 2) and specs["dp.stage0.cross1"].ranks == (1, 3)


def test_unequal_islands_are_refused_for_hierarchical_dp() -> None:
    view = _view(("nvidia", 3), ("amd", 1))
    layout = plan_layout(view, ParallelDims(pp=1, dp=4, allow_cross_vendor_dp=True))
    with pytest.raises(UserError, match=r"unequal size \(nvidia:3, amd:1\)"):
        plan_groups(view, layout)


def test_unknown_transport_is_refused() -> None:
    view = _view(("nvidia", 1), ("amd", 1))
    layout = plan_layout(view, ParallelDims(pp=2))
    with pytest.raises(UserError, match="unknown transport 'rdma' for axis pp"):
        plan_groups(view, layout, {"pp": "rdma"})
