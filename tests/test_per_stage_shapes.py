"""Per-stage shapes (each vendor island its own tp, dp and dp_shard): layout, boundary, refusals, dry-run.

Layout and boundary on cluster views built in memory; refusals through ``bimetal train`` in this process (each
fails while checking its input: one sentence naming the stage and the key, exit status 2, before any rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bimetal.cli import main
from bimetal.parallel.boundary import boundary_pairs, boundary_pieces
from bimetal.parallel.groups import PAIR, plan_groups
from bimetal.parallel.layout import LayoutError, ParallelDims, plan_layout
from bimetal.topology.records import ClusterView, RankRecord

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def _view(*nodes: tuple[str, int]) -> ClusterView:
    records, rank = [], 0
    for n, (vendor, count) in enumerate(nodes):
        for local in range(count):
            records.append(RankRecord(rank, local, f"node{n}", vendor, "cpu", 0))
            rank += 1
    return ClusterView(records)


def test_a_ragged_layout_gives_each_stage_its_shape_and_joins_them_by_pairs() -> None:
    view = _view(("nvidia", 4), ("amd", 2))
    layout = plan_layout(view, ParallelDims(pp=2, tp_per_stage=(2, 1), dp_per_stage=(2, 2)))
    assert layout.mesh == (((0, 1), (2, 3)), ((4,), (5,)))
    assert layout.stage_vendors == ("nvidia", "amd")
    assert layout.shape_lines() == ["stage 0: nvidia dp=2 x tp=2 ranks [0, 1, 2, 3]",
                                    "stage 1: amd dp=2 x tp=1 ranks [4, 5]"]
    assert layout.pp_groups() == []  # no pipeline group per position: boundary pairs instead
    assert boundary_pairs(layout, 0) == [(0, 4), (1, 4), (2, 5), (3, 5)]
    specs = plan_groups(view, layout, {"pp": "cpu-forward"})
    pairs = [g for g in specs if g.axis == PAIR]
    assert [g.name for g in pairs] == ["pp.b0.dp0tp0-dp0tp0", "pp.b0.dp0tp1-dp0tp0", "pp.b0.dp1tp0-dp1tp0",
                                       "pp.b0.dp1tp1-dp1tp0"]
    assert all(g.kind == "cross-vendor" for g in pairs)
    assert {g.name for g in specs if g.axis == "tp"} == {"tp.stage0.dp0", "tp.stage0.dp1"}
    assert {g.name: g.ranks for g in specs if g.axis == "dp"} == {"dp.stage0.tp0": (0, 2), "dp.stage0.tp1": (1, 3),
                                                                  "dp.stage1": (4, 5)}


@pytest.mark.parametrize(("tp", "dp"), [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((1, 2), (2, 1)), ((2, 1), (1, 3))])
def test_every_boundary_element_crosses_exactly_once(tp: tuple[int, int], dp: tuple[int, int]) -> None:
    # The pieces tile the [rows, hidden] activation with no overlap: the bytes are those of equal shapes.
    n0, n1 = tp[0] * dp[0], tp[1] * dp[1]
    layout = plan_layout(_view(("nvidia", n0), ("amd", n1)), ParallelDims(pp=2, tp_per_stage=tp, dp_per_stage=dp))
    rows, hidden = 12, 8
    seen = [[0] * hidden for _ in range(rows)]
    for p in boundary_pieces(layout, 0, rows, hidden):
        s0, s1 = layout.coords(p.sender), layout.coords(p.receiver)
        assert s0[0] == 0 and s1[0] == 1
        for i in range(*p.rows):
            for j in range(*p.cols):
                seen[i][j] += 1
    assert all(c == 1 for row in seen for c in row)


def test_a_tp_that_leaves_a_node_or_a_shape_that_misses_the_island_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"stage 0: parallel.tp_per_stage\[0\]=4 puts ranks \[0, 1, 2, 3\] on hosts"):
        plan_layout(_view(("nvidia", 2), ("nvidia", 2), ("amd", 1)),
                    ParallelDims(pp=2, tp_per_stage=(4, 1), dp_per_stage=(1, 1)))
    with pytest.raises(LayoutError, match=r"stage 1 \(parallel.dp_per_stage\[1\]=2 x parallel.tp_per_stage\[1\]=1\)"):
        plan_layout(_view(("nvidia", 2), ("amd", 1)), ParallelDims(pp=2, dp_per_stage=(1, 2)))


BASE = ["train", "--config", str(DEMO), "--data.global_batch_size=16"]
CASES = [
    ("dp-not-dividing-batch", ["--simulate", "nvidia:3,amd:1", "--parallel.dp_per_stage=[3,1]"],
     "stage 0: parallel.dp_per_stage[0]=3 does not divide data.global_batch_size=16"),
    ("tp-not-dividing-model", ["--simulate", "nvidia:1,amd:3", "--parallel.dp_per_stage=[1,1]",
                               "--parallel.tp_per_stage=[1,3]"], "stage 1: parallel.tp_per_stage[1]=3 does not divide"),
    ("shape-misses-island", ["--simulate", "nvidia:2,amd:1", "--parallel.dp_per_stage=[1,2]"],
     "stage 1 (parallel.dp_per_stage[1]=2 x parallel.tp_per_stage[1]=1) would take ranks [1, 2] of amd and nvidia"),
    ("shard-not-dividing-dp", ["--simulate", "nvidia:2,amd:1", "--parallel.dp_per_stage=[2,1]",
                               "--parallel.dp_shard_per_stage=[2,2]"], "stage 1: parallel.dp_shard_per_stage[1]=2"),
    ("wrong-length", ["--simulate", "nvidia:2,amd:1", "--parallel.dp_per_stage=[2,1,1]"],
     "parallel.dp_per_stage=[2, 1, 1] has 3 entries but parallel.pp=2"),
    ("world-mismatch", ["--simulate", "nvidia:2,amd:2", "--parallel.dp_per_stage=[2,1]"],
     "needs 3 ranks but --simulate gives 4"),
]


@pytest.mark.parametrize(("extra", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_shapes_are_refused_before_any_rank(extra: list[str], fragment: str, capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    assert main([*BASE, *extra, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_no_global_batch_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--config", str(DEMO), "--simulate", "nvidia:2,amd:1", "--parallel.dp_per_stage=[2,1]",
                 "--dry-run"]) == 2
    assert "needs data.global_batch_size" in capsys.readouterr().err


def test_the_dry_run_sizes_each_stage_with_its_own_shape(capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    args = [*BASE, "--simulate", "nvidia:2,amd:2", "--parallel.dp_per_stage=[2,1]", "--parallel.tp_per_stage=[1,2]",
            "--dry-run", "--json"]
    assert main(args) == 0
    shaped = json.loads(capsys.readouterr().out)["stages"]
    # the same stage 1 with tp=1 holds twice the parameters per GPU (debug: every matrix splits by 2)
    assert main([*args[:6], "--parallel.dp_per_stage=[2,2]", "--parallel.tp_per_stage=[1,1]", *args[8:]]) == 0
    plain = json.loads(capsys.readouterr().out)["stages"]
    assert shaped[1]["shape"] == {"tp": 2, "dp": 1, "dp_shard": 1, "micro_batch": 4, "ac": "none"}
    assert shaped[0]["params"] == plain[0]["params"]
    assert shaped[1]["params"] < plain[1]["params"]
    assert main([*BASE, "--simulate", "nvidia:2,amd:2", "--parallel.dp_per_stage=[2,1]",
                 "--parallel.tp_per_stage=[1,2]", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "0: dp=2 (shard 1) tp=1 microbatch 2 | 1: dp=1 (shard 1) tp=2 microbatch 4" in out, out


@pytest.mark.parametrize("how", ["option", "plan"])
def test_titan_refuses_per_stage_shapes(how: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    plan = tmp_path / "plan.toml"
    plan.write_text("[bimetal]\ndp_per_stage = [2, 1]\n")
    extra = ["--parallel.tp_per_stage=2,1"] if how == "option" else ["--plan", str(plan)]
    code = main(["titan", "--module", "llama3", "--config", "llama3_debugmodel", "--simulate", "nvidia:2,amd:1",
                 f"--dump_folder={tmp_path / 'out'}", *extra])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run under torchtitan" in err and "Traceback" not in err, err
    assert ("--parallel.tp_per_stage" if how == "option" else "[bimetal] dp_per_stage") in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), err


@pytest.mark.parametrize("spec", ["h100_mi300x.toml", "h200_mi325x.toml"])
def test_the_planner_explains_each_island_and_writes_a_plan_the_dry_run_accepts(spec: str, tmp_path: Path, capsys,
                                                                                monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(ROOT)  # the written config names the spec relative to the working directory
    out = tmp_path / "plan.toml"
    assert main(["plan", f"configs/clusters/{spec}", "--explain", "--per-stage", "--write", str(out)]) == 0
    text = capsys.readouterr().out
    island = spec.split("_")[0]
    assert f"stage 0 ({island}," in text and "stage 1 (" in text, text
    assert "best per-stage plan: step" in text and "best uniform plan of the search" in text, text
    assert "predicted gain of per-stage shapes" in text or "per-stage against it" in text, text
    import tomllib

    written = tomllib.loads(out.read_text())
    assert len(written["parallel"]["tp_per_stage"]) == 2 and written["data"]["global_batch_size"] == 256
    assert main(["train", "--config", str(out), "--dry-run"]) == 0  # every stage fits its device
    assert "fits" in capsys.readouterr().out


def test_a_per_stage_search_prices_each_island_with_its_own_shape() -> None:
    # 16 H100s and 8 MI300Xs, one stage per island: the islands differ in size, so their dp and tp do too,
    # and each island's best shape is priced on its own fabric and memory.
    from dataclasses import replace

    from bimetal.plan.shapes import evaluate_rows, search_shapes
    from bimetal.plan.spec import load_spec

    spec = load_spec(str(ROOT / "configs" / "clusters" / "h100_mi300x.toml"))
    spec = replace(spec, groups=(replace(spec.groups[0], count=2), spec.groups[1]))
    best = search_shapes(spec, "llama3-8b", 8192, 256)[0]
    assert [(s.group, s.tp * s.dp) for s in best.stages] == [("h100", 16), ("mi300x", 8)]
    assert best.stages[0].tp != best.stages[1].tp or best.stages[0].dp != best.stages[1].dp
    assert all(not s.rejected for s in best.stages)
    # a global microbatch of 4 rows cannot be split over dp=8: the MI300X island's tp=1 shape is not offered
    four = evaluate_rows(spec, "llama3-8b", 8192, 256, 4)
    assert four is not None and all(a.dp <= 4 for a in four.alternatives[1])


def test_a_tp_leaving_a_node_of_the_cluster_spec_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    # a torchrun job sized against parallel.cluster: its MI300X island is two nodes of 4, so stage 1's tp=8 would
    # leave a node
    monkeypatch.delenv("RANK", raising=False)
    text = (ROOT / "configs" / "clusters" / "h100_mi300x.toml").read_text()
    head, amd = text.split('name = "mi300x"')
    spec = tmp_path / "spec.toml"
    spec.write_text(head + 'name = "mi300x"' + amd.replace("count = 1", "count = 2").replace("gpus_per_node = 8",
                                                                                             "gpus_per_node = 4"))
    code = main(["train", "--model.flavour=llama3-8b", "--parallel.pp=2", "--parallel.tp_per_stage=[2,8]",
                 "--parallel.dp_per_stage=[4,1]", "--data.global_batch_size=16", "--parallel.microbatches=4",
                 f"--parallel.cluster={spec}", "--dry-run"])
    err = capsys.readouterr().err
    # the one layout check's sentence, as `bimetal slurm` says it (bimetal.plan.layout_check)
    assert code == 2 and "stage 1: parallel.tp_per_stage[1]=8 puts ranks [8, 9, 10, 11, 12, 13, 14, 15] on hosts " \
                         "mi300x-0, mi300x-1; a tensor-parallel group must stay inside one node" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_plan_config_refuses_per_stage_shapes(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "shaped.toml"
    cfg.write_text("[parallel]\npp = 2\ndp_per_stage = [2, 1]\n[data]\nglobal_batch_size = 16\n")
    assert main(["plan", str(ROOT / "configs" / "clusters" / "h100_mi300x.toml"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "per-stage shapes, which --config does not price" in err and "--per-stage" in err, err
