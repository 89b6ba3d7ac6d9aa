"""``bimetal slurm`` and a rank under Slurm, without Slurm: the generated scripts of the shipped configs, Slurm's
environment read into torchrun's, and a mismatched allocation refused in one sentence before training.

``FAKE_HET_STEP`` is a test double: it stands in for the environment ``srun`` gives a task of a hetjob step,
copied from what Slurm 22.05 gave task 3 of the step ``srun --het-group=0 ... : --het-group=1 ...`` (two
components of one node and two tasks each; note the job's node list sorted by name, not by component).
``tests/test_slurm_real.py`` runs the real thing.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import ROOT, clean_env

from bimetal.cli import main as bimetal_main
from bimetal.errors import UserError
from bimetal.plan.spec import load_spec
from bimetal.topology.slurm import (
    PORT_BASE,
    Island,
    adopt,
    check_allocation,
    expand_counts,
    expand_hostlist,
    read_job,
)

CONFIGS = ROOT / "configs"
FAKE_HET_STEP = {
    "SLURM_JOB_ID": "1", "SLURM_HET_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURMD_NODENAME": "amd-node", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_JOB_NODELIST": "amd-node,vm", "SLURM_STEP_NODELIST": "amd-node,vm", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "vm", "SLURM_JOB_NODELIST_HET_GROUP_1": "amd-node",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2",
    "SLURM_JOB_PARTITION_HET_GROUP_0": "nvidia", "SLURM_JOB_PARTITION_HET_GROUP_1": "amd",
    "SLURM_JOB_PARTITION": "amd",
}
TWO = [Island("nv", "nvidia", "H100", 1, 2), Island("amd", "amd", "MI300X", 1, 2)]


def _spec(tmp: Path, groups: list[tuple[str, str, str, int, int]]) -> Path:
    text = ""
    for name, vendor, gpu, count, gpn in groups:
        text += (f'[[group]]\nname = "{name}"\nvendor = "{vendor}"\ngpu = "{gpu}"\ncount = {count}\n'
                 f"gpus_per_node = {gpn}\nnics_per_node = 1\nnic_gbps = 100\nintra_gbps = 100\n\n")
    path = tmp / "spec.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("expr,names", [
    ("vm", ["vm"]),
    ("gpu[01-03,07],amd5", ["gpu01", "gpu02", "gpu03", "gpu07", "amd5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
])
def test_hostlist(expr: str, names: list[str]) -> None:
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["gpu[01-", "gpu[3-1]", "gpu]1", "", "a[x]"])
def test_bad_hostlist_is_one_sentence(expr: str) -> None:
    with pytest.raises(UserError, match="SLURM_X"):
        expand_hostlist(expr, "SLURM_X")


def test_counts() -> None:
    assert expand_counts("8(x2),4", "V") == [8, 8, 4]
    with pytest.raises(UserError, match="V="):
        expand_counts("8x2", "V")


def test_het_step_read_as_torchrun_would_set_it() -> None:
    env = dict(FAKE_HET_STEP)
    job = adopt(env)
    assert job is not None and [c.nodes for c in job.components] == [("vm",), ("amd-node",)]
    assert job.master == "vm"  # component 0's first node, not the first of the job's sorted list
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "BIMETAL_HOST")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "vm",
        "MASTER_PORT": str(PORT_BASE + 1), "BIMETAL_HOST": "amd-node"}


def test_what_is_not_adopted() -> None:
    batch = {k: v for k, v in FAKE_HET_STEP.items() if k != "SLURM_STEP_ID"}  # the batch script: PROCID 0, no step
    assert adopt(batch) is None and "RANK" not in batch
    torchrun = {**FAKE_HET_STEP, "RANK": "5"}  # torchrun under srun numbers the ranks itself
    assert adopt(torchrun) is None and torchrun["RANK"] == "5" and torchrun["BIMETAL_HOST"] == "amd-node"
    single = {**FAKE_HET_STEP, "SLURM_STEP_NUM_TASKS": "1"}  # srun --pty bash: one process, no rendezvous
    assert adopt(single) is None and "RANK" not in single
    preset = {**FAKE_HET_STEP, "MASTER_PORT": "29555", "MASTER_ADDR": "10.0.0.1"}
    adopt(preset)
    assert (preset["MASTER_PORT"], preset["MASTER_ADDR"]) == ("29555", "10.0.0.1")
    plain = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
             "SLURMD_NODENAME": "g2", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NODELIST": "g[1-2]",
             "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    job = adopt(plain)
    assert job is not None and plain["MASTER_ADDR"] == "g1" and plain["LOCAL_WORLD_SIZE"] == "8"


@pytest.mark.parametrize("change,fragment", [
    ({"SLURM_HET_SIZE": "1"}, "has 1 component(s) but cluster spec S lays the job out on 2 (nv, amd)"),
    ({"SLURM_JOB_NODELIST_HET_GROUP_1": "amd[1-2]", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1(x2)"},
     "hetjob component 1 (partition amd) has 2 node(s), too many for node group 'amd' (1 x 2 amd MI300X)"),
    ({"SLURM_TASKS_PER_NODE_HET_GROUP_0": "1"}, "runs 1 task(s) on node vm but node group 'nv'"),
    ({"SLURM_STEP_NUM_TASKS": "3"}, "this Slurm step runs 3 tasks but cluster spec S needs 4 ranks"),
    ({"SLURM_GPUS_ON_NODE": "8"}, "node amd-node of hetjob component 1 has 8 GPU(s) in this job but node group 'amd'"),
])
def test_mismatched_allocation_is_one_sentence(change: dict[str, str], fragment: str) -> None:
    job = read_job({**FAKE_HET_STEP, **change})
    assert job is not None
    with pytest.raises(UserError) as err:
        check_allocation(TWO, job, "cluster spec S", vendor="amd")
    text = str(err.value)
    assert fragment in text and "\n" not in text and text.endswith("."), text
    check_allocation(TWO, read_job(FAKE_HET_STEP), "cluster spec S", vendor="amd")  # type: ignore[arg-type]


def test_swapped_partitions_are_refused_by_the_vendor_check() -> None:
    with pytest.raises(UserError, match=r"rank 3 on node amd-node \(hetjob component 1, partition amd\) runs on "
                                        "nvidia but cluster spec S puts node group 'amd'"):
        check_allocation(TWO, read_job(FAKE_HET_STEP), "cluster spec S", vendor="nvidia")  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"rank 3 on node amd-node \(hetjob component 1\) finds no GPU with its torch "
                                        r"build.*bimetal slurm --python amd=PATH"):
        check_allocation(TWO, read_job(FAKE_HET_STEP), "cluster spec S", vendor="cpu")  # type: ignore[arg-type]


def _rank_env(**extra: str) -> dict[str, str]:
    return {**clean_env(), **FAKE_HET_STEP, **extra}


@pytest.mark.parametrize("entry", [["-m", "bimetal.train", f"--config={CONFIGS / 'demo.toml'}"],
                                   ["-m", "bimetal.integrations.torchtitan", "--module", "llama3", "--config",
                                    "llama3_debugmodel"]], ids=["train", "titan"])
def test_rank_refuses_a_component_short_of_nodes_before_training(entry: list[str], tmp_path: Path) -> None:
    """A rank as srun starts it, in a job whose amd component got one node where the spec has two."""
    spec = _spec(tmp_path, [("nv", "nvidia", "H100", 1, 2), ("amd", "amd", "MI300X", 2, 1)])
    flag = "--parallel.cluster" if "bimetal.train" in entry else "--cluster"
    env = _rank_env(SLURM_TASKS_PER_NODE_HET_GROUP_1="2", BIMETAL_VENDOR="amd")
    proc = subprocess.run([sys.executable, *entry, f"{flag}={spec}"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"hetjob component 1 \(partition amd\) has 1 node\(s\), too few for node "
                                         r"group 'amd' \(2 x 1 amd MI300X\)", lines[0]), proc.stderr
    assert "cluster view" not in proc.stdout


def _components(script: str) -> list[dict[str, str]]:
    """The #SBATCH options of each hetjob component."""
    parts = script.split("#SBATCH hetjob\n")
    return [dict(m.groups() for m in re.finditer(r"^#SBATCH --([\w-]+)=(\S+)$", p, re.M)) for p in parts]


def _generate(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert bimetal_main(["slurm", *args]) == 0
    return capsys.readouterr().out


SHIPPED = sorted(p.name for p in CONFIGS.glob("*.toml") if "cluster =" in p.read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_script_of_each_shipped_config(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bimetal.config import load_config

    cfg = load_config(CONFIGS / name)
    spec = load_spec(cfg.parallel.cluster)
    script = _generate(["--config", str(CONFIGS / name), "--partition", "nvidia=gpu-nv", "--partition",
                        "amd=gpu-amd", "--python", "amd=/opt/rocm-venv/bin/python"], capsys)
    comps = _components(script)
    assert len(comps) == len(spec.groups) == script.count("--het-group=")
    assert [c["partition"] for c in comps] == [f"gpu-{'nv' if g.vendor == 'nvidia' else 'amd'}" for g in spec.groups]
    for c, g in zip(comps, spec.groups):
        assert (int(c["nodes"]), int(c["ntasks-per-node"]), int(c["gpus-per-node"])) == \
            (g.count, g.gpus_per_node, g.gpus_per_node)
    p = cfg.parallel
    assert sum(int(c["nodes"]) * int(c["ntasks-per-node"]) for c in comps) == p.pp * p.dp * p.tp
    srun = script[script.index("\nsrun "):]
    assert srun.count("-m bimetal.train") == len(comps) and f"--config={CONFIGS / name}" in srun
    assert "--het-group=0" in srun.split(":")[0] and "/opt/rocm-venv/bin/python" in srun.split("\\\n  :")[1]
    assert f"--parallel.cluster={(ROOT / p.cluster).resolve()}" in srun
    assert "component 0: node group 'h" in script and ", stage 0" in script and ", stage 1" in script
    assert "slurm check --cluster=" in script and script.index("slurm check") < script.index("\nsrun ")
    assert "BIMETAL_VENDOR" not in script


@pytest.mark.parametrize("spec_path", sorted((CONFIGS / "clusters").glob("*.toml")), ids=lambda p: p.name)
def test_titan_script_of_each_cluster_spec(spec_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    spec = load_spec(spec_path)
    names = [g.name for g in spec.groups]
    plan = tmp_path / "titan.toml"
    plan.write_text(f"[bimetal]\nstage_groups = {list(reversed(names))!r}\n")  # a plan whose stage 0 is the AMD group
    script = _generate(["--titan", "--cluster", str(spec_path), "--plan", str(plan), "--partition", "nvidia=nv",
                        "--partition", "amd=amd", "--", "--module", "llama3", "--config", "llama3_8b"], capsys)
    comps = _components(script)
    assert [c["partition"] for c in comps] == ["amd", "nv"]
    assert all(int(c["gpus-per-node"]) == int(c["ntasks-per-node"]) == 8 for c in comps)
    srun = script[script.index("\nsrun "):]
    assert srun.count("-m bimetal.integrations.torchtitan") == 2 and f"--plan={plan}" in srun
    assert f"--cluster={spec_path}" in srun and srun.rstrip().endswith("--module llama3 --config llama3_8b")
    assert f"--groups={','.join(reversed(names))}" in script


def test_simulated_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, [("nv", "nvidia", "H100", 1, 2), ("amd", "amd", "MI300X", 1, 2)])
    script = _generate(["--config", str(CONFIGS / "demo.toml"), "--cluster", str(spec), "--simulate", "--partition",
                        "nvidia=a", "--partition", "amd=b", "--master-port", "29511", "--cpus-per-task", "2",
                        "--training.steps=3"], capsys)
    comps = _components(script)
    assert [(c["nodes"], c["ntasks-per-node"], c["cpus-per-task"]) for c in comps] == [("1", "2", "2")] * 2
    assert all("gpus-per-node" not in c for c in comps)
    assert "--export=ALL,BIMETAL_VENDOR=nvidia" in script and "--export=ALL,BIMETAL_VENDOR=amd" in script
    assert "export MASTER_PORT=${MASTER_PORT:-29511}" in script
    assert script[script.index("\nsrun "):].count("--training.steps=3") == 2


def test_elastic_script_runs_a_torchrun_agent_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--elastic MIN``: one task per node, each torchrun ``--nnodes MIN:all`` with its vendor's Python and its
    node's GPUs, c10d rendezvous on component 0's first node, and ``--no-kill`` so a lost node ends neither the
    allocation nor the step; the batch step checks the allocation for one agent per node."""
    spec = _spec(tmp_path, [("nv", "nvidia", "H100", 2, 4), ("amd", "amd", "MI300X", 1, 4)])
    script = _generate(["--config", str(CONFIGS / "demo.toml"), "--cluster", str(spec), "--partition", "nvidia=a",
                        "--partition", "amd=b", "--python", "amd=/opt/rocm/py", "--parallel.layout=auto",
                        "--elastic", "1", "--max-restarts", "2"], capsys)
    comps = _components(script)
    assert [(c["nodes"], c["ntasks-per-node"], c["gpus-per-node"]) for c in comps] == [("2", "1", "4"), ("1", "1", "4")]
    assert script.count("\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n") == 1  # a returning agent can join
    assert script.count("#SBATCH --no-kill\n") == 1 and "--elastic" in script.split("slurm check")[1].splitlines()[0]
    assert 'RDZV_HOST=$(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}" | head -n 1)' \
        in script
    srun = script[script.index("\nsrun "):].split("\n  : ")
    for part, python, gpus in zip(srun, (sys.executable, "/opt/rocm/py"), (4, 4)):
        assert f"--no-kill --kill-on-bad-exit=0 --het-group={srun.index(part)} {python} -m torch.distributed.run " \
               f"--nnodes=1:3 --nproc-per-node={gpus} --rdzv-backend=c10d --max-restarts=2 " \
               '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" -m bimetal.train ' in part, part
        assert part.rstrip(" \\\n").endswith("--parallel.layout=auto"), part
    # --rdzv-conf goes to every agent as written, after the checks (torch's defaults where it is not given)
    tuned = _generate(["--config", str(CONFIGS / "demo.toml"), "--cluster", str(spec), "--partition", "nvidia=a",
                       "--partition", "amd=b", "--parallel.layout=auto", "--elastic", "1",
                       "--rdzv-conf", "last_call_timeout=5, keep_alive_interval=1"], capsys)
    agents = tuned[tuned.index("\nsrun "):].split("\n  : ")
    assert len(agents) == 2 and all("--max-restarts=3 --rdzv-conf=last_call_timeout=5,keep_alive_interval=1 "
                                    "--rdzv-endpoint=" in a for a in agents), agents
    assert "--rdzv-conf" not in script
    # the batch step's check: one task per node is right for an elastic job, and wrong for the others
    job = read_job({**FAKE_HET_STEP, "SLURM_TASKS_PER_NODE_HET_GROUP_0": "1", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1"})
    assert job is not None
    check_allocation(TWO, dataclasses.replace(job, task=None), "S", agents=True)
    with pytest.raises(UserError, match="runs 1 task"):
        check_allocation(TWO, dataclasses.replace(job, task=None), "S")
    with pytest.raises(UserError, match="an elastic job runs one torchrun agent per node"):
        check_allocation(TWO, dataclasses.replace(read_job(FAKE_HET_STEP), task=None), "S", agents=True)  # type: ignore


QWEN = ["--config", str(CONFIGS / "qwen2-7b-2x8.toml")]
ELASTIC = ["--config", str(CONFIGS / "demo.toml"), "--cluster", str(CONFIGS / "clusters" / "h100_mi300x.toml"),
           "--partition", "nvidia=a", "--partition", "amd=b"]


@pytest.mark.parametrize("args,fragment", [
    (QWEN + ["--partition", "nvidia=a"], "no partition for node group 'mi325x'"),
    (QWEN + ["--partition", "nvidia=a", "--partition", "intel=b"], "'intel' is neither a vendor nor a node group"),
    (QWEN + ["--partition", "nvidia"], "must be KEY=VALUE"),
    (QWEN + ["--partition", "nvidia=a", "--partition", "amd=b", "--parallel.dp=4", "--parallel.dp_shard=4"],
     "needs 8 ranks but configs/clusters/h200_mi325x.toml has 16 GPUs"),
    (["--titan", "--simulate", "--cluster", str(CONFIGS / "clusters" / "h100_mi300x.toml")],
     "--simulate with --titan is not supported"),
    (["--titan", "--partition", "nvidia=a"], "--titan needs --cluster SPEC"),
    (QWEN + ["--titan"], "--config is a `bimetal train` config"),
    (QWEN + ["--partition", "nvidia=a", "--partition", "amd=b", "--master-port", "70000"], "is not a TCP port"),
    (ELASTIC + ["--elastic", "1"], '--elastic needs parallel.layout = "auto"'),
    (ELASTIC + ["--elastic", "3", "--parallel.layout=auto"], "--elastic 3 must be from 1 to the 2 node(s)"),
    (ELASTIC + ["--elastic", "0", "--parallel.layout=auto"], "--elastic 0 must be from 1"),
    (ELASTIC + ["--max-restarts", "2"], "--max-restarts goes with --elastic"),
    (ELASTIC + ["--elastic", "1", "--max-restarts", "-1"], "--max-restarts -1 must be zero or more"),
    (["--titan", "--elastic", "1", "--cluster", str(CONFIGS / "clusters" / "h100_mi300x.toml")],
     "a --titan job cannot run elastically"),
    (ELASTIC + ["--rdzv-conf", "last_call_timeout=5"], "--rdzv-conf sets the rendezvous of an elastic job"),
    (ELASTIC + ["--elastic", "1", "--parallel.layout=auto", "--rdzv-conf", "last_cal_timeout=5"],
     "'last_cal_timeout=5' is not KEY=N with KEY one of join_timeout"),
    (ELASTIC + ["--elastic", "1", "--parallel.layout=auto", "--rdzv-conf", "is_host=true"],
     "'is_host=true' is not KEY=N"),
    (ELASTIC + ["--elastic", "1", "--parallel.layout=auto", "--rdzv-conf", "last_call_timeout=0"],
     "last_call_timeout must be given once, as a whole number of at least 1"),
    (ELASTIC + ["--elastic", "1", "--parallel.layout=auto", "--rdzv-conf", "join_timeout=9,join_timeout=60"],
     "join_timeout must be given once"),
])
def test_bad_generator_input(args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = bimetal_main(["slurm", *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_no_cluster_spec_and_check_outside_a_job(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert bimetal_main(["slurm", "--config", str(CONFIGS / "demo.toml"), "--partition", "nvidia=a"]) == 2
    assert "names no cluster spec" in capsys.readouterr().err
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert bimetal_main(["slurm", "check", "--cluster", str(CONFIGS / "clusters" / "h100_mi300x.toml")]) == 2
    assert "runs inside a Slurm job" in capsys.readouterr().err
