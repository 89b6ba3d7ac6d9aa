"""First contact: the commands a new user types, as subprocesses, end in a sensible run or one sentence.

Every refusal: exit status 2, one line on stderr starting ``bimetal``, no traceback, no torchrun dump, and
nothing written to the run folder; one case per family through the console script, the rest by ``bimetal.cli.main``
in this process (``cli_inprocess``). The multi-rank rows (a run with no config, a rank that dies, SIGTERM to
``bimetal train``, an error only a rank can see, a device-direct fallback) are few and a handful of steps
long; but for the SIGTERM one (sent to the console script) they run side by side as ``python -m bimetal.train
--simulate ...`` (the ``bimetal train`` command's own ``main``: its checks, then the launcher of the job's ranks)
forked from one interpreter that imported the trainer once (``tests/forked_runs.py``), not a new interpreter
importing it per run (~3.5 s of CPU each). The in-process catalogue of bad inputs is ``test_bad_inputs.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
from cli_inprocess import cli_main
from launcher import clean_env

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.toml")
BIMETAL = str(Path(sys.executable).parent / "bimetal")
pytestmark = pytest.mark.timeout(180)
TINY = ["--data.seq_len=32", "--data.batch_size=2", "--parallel.microbatches=2"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([BIMETAL, *args], env=env or clean_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _binary(t: Path) -> str:
    path = t / "weights.txt"
    path.write_bytes(bytes(range(256)) * 64)  # not UTF-8 text
    return str(path)


def _wide_bin(t: Path) -> str:
    path = t / "tokens.bin"
    np.full(4096, 60000, dtype=np.uint16).tofile(path)  # ids far beyond the byte tokenizer's 258
    return str(path)


# (case id, environment additions, argv builder taking tmp_path, fragment of the one sentence)
REFUSALS: list[tuple[str, dict[str, str], Callable[[Path], list[str]], str]] = [
    ("no-simulate-outside-torchrun", {}, lambda t: ["train", "--config", DEMO], "add --simulate"),
    ("simulate-without-count", {}, lambda t: ["train", "--simulate", "nvidia"], "bad simulation entry 'nvidia'"),
    ("layout-vs-world", {}, lambda t: ["train", "--config", DEMO, "--simulate", "nvidia:1,amd:1"],
     "needs 4 ranks but --simulate gives 2"),
    ("seq-len-zero", {}, lambda t: ["train", "--simulate", "nvidia:2,amd:2", "--data.seq_len=0"], "data.seq_len=0"),
    ("lr-nan", {}, lambda t: ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2", "--optim.lr=nan"],
     "optim.lr=nan"),
    ("lr-negative", {}, lambda t: ["train", "--simulate", "nvidia:2,amd:2", "--optim.lr=-0.1"], "optim.lr=-0.1"),
    ("steps-negative", {}, lambda t: ["train", "--simulate", "nvidia:2,amd:2", "--training.steps=-1"],
     "training.steps=-1"),
    ("batch-zero", {}, lambda t: ["train", "--simulate", "nvidia:2,amd:2", "--data.batch_size=0"],
     "data.batch_size=0"),
    ("data-not-text", {}, lambda t: ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2",
                                     f"--data.path={_binary(t)}"], "is not UTF-8 text"),
    ("data-not-tokens", {}, lambda t: ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2",
                                       f"--data.path={_wide_bin(t)}"], "holds token id 60000"),
    ("cf-stripes-abc", {"BIMETAL_CF_STRIPES": "abc"}, lambda t: ["train", "--config", DEMO, "--simulate",
                                                                 "nvidia:2,amd:2"], "BIMETAL_CF_STRIPES='abc'"),
    ("dd-slots-zero", {"BIMETAL_DD_SLOTS": "0"}, lambda t: ["train", "--config", DEMO, "--simulate", "nvidia:2,amd:2"],
     "BIMETAL_DD_SLOTS='0'"),
    ("fault-kill-malformed", {"BIMETAL_FAULT_KILL": "3"}, lambda t: ["train", "--simulate", "nvidia:1,amd:1"],
     "BIMETAL_FAULT_KILL='3'"),
    ("negative-restarts", {}, lambda t: ["train", "--simulate", "nvidia:1,amd:1", "--max-restarts=-1"],
     "--max-restarts=-1"),
    ("plan-global-batch-zero", {}, lambda t: ["plan", str(ROOT / "configs" / "clusters" / "h200_mi325x.toml"),
                                              "--global-batch", "0"], "--global-batch 0"),
]


def _one_sentence(proc: subprocess.CompletedProcess, fragment: str) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bimetal "), err
    assert fragment in lines[0], err
    assert "Traceback" not in err and "ChildFailedError" not in err, err


# The cases run through the real console script (a subprocess: the exit status and the sentence shown for real),
# one per family: a command-line value and a BIMETAL_* variable. The rest run ``bimetal.cli.main`` in this process
# (cli_inprocess: a refusal comes before any rank starts, so there is no process to pay for).
THROUGH_CONSOLE = ("no-simulate-outside-torchrun", "cf-stripes-abc")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The console-script cases, run once and side by side (each is a process start and a torch import, ~3 s)."""
    def one(case: tuple[str, dict[str, str], Callable[[Path], list[str]], str]):
        name, extra, build, _ = case
        folder = tmp_path_factory.mktemp(name)
        args = build(folder)
        if args[0] == "train":
            args.append(f"--metrics.run_dir={folder / 'run'}")
        return name, (_run(args, clean_env(**extra), timeout=120), folder / "run")

    with ThreadPoolExecutor(len(THROUGH_CONSOLE)) as pool:
        return dict(pool.map(one, [c for c in REFUSALS if c[0] in THROUGH_CONSOLE]))


@pytest.mark.parametrize(("name", "fragment"), [(c[0], c[3]) for c in REFUSALS if c[0] in THROUGH_CONSOLE],
                         ids=[c[0] for c in REFUSALS if c[0] in THROUGH_CONSOLE])
def test_refused_before_any_rank_starts(refusals, name: str, fragment: str) -> None:
    proc, run_dir = refusals[name]
    _one_sentence(proc, fragment)
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
    assert "bimetal cluster view" not in proc.stdout  # no rank started


@pytest.mark.parametrize(("extra", "build", "fragment"), [c[1:] for c in REFUSALS if c[0] not in THROUGH_CONSOLE],
                         ids=[c[0] for c in REFUSALS if c[0] not in THROUGH_CONSOLE])
def test_refused_before_any_rank_starts_in_process(extra: dict[str, str], build: Callable[[Path], list[str]],
                                                   fragment: str, tmp_path: Path, capsys, monkeypatch) -> None:
    args = build(tmp_path)
    run_dir = tmp_path / "run"
    if args[0] == "train":
        args.append(f"--metrics.run_dir={run_dir}")
    code, out, err = cli_main(args, capsys, monkeypatch, env=extra, cwd=ROOT)
    _one_sentence(subprocess.CompletedProcess(args, code, out, err), fragment)
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
    assert "bimetal cluster view" not in out  # no rank started


# (name, argv after ``bimetal train``, environment additions) of the runs that start ranks, each in a folder of its own
RUNS: list[tuple[str, list[str], dict[str, str]]] = [
    ("no-config", ["--simulate", "nvidia:2,amd:2", "--training.steps=2", *TINY], {}),
    # an RDMA device that this host does not have is found by the ranks when they start their engines
    ("rank-sees-error", ["--simulate", "nvidia:1,amd:1", "--parallel.pp_transport=device-direct", "--training.steps=2",
                         *TINY], {"BIMETAL_DD_PROTOCOL": "rdma", "BIMETAL_DD_FALLBACK": "error",
                                  "BIMETAL_DD_DEVICES": "mlx5_9"}),
    ("two-versions", ["--simulate", "nvidia:1,amd:1", "--training.steps=2", *TINY],
     {"BIMETAL_TEST_CLAIM_VERSIONS": "1:bimetal=0.0.9"}),
    ("dd-fallback", ["--simulate", "nvidia:1,amd:1", "--parallel.pp_transport=device-direct", "--training.steps=2",
                     *TINY], {"BIMETAL_DD_PROTOCOL": "rdma", "BIMETAL_DD_FALLBACK": "cpu-forward"}),
    ("rank-dies", ["--simulate", "nvidia:1,amd:1", "--training.steps=4", *TINY], {"BIMETAL_FAULT_KILL": "1:2"}),
]


@pytest.fixture(scope="module")
def runs_done(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every run of ``RUNS``, once and side by side (see the module docstring): name -> (result, its run folder)."""
    from forked_runs import runs

    folders = {name: tmp_path_factory.mktemp(name) / "run" for name, _, _ in RUNS}
    done = runs([(["-m", "bimetal.train", *args, f"--metrics.run_dir={folders[name]}"], ROOT)
                 for name, args, _ in RUNS], env=clean_env(), envs=[clean_env(**extra) for _, _, extra in RUNS],
                timeout=200)
    return {name: (proc, folders[name]) for (name, _, _), proc in zip(RUNS, done)}


@pytest.mark.timeout(240)
def test_simulate_without_config_chooses_the_layout_and_trains_as_one_job(runs_done) -> None:
    proc, run_dir = runs_done["no-config"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "layout chosen from the 4 simulated ranks: pp=2 x dp=2" in out, out[:2000]
    assert "pp.dp0" in out and "dp.stage1" in out, out[:3000]  # one job of four ranks, not four jobs
    assert [line.split("|")[0].split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["pp_transport"] == "bimetal_cpu_forward", summary
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
def test_an_error_only_a_rank_sees_is_one_sentence_from_the_launcher(runs_done) -> None:
    proc, run_dir = runs_done["rank-sees-error"]
    _one_sentence(proc, "the device-direct engine could not start")
    assert "BIMETAL_DD_DEVICES (or the devices option) names mlx5_9, which is not an RDMA device of this host" \
        in proc.stderr, proc.stderr
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


@pytest.mark.timeout(240)
def test_ranks_of_two_bimetal_versions_are_refused_naming_both(runs_done) -> None:
    """Rank 1 claims another bimetal release (the test hook ``BIMETAL_TEST_CLAIM_VERSIONS``): the topology
    exchange stops both ranks with one sentence naming the two ranks and their versions, before any group."""
    proc, run_dir = runs_done["two-versions"]
    _one_sentence(proc, "bimetal train: ranks 0 and 1 run different bimetal versions (rank 0: 0.1.0, rank 1: 0.0.9); "
                        "install one bimetal release on every node.")
    assert "bimetal groups" not in proc.stdout and not run_dir.exists()


@pytest.mark.timeout(240)
def test_device_direct_fallback_is_labelled_in_the_table_and_the_summary(runs_done) -> None:
    proc, run_dir = runs_done["dd-fallback"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = proc.stdout.split("bimetal groups", 1)[1].split("step ", 1)[0]
    assert "bimetal_cpu_forward (fallback from bimetal_device_direct)" in table, table
    assert "pp transport  bimetal_cpu_forward (device-direct fell back" in proc.stdout, proc.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pp_transport"] == "bimetal_cpu_forward" and "falls back" in summary["pp_transport_fallback"]
    warnings = [line for line in proc.stderr.splitlines() if "falls back to cpu-forward" in line]
    assert warnings and all(line.startswith("[rank ") for line in warnings), proc.stderr  # each rank's, prefixed


@pytest.mark.timeout(240)
def test_a_rank_that_dies_is_named_with_its_vendor_signal_and_step(runs_done) -> None:
    proc = runs_done["rank-dies"][0]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == "bimetal train: rank 1 (amd) was killed by SIGKILL after completing step 2; the job stopped.", \
        proc.stderr
    # the survivor is not reported dead: it stopped because rank 1 died, and where it stopped is its reason
    assert lines[1].startswith("bimetal train: rank 0 (nvidia) stopped because rank 1 died (first reason given: "
                               "rank 0 stopped in step 3"), proc.stderr
    assert len(lines) == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr


def test_sigterm_to_bimetal_train_stops_every_rank(tmp_path: Path) -> None:
    proc = subprocess.Popen([BIMETAL, "train", "--simulate", "nvidia:1,amd:1", "--training.steps=100000", *TINY,
                             f"--metrics.run_dir={tmp_path / 'run'}"], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # training has begun once the first step line is out
            if line.startswith("step ") or time.monotonic() > deadline:
                break
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 2, ranks
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM: all 2 ranks it started are stopped" in err, err
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, alive


def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0, "mfu": None, "lr": 1e-3,
            "xvendor_comm_s": 0.01, "xvendor_bytes": 2_000_000, "step_s": 2.0}


def test_step_line_is_a_progress_bar_on_a_terminal_and_plain_lines_elsewhere() -> None:
    import io

    from bimetal.train.console import StepConsole

    plain = io.StringIO()
    console = StepConsole(total=10, log_every=5, stream=plain, tty=False)
    for step in range(1, 11):
        console.show(_record(step))
    lines = plain.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["step     5/10", "step    10/10"], lines
    assert "\r" not in plain.getvalue() and "eta 10s" in lines[0] and "eta 0s" in lines[1], lines

    term = io.StringIO()
    console = StepConsole(total=10, log_every=5, stream=term, tty=True)
    for step in range(1, 4):
        console.show(_record(step))
    frames = term.getvalue().split("\r")
    assert frames[-1].startswith("\x1b[K[#######.................]  30% step 3/10 loss 4.7000 eta 14s"), frames
    assert "\n" not in term.getvalue()  # redrawn in place until a log_every step


BAD_VALUES = {"BIMETAL_SIMULATE": "nvidia", "BIMETAL_LAUNCH_FORK": "yes", "BIMETAL_VENDOR": "intel",
              "BIMETAL_CF_STRIPES": "abc",
              "BIMETAL_CF_IFACES": "eth0,,eth1", "BIMETAL_CF_CHUNK_BYTES": "512", "BIMETAL_CF_POOL_BUFFERS": "1",
              "BIMETAL_CF_CHECKSUM": "yes", "BIMETAL_CF_FORCE_STAGING": "on", "BIMETAL_SIMULATE_DEVICE": "gpu",
              "BIMETAL_CF_STALL_S": "nan", "BIMETAL_DD_PROTOCOL": "ib",
              "BIMETAL_DD_ENGINE": "nixl", "BIMETAL_DD_HOST": "not-an-ip", "BIMETAL_DD_CHUNK_BYTES": "0",
              "BIMETAL_DD_SLOTS": "0", "BIMETAL_DD_WINDOW": "-1", "BIMETAL_DD_INLINE_BYTES": "999999",
              "BIMETAL_DD_FALLBACK": "maybe", "BIMETAL_DD_DEVICE": "gpu0",
              "BIMETAL_DD_DEVICES": "mlx5_0,,mlx5_1", "BIMETAL_DD_REG_CACHE_BYTES": "0", "BIMETAL_THREADS": "1.5",
              "BIMETAL_HOST": " ", "BIMETAL_LAB": " ", "BIMETAL_LAB_RANK_ENV": "[1]",
              "BIMETAL_FAULT_KILL": "3:x", "BIMETAL_FAULT_KILL_IN_CHECKPOINT": "1",
              "BIMETAL_FAULT_STALL": "3:3", "BIMETAL_TRACEBACK": "true",
              "BIMETAL_LAUNCH_REPORT": " ", "BIMETAL_IFACES": "eth0,", "BIMETAL_REACH_S": "-1",
              "BIMETAL_TEST_CLAIM_VERSIONS": "1:foo=2", "BIMETAL_DD_GID_INDEX": "fe80::1",
              "BIMETAL_SYSFS": "/no/such/sysfs-copy"}


def test_every_bimetal_variable_the_code_reads_is_checked_before_launch() -> None:
    import re

    from bimetal.env import VARIABLES, check_environment
    from bimetal.errors import UserError

    read = {name for path in (ROOT / "bimetal").rglob("*.py")
            for name in re.findall(r"BIMETAL_[A-Z_]*[A-Z]\b", path.read_text())}
    assert read <= set(VARIABLES), f"add {sorted(read - set(VARIABLES))} to bimetal.env.VARIABLES"
    assert set(BAD_VALUES) == set(VARIABLES)
    for name, bad in BAD_VALUES.items():
        with pytest.raises(UserError, match=name):
            check_environment({name: bad})
    assert check_environment({"BIMETAL_CF_STRIPES": "2", "BIMETAL_DD_SLOTS": "8", "BIMETAL_FAULT_STALL": "3:3:300",
                              "BIMETAL_CF_STRIPE": "2", "BIMETAL_DD_HOST": "10.0.0.1"}) == ["BIMETAL_CF_STRIPE"]
    # the stall's attempt is optional and whole; no field after it
    assert check_environment({"BIMETAL_FAULT_STALL": "0:8:120:1"}) == []
    for bad in ("0:8:120:1.5", "0:8:120:1:2"):
        with pytest.raises(UserError, match="BIMETAL_FAULT_STALL"):
            check_environment({"BIMETAL_FAULT_STALL": bad})
