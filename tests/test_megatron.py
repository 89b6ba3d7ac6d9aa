"""megatron-core on bimetal (``bimetal megatron``), on simulated vendors, against all-Gloo.

Two jobs train ``scripts/megatron_gpt.py`` in several layouts each (the ``bimetal megatron`` command's own ``main`` in
``python -m bimetal.integrations.megatron``, both forked from one interpreter that imported megatron-core once:
tests/forked_runs.py; the refusals below go through the command), in one process per rank
(``tests/megatron_cases.py``: Megatron's imports cost seconds), each layout on all-Gloo (every group plain Gloo,
the reference), cpu-forward and device-direct, same seed. Every rank writes its losses and the operations each
process group carried. Checked: losses identical (or within 1e-6 relative) to all-Gloo; every operation that moved
data between vendors went over a bimetal transport, none over the world group or a native group; the batched
interleaved schedule equals the unbatched one. Bad input ends in one sentence and exit status 2.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from launcher import ROOT, bimetal, clean_env

from bimetal.integrations.megatron import available

pytestmark = pytest.mark.skipif(not available(), reason="megatron-core is not installed: pip install -e '.[megatron]'")

MODES = ("all-gloo", "cpu-forward", "device-direct")
TRANSPORT_BACKENDS = {"bimetal_cpu_forward", "bimetal_device_direct"}
RTOL = 1e-6
# Two steps per run: the second step's loss comes after an optimizer step, so parity covers the gradients, their
# reduction and the update; each further step would cost every (case, mode) of both jobs its time again.
TWO = {"pp2": "--pp 2 --steps 2", "vpp": "--pp 2 --vpp 2 --steps 2",
       "vpp_batched": "--pp 2 --vpp 2 --batch-p2p --steps 2", "vpp_overlap": "--pp 2 --vpp 2 --overlap-p2p --steps 2",
       "tied": "--pp 2 --tied --steps 2",
       # data parallelism across the vendors: cpu-forward only (device-direct refuses it, see below)
       "dp2_distopt@all-gloo+cpu-forward": "--dist-opt --steps 2"}
FOUR = {"tp2_pp2": "--tp 2 --pp 2 --steps 2", "dp2_pp2_distopt": "--pp 2 --dist-opt --steps 2"}
VENDORS = {"nvidia:1,amd:1": ["nvidia", "amd"], "nvidia:2,amd:2": ["nvidia", "nvidia", "amd", "amd"]}


def _modes() -> list[str]:
    from conftest import engine_unavailable

    return [m for m in MODES if m != "device-direct" or engine_unavailable() is None]


def _reports(tmp: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """What one job over several cases and modes wrote in ``tmp``: ``{"<case>.<mode>": {rank: report}}``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in tmp.glob("*.rank*.json"):
        if path.name.startswith("order."):
            continue
        run, _, rank = path.name[:-len(".json")].rpartition(".rank")
        out.setdefault(run, {})[int(rank)] = {**json.loads(path.read_text()), "report_dir": str(tmp)}
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """Both jobs (``TWO`` on nvidia:1,amd:1, ``FOUR`` on nvidia:2,amd:2), one after another, each ``python -m
    bimetal.integrations.megatron --simulate ... -- tests/megatron_cases.py ...`` (the ``bimetal megatron`` command's
    own ``main``: it checks the release and launches the ranks, forked from itself) forked from one interpreter that
    imported megatron-core once (tests/forked_runs.py), not a new launcher importing it per job."""
    from forked_runs import runs

    todo = {"two": ("nvidia:1,amd:1", TWO, tmp_path_factory.mktemp("megatron2")),
            "four": ("nvidia:2,amd:2", FOUR, tmp_path_factory.mktemp("megatron4"))}
    done = runs([(["-m", "bimetal.integrations.megatron", "--simulate", simulate, "--", "tests/megatron_cases.py",
                   str(tmp), ",".join(_modes()), *[f"{name}={args}" for name, args in cases.items()]], ROOT)
                 for simulate, cases, tmp in todo.values()], env=clean_env(), at_once=False, timeout=800)
    out = {}
    for (name, (_, _, tmp)), proc in zip(todo.items(), done):
        assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-3000:])
        assert "bimetal groups (megatron-core):" in proc.stdout, proc.stdout[-3000:]
        out[name] = _reports(tmp)
    return out


@pytest.fixture(scope="module")
def two_ranks(jobs: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, dict[int, dict[str, Any]]]:
    return jobs["two"]


@pytest.fixture(scope="module")
def four_ranks(jobs: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, dict[int, dict[str, Any]]]:
    return jobs["four"]


def _case_modes(runs: dict[str, dict[int, dict[str, Any]]], case: str) -> list[str]:
    return [m for m in _modes()[1:] if f"{case}.{m}" in runs]


def _check_parity(runs: dict[str, dict[int, dict[str, Any]]], case: str) -> None:
    ref = runs[f"{case}.all-gloo"]
    assert any(r["losses"] for r in ref.values()), f"{case}: no rank reported losses"
    assert _case_modes(runs, case), case
    for mode in _case_modes(runs, case):
        got = runs[f"{case}.{mode}"]
        assert sorted(got) == sorted(ref)
        for rank, report in got.items():
            want = ref[rank]["losses"]
            assert len(report["losses"]) == len(want), (case, mode, rank)
            for a, b in zip(report["losses"], want):
                assert abs(a - b) <= RTOL * abs(b), (case, mode, rank, report["losses"], want)


def _check_traffic(runs: dict[str, dict[int, dict[str, Any]]], case: str, vendors: list[str]) -> set[str]:
    """Every op that moved data between vendors went over a bimetal transport group, none over the world or a
    native group; returns the groups that carried cross-vendor traffic."""
    crossing: set[str] = set()
    for mode in _case_modes(runs, case):
        for rank, report in runs[f"{case}.{mode}"].items():
            for op in report["ops"]:
                assert op["group"] != "WORLD", (case, mode, rank, op)
                members = {vendors[r] for r in op["ranks"]}
                cross = (op["peer"] is not None and vendors[op["peer"]] != vendors[rank]) or (
                    op["peer"] is None and len(members) > 1)
                if cross:
                    assert op["backend"] in TRANSPORT_BACKENDS, (case, mode, rank, op)
                    crossing.add(op["group"])
                else:
                    assert op["backend"] not in TRANSPORT_BACKENDS and len(members) == 1, (case, mode, rank, op)
    return crossing


@pytest.mark.timeout(900)  # the first test of the jobs fixture waits for both jobs
@pytest.mark.parametrize("case", [c.partition("@")[0] for c in TWO])
def test_two_vendors_pp2_parity_and_traffic(two_ranks: dict[str, dict[int, dict[str, Any]]], case: str) -> None:
    _check_parity(two_ranks, case)
    crossing = _check_traffic(two_ranks, case, VENDORS["nvidia:1,amd:1"])
    if case == "dp2_distopt":  # no pipeline: data parallelism spans the vendors, its groups on the transport
        assert "DATA_PARALLEL_GROUP_WITH_CP" in crossing, crossing
        return
    assert "PIPELINE_MODEL_PARALLEL_GROUP" in crossing, crossing
    assert "MODEL_PARALLEL_GROUP" in crossing, crossing  # the grad norm's all-reduce spans both stages
    if case == "tied":
        assert "EMBEDDING_GROUP" in crossing, crossing


def test_batched_and_overlapped_interleaved_equal_unbatched(two_ranks: dict[str, dict[int, dict[str, Any]]]) -> None:
    # pp=2 with the interleaved schedule: the previous and the next rank are one peer, and batch_p2p_comm=True
    # sends both directions to it in one batch (bimetal.integrations.megatron.hooks posts them in the unbatched
    # order); overlap_p2p_comm=True waits on the sends later. Every back-end must give the plain schedule's losses.
    for mode in _modes():
        plain = {r: v["losses"] for r, v in two_ranks[f"vpp.{mode}"].items()}
        for variant in ("vpp_batched", "vpp_overlap"):
            assert {r: v["losses"] for r, v in two_ranks[f"{variant}.{mode}"].items()} == plain, (variant, mode)


def test_transports_match_a_peers_messages_in_posting_order(two_ranks: dict[str, Any]) -> None:
    # bimetal's transports are not the reason a schedule mismatches messages: like Gloo (and NCCL), each hands a
    # peer's messages to the receives in the order both sides posted them, within one batch too.
    out = Path(two_ranks["pp2.all-gloo"][0]["report_dir"])
    for mode in _modes():
        for rank in (0, 1):
            record = json.loads((out / f"order.{mode}.rank{rank}.json").read_text())
            assert record["received"] == record["peer_sent"], (mode, rank, record)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(FOUR))
def test_four_ranks_parity_and_traffic(four_ranks: dict[str, dict[int, dict[str, Any]]], case: str) -> None:
    _check_parity(four_ranks, case)
    crossing = _check_traffic(four_ranks, case, VENDORS["nvidia:2,amd:2"])
    assert "PIPELINE_MODEL_PARALLEL_GROUP" in crossing, crossing
    if case == "dp2_pp2_distopt":  # the distributed optimizer's grad norm: its instance group spans both stages
        assert "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP" in crossing, crossing
        # the gradient reduce-scatter (a function Megatron bound at import) is counted, on its native group
        ops = {(o["group"], o["backend"], o["op"]) for o in four_ranks[f"{case}.cpu-forward"][0]["ops"]}
        assert ("DATA_PARALLEL_GROUP_WITH_CP", "bimetal_sim_native", "reduce_scatter_single") in ops, ops


# ---- no process group ----

def test_group_choice_without_a_process_group() -> None:
    from bimetal.errors import UserError
    from bimetal.integrations.megatron.groups import MegatronGroups

    g = MegatronGroups(["nvidia", "nvidia", "amd", "amd"], "device-direct")
    assert g.choose([0, 2], None, "PIPELINE_MODEL_PARALLEL_GROUP") == "bimetal_device_direct"
    assert g.choose([0, 1], "nccl", "TENSOR_MODEL_PARALLEL_GROUP") == "bimetal_sim_native"
    assert g.choose([0, 1, 2, 3], "gloo", "DATA_PARALLEL_GROUP_GLOO") == "gloo"
    with pytest.raises(UserError, match="'ucc'"):
        g.choose([1, 3], "ucc", "PIPELINE_MODEL_PARALLEL_GROUP")
    # device-direct lacks the coalesced reduce-scatter of Megatron's DDP (a run ends there with one sentence, exit 2,
    # through hooks.refuse as a refused layout does)
    with pytest.raises(UserError, match="DATA_PARALLEL_GROUP spans vendors"):
        g.choose([0, 2], None, "DATA_PARALLEL_GROUP")
    assert g.choose([0, 1], None, "DATA_PARALLEL_GROUP") == "bimetal_sim_native"
    table = g.table()
    assert "PIPELINE_MODEL_PARALLEL_GROUP.0" in table and "cross-vendor" in table
    assert MegatronGroups(["nvidia", "amd"], all_gloo=True).choose([0, 1], None, "X") == "gloo"


def test_stand_ins_are_still_needed_and_an_outdated_one_is_noticed() -> None:
    from bimetal.integrations.megatron import cpu_support

    assert cpu_support.outdated() == []  # megatron-core 0.16.1 has every assumption a stand-in answers
    fixed = cpu_support.StandIn("fixed", ("megatron.core.transformer.utils:get_default_causal_mask",),
                                "torch.cuda.no_such_call()")
    saved = cpu_support.STAND_INS
    cpu_support.STAND_INS = (fixed,)
    try:
        lines = cpu_support.outdated()
    finally:
        cpu_support.STAND_INS = saved
    assert len(lines) == 1 and "'fixed'" in lines[0] and "may no longer need it" in lines[0]


# ---- bad input: one sentence, exit 2 ----

def _one_sentence(proc: Any, *needles: str) -> None:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("bimetal ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_missing_megatron_through_the_command(tmp_path: Path) -> None:
    """The command itself (exit status, the one sentence): a ``megatron`` package without megatron-core ahead on
    PYTHONPATH."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    proc = bimetal("megatron", "--simulate", "nvidia:1,amd:1", "--", "scripts/megatron_gpt.py", "--pp", "2",
                   env=env, timeout=150)
    _one_sentence(proc, "megatron-core is not installed")


def _refused_here(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                  *needles: str) -> None:
    """``bimetal ARGV`` by ``bimetal.cli.main`` in this process (refused before any rank starts: no process to pay
    for): exit status 2, one sentence naming ``needles`` on stderr, nothing on stdout."""
    from bimetal.cli import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "", (code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("bimetal megatron: ") and all(n in lines[0] for n in needles), err


def test_unsupported_megatron_release(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # megatron-core's metadata saying 0.12.0, found first on sys.path (as PYTHONPATH puts it for the command)
    meta = tmp_path / "megatron_core-0.12.0.dist-info" / "METADATA"
    meta.parent.mkdir()
    meta.write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.12.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _refused_here(["megatron", "--simulate", "nvidia:1,amd:1", "--", "scripts/megatron_gpt.py", "--pp", "2"], capsys,
                  monkeypatch, "megatron-core 0.12.0 is not a release")


def test_without_simulate_or_a_launcher(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _refused_here(["megatron", "--", "scripts/megatron_gpt.py"], capsys, monkeypatch, "RANK is not set")


@pytest.mark.timeout(300)
def test_a_layout_megatron_refuses() -> None:
    proc = bimetal("megatron", "--simulate", "nvidia:1", "--", "scripts/megatron_gpt.py", "--tp", "2", timeout=250)
    _one_sentence(proc, "megatron-core refused the layout", "not divisible by 2")


@pytest.mark.timeout(300)
def test_initialize_after_megatron_built_its_groups(tmp_path: Path) -> None:
    script = tmp_path / "wrong_order.py"
    script.write_text(textwrap.dedent('''\
        """A script that calls bimetal after Megatron built its groups."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        import bimetal.integrations.megatron as bimetal_megatron

        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel()
        bimetal_megatron.initialize()
        '''))
    proc = bimetal("launch", "--simulate", "nvidia:1", "--", str(script), timeout=250)
    _one_sentence(proc, "initialize_model_parallel already ran", "before it")
