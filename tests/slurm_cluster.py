"""A real, private Slurm on this machine for tests: ``munged``, ``slurmctld`` and one ``slurmd`` per partition.

Debian's ``slurm-wlm`` is built without multiple-slurmd support, and its backfill scheduler (the only one that
starts hetjobs) will not put two components of one hetjob on one node. So each partition gets a node of its own:
two ``slurmd`` daemons on this host, each started for its node name (``slurmd -N``) on its own port, both reached
at 127.0.0.1. The first node is named after this host, so the ranks' master address (the first node of component
0) resolves. Nothing is shared with another Slurm on the machine: a generated ``slurm.conf`` with a unique cluster
name and ports from ``free_port``, state, spool, logs and munge's socket and key in a private temporary folder;
clients find it through ``SLURM_CONF``. ``proctrack/linuxproc`` and ``task/none``: no cgroup plugins.

``down`` (always called, also after a failure) cancels every job, stops the daemons it started by their PIDs,
kills by PID any process left whose environment names this cluster's ``SLURM_CONF`` (a step daemon, a rank), and
removes the folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from launcher import clean_env, free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


def slurm_unavailable() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a private Slurm needs root (slurmd starts the job's tasks, munged guards its key)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian packages slurm-wlm and munge); run `make test` as root "
                "or `sudo apt-get install slurm-wlm munge`")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        return f"this host's name {host!r} does not resolve, and the ranks reach the first Slurm node by its name"
    return None


class SlurmCluster:
    """``partitions``: partition name -> CPUs its one node offers (more than the machine has is fine:
    ``SlurmdParameters=config_overrides``)."""

    def __init__(self, partitions: dict[str, int]):
        self.partitions = partitions
        self.root = Path(tempfile.mkdtemp(prefix="bm-slurm-"))  # 0700, short: munge's socket path must fit
        self.name = "bm" + uuid.uuid4().hex[:8]
        host = socket.gethostname().split(".")[0]
        self.nodes = {p: host if i == 0 else f"{self.name}-{p}" for i, p in enumerate(partitions)}
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in clean_env(**extra).items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}\n{self.logs()}")
        return proc

    def _start(self, key: str, cmd: list[str]) -> None:
        log = open(self.root / f"{key}.stderr", "w")  # noqa: SIM115 (closed with the process's end)
        self.procs[key] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def up(self) -> SlurmCluster:
        r = self.root
        (r / "state").mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge.sock"
        self._start("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                               f"--seed-file={r / 'munged.seed'}"])
        self._wait(sock.exists, 10, "munged's socket")
        (r / "plugstack.conf").write_text("")
        host = next(iter(self.nodes.values()))
        lines = [f"ClusterName={self.name}", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={free_port()}",
                 "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
                 f"AuthInfo=socket={sock}", f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r}/spool-%n",
                 f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r}/slurmd-%n.pid",
                 f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r}/slurmd-%n.log",
                 "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
                 "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
                 "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
                 "SlurmdParameters=config_overrides", f"PlugStackConfig={r / 'plugstack.conf'}",
                 # hetjobs start only in backfill passes: run one every second, not every 30 s
                 "SchedulerParameters=bf_interval=1", "KillWait=3"]
        for part, cpus in self.partitions.items():
            lines.append(f"NodeName={self.nodes[part]} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} "
                         "RealMemory=1000 State=UNKNOWN")
        for part in self.partitions:
            lines.append(f"PartitionName={part} Nodes={self.nodes[part]} MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes.values():
            self._start(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(self._idle, 30, "both Slurm nodes idle")
        return self

    def _idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes.values())

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"no {what} after {timeout} s\n{self.logs()}")

    def logs(self) -> str:
        tails = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stderr")):
            text = f.read_text(errors="replace").strip().splitlines()[-8:]
            tails.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def sbatch(self, script: Path) -> int:
        return int(self.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` of the job (its first component) as key -> value."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False).stdout.splitlines()
        fields: dict[str, str] = {}
        for word in (out[0].split() if out else []):
            k, _, v = word.partition("=")
            fields.setdefault(k, v)
        return fields

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended (every component)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).stdout.split()
            if not states:
                return self.job(job_id)
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {states} after {timeout} s\n{self.logs()}")

    def processes(self, job_id: int | None = None) -> list[int]:
        """PIDs whose environment names this cluster's SLURM_CONF (and ``SLURM_JOB_ID=job_id`` when given)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        job = f"SLURM_JOB_ID={job_id}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                env = Path("/proc", entry, "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if mine in env and (job_id is None or job in env):
                pids.append(int(entry))
        return pids

    def ranks(self, job_id: int) -> list[int]:
        """PIDs of the job's tasks running ``python -m bimetal.train`` (not srun, whose arguments name it too)."""
        out = []
        for pid in self.processes(job_id):
            try:
                cmd = Path("/proc", str(pid), "cmdline").read_bytes().split(b"\0")
                env = Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[1:3] == [b"-m", b"bimetal.train"] and any(e.startswith(b"SLURM_STEP_ID=") for e in env):
                out.append(pid)
        return out

    def down(self) -> None:
        try:
            if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                self.run("scancel", "--user=root", check=False)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                    time.sleep(0.5)
        finally:
            for key in [k for k in self.procs if k.startswith("slurmd")] + ["slurmctld", "munged"]:  # munge last
                proc = self.procs.get(key)
                if proc is None or proc.poll() is not None:
                    continue
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            for pid in self.processes():  # a step daemon or a rank that outlived its job: this cluster's, by PID
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.root, ignore_errors=True)
