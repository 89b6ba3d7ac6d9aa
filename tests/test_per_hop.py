"""Per-hop pipeline groups: each pair of neighbouring stages on its own back-end, one group for torch's pipelining.

* plain data: which groups a pipeline gets (``plan_pipeline``), which ranks exchange activations
  (``stage_pairs``: a looped schedule wraps around, a V schedule does not);
* ``PerHopGroup`` routing, with ``RecordingGroup`` test doubles standing in for the pairs' groups: a send goes to
  its pair's group with the peer's rank in that group, a collective to the collectives group, a peer with no pair
  is refused in one sentence;
* one launched job through ``bimetal train`` (pp=4 x dp=2 over ``nvidia:4,amd:4``, 1F1B): the group table shows
  native hops 0-1 and 2-3 and a cpu-forward hop 1-2 per replica, the losses and gradient norms equal those of the
  all-Gloo run (the same arguments with every group on stock Gloo, run in the same test on the same machine: a
  reference stored from another machine differs where its math libraries block float sums otherwise), the
  cross-vendor bytes per step are
  those of the crossing hops alone, and a rank whose hops stay inside its vendor moves no byte through a bimetal
  transport's point-to-point (its only bimetal group is the pipeline's collectives group).

The gradient norm exceeds ``optim.grad_clip`` in every step, so the clipping scale - the result of the pp group's
all-reduce - enters the weights: the collectives group must reduce in Gloo's order for the losses to be equal.
Both runs are on this machine, so equality is exact.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from bimetal.comm.per_hop import NoRouteError, PerHopGroup, PerHopOptions, Route
from bimetal.comm.work import CommCounters
from bimetal.parallel.groups import plan_groups, plan_pipeline
from bimetal.parallel.layout import ParallelDims, plan_layout
from bimetal.parallel.pipeline_groups import stage_pairs
from bimetal.topology.records import ClusterView, RankRecord

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train", "--config", "configs/demo.toml", "--simulate", "nvidia:4,amd:4", "--parallel.pp=4", "--parallel.dp=2",
        "--parallel.layers_per_stage=[1,1,1,1]", "--training.steps=3", "--data.seq_len=32", "--metrics.log_every=1",
        "--checkpoint.every=0"]
ALL_GLOO = ["--parallel.homogeneous_backend=gloo", "--parallel.pp_transport=gloo", "--parallel.dp_transport=gloo"]
NATIVE, CF, PER_HOP = "bimetal_sim_native", "bimetal_cpu_forward", "bimetal_per_hop"


def _view(vendors: list[str]) -> ClusterView:
    return ClusterView([RankRecord(r, r, "vm", v, f"cpu (simulated {v})", 0) for r, v in enumerate(vendors)])


# ---- plain data -------------------------------------------------------------------------------------------

def test_stage_pairs_follow_the_schedule() -> None:
    assert stage_pairs(range(4)) == [(0, 1), (1, 2), (2, 3)]
    assert stage_pairs([0, 1, 2, 3, 0, 1, 2, 3]) == [(0, 1), (1, 2), (2, 3), (3, 0)]  # looped: the wrap-around
    assert stage_pairs([0, 1, 2, 3, 3, 2, 1, 0]) == [(0, 1), (1, 2), (2, 3)]  # V: the turn stays on rank 3
    assert stage_pairs([0, 1, 0, 1]) == [(0, 1)]  # pp=2 looped: one pair of ranks, both ways


def test_a_pipeline_over_two_islands_gets_a_back_end_per_hop() -> None:
    view = _view(["nvidia"] * 2 + ["amd"] * 2)
    specs = plan_groups(view, plan_layout(view, ParallelDims(pp=4)), {"pp": "cpu-forward"})
    assert [(g.name, g.ranks, g.kind, g.backend) for g in specs] == [
        ("pp.dp0", (0, 1, 2, 3), "cross-vendor", PER_HOP),
        ("pp.dp0.hop0-1", (0, 1), "homogeneous-nvidia", NATIVE),
        ("pp.dp0.hop1-2", (1, 2), "cross-vendor", CF),
        ("pp.dp0.hop2-3", (2, 3), "homogeneous-amd", NATIVE),
        ("pp.dp0.collectives", (0, 1, 2, 3), "cross-vendor", CF)]
    # device-direct hops keep their collectives on cpu-forward; every pair on one back-end: one plain group
    dd = plan_pipeline("pp", (0, 1, 2, 3), ("nvidia", "nvidia", "amd", "amd"), "bimetal_device_direct",
                       lambda v: NATIVE)
    assert [g.backend for g in dd] == [PER_HOP, NATIVE, "bimetal_device_direct", NATIVE, CF]
    gloo = plan_groups(view, plan_layout(view, ParallelDims(pp=4)), {"pp": "gloo", "homogeneous": "gloo"})
    assert [(g.name, g.backend) for g in gloo] == [("pp.dp0", "gloo")]
    two = plan_groups(_view(["nvidia", "amd"]), plan_layout(_view(["nvidia", "amd"]), ParallelDims(pp=2)))
    assert [(g.name, g.backend) for g in two] == [("pp.dp0", CF)]
    ring = plan_pipeline("pp", (0, 1, 2, 3), ("nvidia", "nvidia", "amd", "amd"), CF, lambda v: NATIVE,
                         [0, 1, 2, 3, 0, 1, 2, 3])
    assert [(g.name, g.ranks, g.backend) for g in ring if g.axis == "pp.hop"][-1] == ("pp.hop3-0", (3, 0), CF)


# ---- routing, with test doubles for the pairs' groups ---------------------------------------------------

class RecordingGroup:
    """Stands in for a pair's (or the collectives) process group: records each call, returns a token. With
    ``counters`` it is a bimetal transport (byte counters, ``comm_stats``), without it a native group."""

    def __init__(self, name: str, counters: bool = False) -> None:
        self.name, self.calls = name, []
        if counters:
            self.counters = CommCounters(bytes_sent=7)
            self.comm_stats = lambda: {"bytes_staged": 3, "bytes_stripe0": 5}

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.calls.append(("send", peer, tag))
        return f"{self.name}.send"

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.calls.append(("recv", peer, tag))
        return f"{self.name}.recv"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> str:
        self.calls.append(("allreduce", opts))
        return f"{self.name}.allreduce"

    def barrier(self, opts: Any = None) -> str:
        self.calls.append(("barrier", opts))
        return f"{self.name}.barrier"


def _router(cross_counters: bool = True) -> tuple[PerHopGroup, dict[str, RecordingGroup]]:
    """Rank 1 of the pipeline (0, 1, 2): a native pair with rank 0 (a group per direction), a cross-vendor one
    with rank 2 (one group)."""
    g = {"to0": RecordingGroup("to0"), "from0": RecordingGroup("from0"),
         "cross": RecordingGroup("cross", counters=cross_counters), "coll": RecordingGroup("coll", counters=True)}
    routes = {0: Route(0, g["to0"], g["from0"], 0, 0, "pp.hop0-1", NATIVE, False),  # type: ignore[arg-type]
              2: Route(2, g["cross"], g["cross"], 1, 1, "pp.hop1-2", CF, True)}  # type: ignore[arg-type]
    options = PerHopOptions(routes, g["coll"], "pp.collectives", ["pp.hop0-1", "pp.hop1-2"])  # type: ignore[arg-type]
    pg = PerHopGroup(1, 3, [0, 1, 2], options, timedelta(seconds=5))
    pg.setGroupDesc("pp.dp0")
    return pg, g


def test_sends_and_receives_go_over_the_pair_and_collectives_over_the_whole_group() -> None:
    pg, g = _router()
    t = [torch.zeros(2)]
    assert pg.send(t, 0, 3) == "to0.send" and pg.recv(t, 0, 4) == "from0.recv"
    assert pg.send(t, 2, 0) == "cross.send" and pg.recv(t, 2, 0) == "cross.recv"
    assert g["to0"].calls == [("send", 0, 3)] and g["from0"].calls == [("recv", 0, 4)]
    assert g["cross"].calls == [("send", 1, 0), ("recv", 1, 0)]  # rank 2 is rank 1 of the cross pair's group
    assert pg.allreduce(t, "opts") == "coll.allreduce" and pg.barrier() == "coll.barrier"
    assert g["coll"].calls == [("allreduce", "opts"), ("barrier", None)] and not g["to0"].calls[1:]
    assert pg.cross_vendor_counters() == [g["cross"].counters]  # the native pair keeps none; the collectives apart
    assert pg.comm_stats() == {"bytes_staged": 6, "bytes_stripe0": 10}  # cross pair + collectives group
    assert pg.getBackendName() == PER_HOP and pg.size() == 3 and pg.rank() == 1


def test_a_peer_without_a_pair_is_refused_in_one_sentence() -> None:
    pg, _ = _router()
    routes = dict(pg.routes)
    del pg.routes[2]
    with pytest.raises(NoRouteError) as err:
        pg.send([torch.zeros(1)], 2, 0)
    msg = str(err.value)
    assert msg == ("pipeline group 'pp.dp0': rank 1 has no pair with rank 2 (pairs: pp.hop0-1, pp.hop1-2); a "
                   "pipeline sends only between neighbouring stages")
    pg.routes = routes
    g_cross = pg.routes[2].send
    del g_cross.counters  # stock Gloo across vendors: no counters, the trainer counts send ops instead
    assert pg.cross_vendor_counters() is None


# ---- one launched job -----------------------------------------------------------------------------------

def _act_bytes() -> int:
    """One float32 activation of one microbatch: (batch 8 / 4 microbatches) x seq 32 x dim 128 x 4 bytes."""
    return 2 * 32 * 128 * 4


def _series(run: Path) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.mark.timeout(500)
def test_pp4_dp2_trains_per_hop_like_all_gloo(tmp_path: Path) -> None:
    from launcher import bimetal

    gloo = tmp_path / "all-gloo"
    ref = bimetal(*ARGS, *ALL_GLOO, f"--metrics.run_dir={gloo}", timeout=230)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    ref_losses, ref_norms = _series(gloo)
    run = tmp_path / "run"
    proc = bimetal(*ARGS, f"--metrics.run_dir={run}", timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("pp.")}
    for d, ranks in ((0, (0, 2, 4, 6)), (1, (1, 3, 5, 7))):
        a, b, c, e = map(str, ranks)
        assert rows[f"pp.dp{d}"] == [f"{a},{b},{c},{e}", "nvidia,amd", "cross-vendor", PER_HOP]
        assert rows[f"pp.dp{d}.hop0-1"] == [f"{a},{b}", "nvidia", "homogeneous-nvidia", NATIVE]
        assert rows[f"pp.dp{d}.hop1-2"] == [f"{b},{c}", "nvidia,amd", "cross-vendor", CF]
        assert rows[f"pp.dp{d}.hop2-3"] == [f"{c},{e}", "amd", "homogeneous-amd", NATIVE]
        assert rows[f"pp.dp{d}.collectives"][-1] == CF
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ([r["loss"] for r in records], [r["grad_norm"] for r in records]) == (ref_losses, ref_norms)
    assert len(ref_losses) == 3 and min(ref_norms) > 1.0  # demo.toml's grad_clip: every step is clipped
    # Cross-vendor bytes per step: the crossing hop of each replica, an activation and a gradient per microbatch;
    # step 1 adds the schedule's one-time warm-up (a 4-byte vote each way and replica). With the native hops
    # counted too it would be three times as much.
    crossing = 2 * 2 * 4 * _act_bytes()
    assert [r["xvendor_bytes"] for r in records[1:]] == [crossing] * 2
    assert 0 <= records[0]["xvendor_bytes"] - crossing <= 64
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pp_transport"] == f"per hop: {CF} across vendors, {NATIVE} inside a vendor"
    comm = {r: json.loads((run / f"comm-rank{r}.json").read_text())["groups"] for r in range(8)}
    payload = 3 * 4 * _act_bytes()  # one direction of one hop, three steps of four microbatches
    for r, groups in comm.items():
        stage = r // 2
        hops = {name: g for name, g in groups.items() if g["axis"] == "pp.hop"}
        bimetal_groups = sorted(name for name, g in groups.items() if g["counters"] is not None)
        if stage in (0, 3):  # both ends of their only hop are one vendor: no bimetal transport carries it
            assert all(g["counters"] is None and g["backend"] == NATIVE for g in hops.values()), (r, hops)
            assert bimetal_groups == [f"pp.dp{r % 2}.collectives"], (r, bimetal_groups)
        else:  # the crossing hop's group carried this rank's side of that hop alone, not its native hop's bytes
            cross = hops[f"pp.dp{r % 2}.hop1-2"]["counters"]
            assert 0 <= cross["bytes_sent"] - payload <= 16 and 0 <= cross["bytes_received"] - payload <= 16, (r, cross)
