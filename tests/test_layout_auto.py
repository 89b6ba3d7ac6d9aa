"""``parallel.layout = "auto"``: the pick for the world a job finds, the keys it keeps, and its refusals.

The pick is pure (``bimetal.plan.auto_layout.pick_layout``), so a table of worlds - vendors, nodes, kept keys -
checks it with no process: the layout, the stage split, the microbatches and the global batch it keeps. The
config's side (``load_config``: which written keys are kept, which the command line's ``auto`` replaces and says
so, which contradict it) and the ranks' agreement (rank 0 publishes its pick as JSON over the store, a rank that
picked otherwise stops) run on a dictionary store. Through ``bimetal train`` (in this process; nothing starts):
a dry-run resolves the pick on ``--simulate``'s ranks and on a cluster spec's GPUs, and each bad input is one
sentence with exit status 2. Runs that train on a picked layout and resume onto one are in
``tests/test_moving_a_run.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bimetal.cli import main
from bimetal.config import load_config
from bimetal.errors import UserError
from bimetal.plan.auto_layout import PICK_KEY, World, agree_layout, pick_layout

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
SPEC = ROOT / "configs" / "clusters" / "h100_mi300x.toml"


def _cfg(*overrides: str, config: Path | None = DEMO, cli_auto: bool = True) -> tuple:
    """The config of ``config`` with ``overrides`` (and ``--parallel.layout=auto``), the keys kept, the notes."""
    notes: list[str] = []
    keep: set[str] = set()
    cfg = load_config(config, ["--parallel.layout=auto"] * cli_auto + list(overrides), notes, keep)
    return cfg, frozenset(keep), notes


def _world(*nodes: str) -> World:
    """``"nvidia:2"`` per node, nodes in rank order."""
    return World(tuple((f"node{i}", v) for i, node in enumerate(nodes) for part in node.split(",")
                       for v, n in [part.split(":")] for _ in range(int(n))))


# (world, overrides, (pp, dp, tp, layers per stage, microbatches)) - demo.toml: global batch 8 x 2, 2 rows each
PICKS = [
    (_world("nvidia:2,amd:2"), [], (2, 2, 1, [2, 2], 4)),
    (_world("nvidia:4"), [], (1, 4, 1, [4], 2)),
    (_world("amd:1,nvidia:3"), [], (4, 1, 1, [1, 1, 1, 1], 8)),
    (_world("nvidia:2,amd:2"), ["--parallel.allow_cross_vendor_dp=true"], (1, 4, 1, [4], 2)),
    (_world("nvidia:2,amd:2"), ["--parallel.tp=2"], (2, 1, 2, [2, 2], 8)),
    (_world("nvidia:4"), ["--parallel.layers_per_stage=[3,1]"], (2, 2, 1, [3, 1], 4)),
    (_world("nvidia:2", "nvidia:2"), ["--parallel.tp=2"], (1, 2, 2, [4], 4)),
    (_world("nvidia:4"), ["--parallel.dp_shard=2"], (1, 4, 1, [4], 2)),
    (_world("nvidia:1"), [], (1, 1, 1, [4], 8)),
]


@pytest.mark.parametrize(("world", "overrides", "want"), PICKS, ids=[f"{w.describe()} {' '.join(o)}".strip()
                                                                   for w, o, _ in PICKS])
def test_the_pick_for_each_world_keeps_the_batch_and_the_written_keys(world: World, overrides: list[str],
                                                                        want: tuple) -> None:
    cfg, keep, _ = _cfg(*overrides)
    pick = pick_layout(cfg, world, keep)
    p = pick.cfg.parallel
    assert (p.pp, p.dp, p.tp, pick.cfg.stage_split(4), p.microbatches) == want, pick.line
    assert pick.cfg.global_batch == 16 and pick.cfg.stage_microbatch(0) == 2  # the trajectory's batch, kept
    assert p.layout == "fixed" and pick.cfg.world_size == len(world.ranks)
    assert p.dp_shard == (2 if "--parallel.dp_shard=2" in overrides else 1)
    assert "\n" not in pick.line and pick.line.startswith(f"bimetal train: parallel.layout='auto' on "
                                                          f"{world.describe()}: pp={p.pp} x dp={p.dp} x tp={p.tp}")
    for key in keep:  # a kept key is said in the line
        assert f"parallel.{key}" in pick.line
    assert pick_layout(cfg, World.from_view(world.view()), keep) == pick  # the ranks' view gives the same pick


@pytest.mark.parametrize(("world", "overrides", "fragments"), [
    (_world("nvidia:3"), ["--parallel.tp=2"], ["nvidia:3 on 1 node (3 ranks) keeping parallel.tp=2",
                                               "no pp x dp x tp with parallel.tp=2 makes 3 ranks"]),
    (_world("nvidia:1", "nvidia:1"), ["--parallel.tp=2"],
     ["pp=1 x dp=1 x tp=2: tp=2 does not divide the 1 nvidia ranks on host 'node0'"]),
    (_world("nvidia:2,amd:2"), ["--parallel.pp=1", "--parallel.layers_per_stage=[]"],
     ["pp=1 x dp=4 x tp=1", "allow_cross_vendor_dp"]),
    (_world("nvidia:4"), ["--parallel.pp=3", "--parallel.layers_per_stage=[2,1,1]"],
     ["keeping parallel.layers_per_stage=[2, 1, 1], parallel.pp=3: no pp x dp x tp with"]),
], ids=["tp-kept-does-not-tile", "tp-kept-leaves-the-node", "pp1-mixes-vendors", "kept-keys-leave-ranks-over"])
def test_no_layout_fits_is_one_sentence_naming_the_world_and_the_first_reason(world: World, overrides: list[str],
                                                                              fragments: list[str]) -> None:
    cfg, keep, _ = _cfg(*overrides)
    with pytest.raises(UserError) as err:
        pick_layout(cfg, world, keep)
    text = str(err.value)
    assert text.startswith("parallel.layout='auto' finds no layout for ") and "\n" not in text
    for fragment in fragments:
        assert fragment in text, text


def test_written_keys_are_kept_where_auto_is_written_and_replaced_under_a_command_line_auto(tmp_path: Path) -> None:
    # the command line's auto over the file's layout: replaced, and said
    cfg, keep, notes = _cfg()
    assert keep == frozenset() and (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.layers_per_stage) == (1, 1, [])
    assert notes == [f"parallel.layout='auto' (the command line) replaces parallel.pp, parallel.dp, "
                     f"parallel.layers_per_stage of {DEMO}; the layout is picked when the job starts"]
    # written beside auto in the same file: kept
    text = DEMO.read_text().replace("pp = 2\n", 'pp = 2\nlayout = "auto"\n')
    (tmp_path / "auto.toml").write_text(text)
    cfg, keep, notes = _cfg(config=tmp_path / "auto.toml", cli_auto=False)
    assert keep == {"pp", "dp", "layers_per_stage"} and notes == []
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.layers_per_stage) == (2, 2, [3, 1])
    # on the command line over the file's auto: kept
    cfg, keep, _ = _cfg("--parallel.tp=2", config=tmp_path / "auto.toml", cli_auto=False)
    assert keep == {"pp", "dp", "tp", "layers_per_stage"}
    # a fixed layout holds no keep and no note
    notes, kept = [], set()
    assert load_config(DEMO, [], notes, kept).parallel.layout == "fixed" and not notes and not kept


@pytest.mark.parametrize(("args", "fragment"), [
    (["--parallel.layout=bogus"], "parallel.layout='bogus' is unknown; use 'fixed'"),
    (["--simulate", "nvidia:2,amd:2", "--parallel.layout=auto", "--parallel.dp_per_stage=[2,2]"],
     "parallel.layout='auto' picks a layout of equal stages, but parallel.dp_per_stage (the command line)"),
    (["--simulate", "nvidia:3", "--parallel.layout=auto", "--parallel.tp=2"],
     "parallel.layout='auto' finds no layout for nvidia:3 on 1 node (3 ranks) keeping parallel.tp=2"),
    (["--parallel.layout=auto"], "which a dry-run without --simulate cannot see; add --simulate"),
], ids=["unknown-value", "beside-per-stage", "no-fit", "dry-run-cannot-see-the-world"])
def test_bad_input_is_one_sentence(args: list[str], fragment: str, tmp_path: Path, capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    code = main(["train", "--config", str(DEMO), f"--metrics.run_dir={tmp_path / 'run'}", "--dry-run", *args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("bimetal train: "), err
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists() and "dry run" not in out


@pytest.mark.parametrize(("args", "picked", "stage_line"), [
    (["--simulate", "amd:1,nvidia:3"], "on amd:1,nvidia:3 on 1 node: pp=4 x dp=1 x tp=1, layers per stage "
     "[1, 1, 1, 1], 8 microbatch(es)", "dry run: llama3/debug pp=4 dp=1 (shard 1) tp=1"),
    ([f"--parallel.cluster={SPEC}"], "on nvidia:8,amd:8 on 2 nodes: pp=2 x dp=4 x tp=2",
     "dry run: llama3/debug pp=2 dp=4 (shard 1) tp=2"),
], ids=["simulate", "cluster-spec"])
def test_the_dry_run_checks_and_reports_the_pick(args: list[str], picked: str, stage_line: str, tmp_path: Path,
                                                 capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    code = main(["train", "--config", str(DEMO), f"--metrics.run_dir={tmp_path / 'run'}", "--dry-run",
                 "--parallel.layout=auto", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert [line for line in lines if "parallel.layout='auto' on" in line][0].startswith(
        f"bimetal train: parallel.layout='auto' {picked}"), out
    assert any(line.startswith(stage_line) for line in lines), out
    assert not (tmp_path / "run").exists()


class _Store:
    """A c10d store's ``set``/``get``/``set_timeout`` on a dictionary (a test double: one process plays every rank)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key].encode()

    def set_timeout(self, timeout: object) -> None:
        pass


def test_the_ranks_take_rank_0s_pick_and_a_rank_that_picked_otherwise_stops(capsys) -> None:
    from datetime import timedelta

    cfg, keep, _ = _cfg()
    store, world = _Store(), _world("nvidia:2,amd:2")
    view = world.view()
    first = agree_layout(cfg, keep, view, store, 0, timedelta(seconds=1))
    assert capsys.readouterr().out == first.line + "\n"  # rank 0 logs the one line
    assert store.data[f"{PICK_KEY}/0"].startswith("{")  # JSON on the store
    assert agree_layout(cfg, keep, view, store, 1, timedelta(seconds=1)) == first
    assert capsys.readouterr().out == ""
    with pytest.raises(UserError, match="rank 3 picked the layout .* but rank 0 picked .*same bimetal and config"):
        agree_layout(cfg, keep, _world("nvidia:4").view(), store, 3, timedelta(seconds=1))


def test_the_slurm_script_places_the_stages_of_the_pick(capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    code = main(["slurm", "--config", str(DEMO), "--cluster", str(SPEC), "--partition", "nvidia=h100",
                 "--partition", "amd=mi300x", "--python", "amd=/opt/rocm/bin/python", "--parallel.layout=auto"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.splitlines()[0].startswith("bimetal slurm: parallel.layout='auto' on nvidia:8,amd:8 on 2 nodes: pp=2 x "
                                          "dp=4 x tp=2"), err
    assert "ranks 0-7, stage 0" in out and "ranks 8-15, stage 1" in out  # the picked pp=2, one stage per island
    assert out.count("-m bimetal.train ") == 2 and out.count("--parallel.layout=auto") >= 2  # the ranks pick again


def test_with_a_cluster_spec_the_planner_prices_the_layouts_that_fit_and_refuses_what_overflows_memory() -> None:
    """llama3-8b on configs/clusters/h100_mi300x.toml: the planner's fastest layout, with its balanced split and the
    fastest of the FSDP degrees ``bimetal plan`` tries (faster than the same layout unsharded, as the planner
    prices both); the same spec cut to the world the ranks found (the AMD node gone); a world whose every layout
    overflows the H100 with every FSDP degree and recomputation mode."""
    from bimetal.plan.search import evaluate
    from bimetal.plan.spec import load_spec

    cfg, keep, _ = _cfg(f"--parallel.cluster={SPEC}", "--model.flavour=llama3-8b", "--data.seq_len=4096",
                        "--data.global_batch_size=64", "--data.batch_size=64", "--parallel.microbatches=64",
                        config=None)
    full = pick_layout(cfg, World.from_spec(str(SPEC)), keep)
    p = full.cfg.parallel
    assert (p.pp, p.dp, p.tp, p.dp_shard, p.layers_per_stage, p.microbatches) == (2, 4, 2, 4, [17, 15], 16), full.line
    assert full.cfg.activation_checkpoint.mode == "none" and "x dp_shard=4, layers per stage" in full.line
    assert "(the fastest of 10 that fit, " in full.line and f"tokens/s as the planner predicts on {SPEC})" in full.line
    spec = load_spec(str(SPEC))
    priced = [evaluate(spec, "llama3-8b", 4096, 64, 2, 4, 2, 1, p.pp_transport, [17, 15], shard, "none",
                       dp_transport=p.dp_transport) for shard in (1, 4)]
    assert priced[0] is not None and priced[1] is not None and priced[1].tokens_per_s > priced[0].tokens_per_s
    assert f"{priced[1].tokens_per_s:,.0f} tokens/s" in full.line
    alone = pick_layout(cfg, _world("nvidia:8"), keep)  # the spec's H100 group, one node of the world's 8 ranks
    q = alone.cfg.parallel
    assert (q.pp, q.dp, q.tp, q.dp_shard) == (1, 4, 2, 4), alone.line
    assert "the fastest of 10 that fit" in alone.line
    with pytest.raises(UserError, match=r"nvidia:2 on 1 node \(2 ranks\): pp=1 x dp=2 x tp=1: stage 0 needs "
                                        r"[0-9.]+ GB per GPU, over 90% of the 80 GB of a H100/H100, with every FSDP "
                                        r"degree and activation checkpointing mode tried; "):
        pick_layout(cfg, _world("nvidia:2"), keep)


def test_with_a_cluster_spec_the_pick_recomputes_where_memory_needs_it_unless_the_mode_is_written() -> None:
    """dp kept at 1 on four H100s: only full recomputation fits (the pick says so in its line); the same run with
    ``activation_checkpoint.mode = "none"`` written keeps it, and then nothing fits (one sentence naming the kept
    mode, and no "every mode tried")."""
    base = (f"--parallel.cluster={SPEC}", "--model.flavour=llama3-8b", "--data.seq_len=4096",
            "--data.global_batch_size=64", "--data.batch_size=64", "--parallel.microbatches=16", "--parallel.dp=1")
    cfg, keep, _ = _cfg(*base, config=None)
    assert keep == frozenset({"dp"})
    pick = pick_layout(cfg, _world("nvidia:4"), keep)
    assert (pick.cfg.parallel.tp, pick.cfg.activation_checkpoint.mode) == (4, "full"), pick.line
    assert "x tp=4, activation checkpointing full, layers per stage [32]" in pick.line
    cfg, keep, _ = _cfg(*base, "--activation_checkpoint.mode=none", config=None)
    assert keep == frozenset({"dp", "activation_checkpoint.mode"})
    with pytest.raises(UserError, match=r"keeping activation_checkpoint.mode=none, parallel.dp=1: pp=4 x dp=1 x "
                                        r"tp=1: stage 0 needs [0-9.]+ GB per GPU, over 90% of the 80 GB of a H100; "):
        pick_layout(cfg, _world("nvidia:4"), keep)
