"""``bimetal slurm`` against a real Slurm (``tests/slurm_cluster.py``: munged, slurmctld and a slurmd for each of the
partitions ``nvidia`` and ``amd``, private to the test), scripts submitted with ``sbatch``.

Three jobs, the debug model on a simulated 2 x NVIDIA + 2 x AMD cluster (each component's ranks play its vendor
on CPU): one trains three steps to the end as one hetjob with the cross-vendor pipeline group on a bimetal
transport; one is cancelled with ``scancel`` while it trains, and no rank process may survive it; one asks for a
node fewer than the layout needs and is refused in one sentence before any rank starts; and an elastic job
(``--elastic 1``, one NVIDIA and one AMD GPU) loses a node mid-run and finishes on the other.
Skipped, naming the reason, where Slurm cannot run (no packages, not root); never run against a stand-in.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_inprocess import cli_main
from launcher import ROOT, free_port
from slurm_cluster import SlurmCluster, slurm_unavailable

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SPEC = """[[group]]
name = "{nv}"
vendor = "nvidia"
gpu = "H100"
count = {nv_nodes}
gpus_per_node = {nv_gpus}
nics_per_node = 1
nic_gbps = 100
intra_gbps = 100

[[group]]
name = "amd"
vendor = "amd"
gpu = "MI300X"
count = {amd_nodes}
gpus_per_node = {amd_gpus}
nics_per_node = 1
nic_gbps = 100
intra_gbps = 100
"""
SMALL = ["--data.seq_len=32", "--data.batch_size=4", "--parallel.microbatches=2", "--metrics.log_every=1"]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster({"nvidia": 8, "amd": 8})
    try:
        yield cluster.up()
    finally:
        cluster.down()


@pytest.fixture
def script(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) \
        -> Callable[..., Path]:
    """``make(amd_nodes=1, amd_gpus=2, nv_gpus=2, extra=())``: ``bimetal slurm --simulate`` for demo.toml
    (pp=2 x dp=2) on 1 x ``nv_gpus`` NVIDIA + ``amd_nodes`` x ``amd_gpus`` AMD, its script in ``tmp_path``. The
    command runs in this process (``cli_inprocess``: the console's ``main``, which checks it left nothing behind),
    not a new interpreter per job: writing the script is not what these tests are about."""

    def make(*, amd_nodes: int = 1, amd_gpus: int = 2, nv_gpus: int = 2, extra: tuple[str, ...] = ()) -> Path:
        spec = tmp_path / "spec.toml"
        spec.write_text(SPEC.format(nv="nv", nv_nodes=1, nv_gpus=nv_gpus, amd_nodes=amd_nodes, amd_gpus=amd_gpus))
        out = tmp_path / "job.sbatch"
        code, _, err = cli_main(["slurm", "--config", str(ROOT / "configs" / "demo.toml"), "--cluster", str(spec),
                                 "--simulate", "--partition", "nvidia=nvidia", "--partition", "amd=amd",
                                 "--master-port", str(free_port()), "--out", str(out),
                                 f"--metrics.run_dir={tmp_path / 'run'}", *SMALL, *extra],
                                capsys, monkeypatch, cwd=tmp_path)
        assert code == 0, err
        return out

    return make


def test_hetjob_trains_with_the_cross_vendor_group_on_a_bimetal_transport(slurm: SlurmCluster, tmp_path: Path,
                                                                             script: Callable[..., Path]) -> None:
    job = slurm.sbatch(script(extra=("--training.steps=3",)))
    info = slurm.wait_job(job, 240)
    out = (tmp_path / f"bimetal-{job}.out").read_text()
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", out[-3000:] + slurm.logs()
    assert f"bimetal slurm check: job {job} has the 2 component(s)" in out
    view = out[out.index("bimetal cluster view:"):out.index("bimetal groups")]
    nv, amd = slurm.nodes["nvidia"], slurm.nodes["amd"]
    rows = [line.split()[:4] for line in view.splitlines()[3:] if line.strip()]
    assert rows == [["0", "0", nv, "nvidia"], ["1", "1", nv, "nvidia"], ["2", "0", amd, "amd"], ["3", "1", amd, "amd"]]
    table = {line.split()[0]: line.split() for line in out[out.index("bimetal groups"):].splitlines()[3:7]}
    assert table["pp.dp0"][1:] == ["0,2", "nvidia,amd", "cross-vendor", "bimetal_cpu_forward"], out
    assert table["dp.stage1"][1:3] == ["2,3", "amd"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["xvendor_bytes"] > 0, summary


def test_scancel_stops_every_rank(slurm: SlurmCluster, tmp_path: Path, script: Callable[..., Path]) -> None:
    job = slurm.sbatch(script(extra=("--training.steps=100000",)))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        assert slurm.run("squeue", "-h", "-j", str(job)).stdout.strip(), (tmp_path / f"bimetal-{job}.out").read_text()
        time.sleep(0.5)
    ranks = slurm.ranks(job)
    assert len(ranks) == 4, ranks  # all four ranks are training (step 1 is logged)
    slurm.run("scancel", str(job))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and slurm.processes(job):
        time.sleep(0.5)
    assert not slurm.processes(job), f"still alive after scancel: {slurm.processes(job)}"
    assert slurm.wait_job(job, 30).get("JobState") == "CANCELLED"


def test_component_short_of_a_node_is_refused_before_any_rank(slurm: SlurmCluster, tmp_path: Path,
                                                               script: Callable[..., Path]) -> None:
    """The layout puts AMD on 2 nodes of 1 GPU; the AMD partition has one node, so the script is edited down to
    one, as a user fitting a job to a partition would."""
    sbatch = script(amd_nodes=2, amd_gpus=1)
    text = sbatch.read_text()
    head, amd = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2\n" in amd
    sbatch.write_text(head + "#SBATCH hetjob\n" + amd.replace("#SBATCH --nodes=2\n", "#SBATCH --nodes=1\n"))
    job = slurm.sbatch(sbatch)
    info = slurm.wait_job(job, 120)
    out = (tmp_path / f"bimetal-{job}.out").read_text().strip()
    assert info.get("ExitCode") == "2:0", out + slurm.logs()
    assert out.splitlines() == [
        "bimetal slurm check: hetjob component 1 (partition amd) has 1 node(s), too few for node group 'amd' "
        f"(2 x 1 amd MI300X) of cluster spec {tmp_path / 'spec.toml'}; ask for --nodes=2 there, or submit the script "
        "`bimetal slurm` writes for this config, or fix the cluster spec."], out


def _listener_vendor(port: int) -> str:
    """The vendor (``BIMETAL_VENDOR``) of the process listening on ``port`` here: the agent hosting the rendezvous."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    for pid in re.findall(r"pid=(\d+)", out):
        for var in Path("/proc", pid, "environ").read_bytes().split(b"\0"):
            if var.startswith(b"BIMETAL_VENDOR="):
                return var.split(b"=", 1)[1].decode()
    raise AssertionError(f"nothing of the job listens on port {port}: {out!r}")


def test_elastic_job_loses_a_node_and_finishes_on_the_other(slurm: SlurmCluster, tmp_path: Path,
                                                             script: Callable[..., Path]) -> None:
    """``bimetal slurm --elastic 1``: a torchrun agent per node, one NVIDIA and one AMD GPU; once step 6 is logged
    the node that does not host the rendezvous loses its agent and rank (SIGKILL). (Which one hosts it is a race
    here: both slurmd run on this machine, so both agents take the endpoint for their own; on a cluster it is the
    first node of component 0.) The other agent restarts its rank, which picks pp=1, resumes by itself from the
    newest checkpoint and trains to step 12; the restart line names the lost node and its island. (The job's exit
    code is the killed task's: Slurm reports the lost node.) ``--rdzv-conf`` shortens the agents' waits and is
    checked to reach them."""
    sbatch = script(amd_gpus=1, nv_gpus=1, extra=(
        # 2 restarts: besides the one the lost node takes, one for a round whose rank 0 loses a race for its store's
        # port (torchrun's agent picks a free port and the rank binds it later; both nodes share this machine's
        # ports with the rest of the suite, and once the rank found it taken: EADDRINUSE, a restart used up)
        "--parallel.layout=auto", "--elastic", "1", "--max-restarts", "2", "--training.steps=12",
        "--checkpoint.every=4", "--parallel.timeout_s=20",
        # torch's defaults would wait 3 x 5 s for the lost node's keep-alive, then 30 s for late nodes
        "--rdzv-conf", "last_call_timeout=5,keep_alive_interval=2"))
    port = int(re.search(r"MASTER_PORT:-(\d+)", sbatch.read_text()).group(1))  # type: ignore[union-attr]
    assert sbatch.read_text().count("--rdzv-conf=last_call_timeout=5,keep_alive_interval=2 ") == 2
    job = slurm.sbatch(sbatch)
    log = tmp_path / f"bimetal-{job}.out"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not (log.exists() and "step     6/12" in log.read_text()):
        time.sleep(0.2)
    lost = "amd" if _listener_vendor(port) == "nvidia" else "nvidia"
    left = {"amd": "nvidia", "nvidia": "amd"}[lost]
    killed = []
    for pid in slurm.processes(job):  # that node's torchrun agent and its rank, not Slurm's step daemon
        try:
            env = Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
            cmd = Path("/proc", str(pid), "cmdline").read_bytes()
        except OSError:
            continue
        if f"BIMETAL_VENDOR={lost}".encode() in env and (b"torch.distributed.run" in cmd or b"bimetal.train" in cmd):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    assert len(killed) == 2, (killed, log.read_text()[-3000:])
    slurm.wait_job(job, 200)
    out = log.read_text()
    assert f"parallel.layout='auto' on {left}:1 on 1 node: pp=1 x dp=1" in out, out[-4000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("bimetal restart:")]
    node = slurm.nodes[lost]
    found = re.fullmatch(rf"bimetal restart: lost node {node} \({lost}, rank [01] of 2\); the whole {lost} island; "
                         # the world before in rank order: which vendor was rank 0 is the rendezvous' race
                         rf"world (?:nvidia:1,amd:1|amd:1,nvidia:1) -> {left}:1 on \S+, "
                         r"layout pp=2 x dp=1 x tp=1 = 2 -> pp=1 x dp=1 x tp=1 = 1; going on from the checkpoint of "
                         r"step (\d+) \(\S+\), (\d+) steps? redone \(the job had finished step (\d+)\)\.", line)
    assert found, line
    step, redone, done = (int(g) for g in found.groups())
    assert step in (4, 8) and done >= 6 and redone == done - step, line
    assert [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 13))
