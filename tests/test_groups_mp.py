"""Groups created for real by launched ranks: ``bimetal topo`` on a simulated cluster, and the simulated
native back-end refusing a group that mixes vendors (as NCCL and RCCL cannot talk to each other)."""

from __future__ import annotations

import json

import pytest
from cli_inprocess import cli_main
from launcher import bimetal, launch

pytestmark = pytest.mark.timeout(120)


def test_topo_creates_every_group_with_its_backend() -> None:
    proc = bimetal("topo", "--simulate", "nvidia:2,amd:2", "--pp", "2", "--dp", "2", "--pp-transport", "gloo",
                   timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("pp.", "dp."))}
    assert rows["pp.dp0"][1:] == ["0,2", "nvidia,amd", "cross-vendor", "gloo"]
    assert rows["pp.dp1"][1] == "1,3"
    assert rows["dp.stage0"][2:] == ["nvidia", "homogeneous-nvidia", "bimetal_sim_native"]
    assert rows["dp.stage1"][2:] == ["amd", "homogeneous-amd", "bimetal_sim_native"]
    assert "stage 0: nvidia dp=2 x tp=1 ranks [0, 1]" in proc.stdout
    assert "stage 1: amd dp=2 x tp=1 ranks [2, 3]" in proc.stdout


RANK_SCRIPT = """
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from bimetal.parallel import ParallelDims, init_parallel
torch.set_num_threads(1)
pp, dp = int(sys.argv[1]), int(sys.argv[2])
ctx = init_parallel(ParallelDims(pp, dp), {"pp": "gloo"}, timedelta(seconds=60), print_table=False)
mine = {}
for axis, group in (("pp", ctx.pp_group), ("dp", ctx.dp_group)):
    if group is not None:
        spec = ctx.spec(ctx.my_group_name(axis))
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=group)  # the group really works
        mine[axis] = {"backend": str(dist.get_backend(group)), "kind": spec.kind, "ranks": list(spec.ranks),
                      "sum": t.item()}
info = {"rank": ctx.rank, "vendor": ctx.vendor, "stage": ctx.stage, **mine}
if ctx.world_size == 4:  # ranks 0, 1 nvidia and 2, 3 amd: the simulated native back-end and vendors
    same = dist.new_group([0, 1], backend="bimetal_sim_native")  # both nvidia: fine
    if ctx.rank in (0, 1):
        t = torch.ones(4)
        dist.all_reduce(t, group=same)
        info["same_vendor_sum"] = t.tolist()
    try:
        dist.new_group([1, 2], backend="bimetal_sim_native")  # nvidia + amd
        info["mixed"] = "ACCEPTED"
    except Exception as exc:
        info["mixed"] = f"REFUSED rank {ctx.rank}: {exc}"
with open(os.path.join(sys.argv[3], f"rank{ctx.rank}.json"), "w") as f:  # one file each: stdout interleaves
    json.dump(info, f)
ctx.destroy()
"""
LAYOUTS = [("nvidia:1,amd:1", 2, 1), ("nvidia:2,amd:2", 2, 2)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """Each layout's job once for the module: every rank's classification (and, at 4 ranks, what the simulated
    native back-end did with a group of one vendor and one that mixes two)."""
    done = {}
    for simulate, pp, dp in LAYOUTS:
        out = tmp_path_factory.mktemp("groups")
        script = out / "rank.py"
        script.write_text(RANK_SCRIPT)
        proc = launch(simulate, str(script), str(pp), str(dp), str(out), timeout=100)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done[simulate] = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}
    return done


@pytest.mark.parametrize(("simulate", "pp", "dp"), LAYOUTS)
def test_every_rank_gets_its_classification_and_backend(simulate: str, pp: int, dp: int,
                                                        launched: dict[str, dict[int, dict]]) -> None:
    ranks = launched[simulate]
    world = pp * dp
    assert sorted(ranks) == list(range(world))
    for r, info in ranks.items():
        vendor = "nvidia" if r < world // 2 else "amd"
        assert info["vendor"] == vendor and info["stage"] == (0 if vendor == "nvidia" else 1)
        assert info["pp"]["kind"] == "cross-vendor" and info["pp"]["backend"] == "gloo"
        assert info["pp"]["sum"] == float(sum(info["pp"]["ranks"]))
        if dp > 1:
            assert info["dp"]["kind"] == f"homogeneous-{vendor}"
            assert info["dp"]["backend"] == "bimetal_sim_native"
            assert info["dp"]["sum"] == float(sum(info["dp"]["ranks"]))
        else:
            assert "dp" not in info


def test_topo_refuses_an_impossible_layout_with_one_sentence(capsys, monkeypatch) -> None:
    # refused before any rank starts: bimetal.cli.main in this process (the console script's refusal of topo is
    # the next test's)
    code, out, err = cli_main(["topo", "--simulate", "nvidia:3,amd:1", "--pp", "2", "--dp", "2", "--strict"], capsys,
                              monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, (code, out, err)
    assert lines[0].startswith("bimetal topo: strict mode: 2 stages of dp*tp = 2 ranks cannot each be one vendor"), err


def test_bad_simulate_spec_is_one_sentence_and_exit_2() -> None:
    proc = bimetal("topo", "--simulate", "intel:2", timeout=100)
    assert proc.returncode == 2
    assert "bad simulation entry 'intel:2'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sim_native_refuses_a_group_that_mixes_vendors(launched: dict[str, dict[int, dict]]) -> None:
    """In the 4-rank job: a group of ranks 0 and 1 (both nvidia) works; one of ranks 1 (nvidia) and 2 (amd) is
    refused on both its ranks, naming them."""
    ranks = launched["nvidia:2,amd:2"]
    assert [ranks[r]["same_vendor_sum"] for r in (0, 1)] == [[2.0] * 4] * 2, ranks
    for r in (1, 2):
        assert ranks[r]["mixed"].startswith(f"REFUSED rank {r}: "), ranks[r]
        assert "cannot form a group across vendors (ranks 1:nvidia, 2:amd)" in ranks[r]["mixed"], ranks[r]
