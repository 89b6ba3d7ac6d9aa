"""``LabCluster``: bring an emulated cluster up from a ``LabSpec``, run torchrun jobs on it, tear it down.

Ownership: a lab's state file ``/run/bimetal-lab/<id>.json`` records the pid (and its start time) of the
process that owns it, or owner 0 for a lab left up on purpose (``bimetal lab up``). Any later ``up()``
first removes every lab whose owner is dead or whose state file is missing: that is how the namespaces
and cgroups of a killed run disappear. Teardown runs from ``__exit__``/``finally`` and from SIGTERM/SIGHUP
(turned into SystemExit), so success, failure and Ctrl-C all leave nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from bimetal.errors import UserError
from bimetal.lab import cgroup, net
from bimetal.lab.spec import LabSpec

_log = logging.getLogger(__name__)

STATE_DIR = Path("/run/bimetal-lab")
MASTER_PORT = 29400


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _state_path(lab_id: str) -> Path:
    return STATE_DIR / f"{lab_id}.json"


def read_state(lab_id: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads(_state_path(lab_id).read_text()))
    except (OSError, ValueError):
        return None


def owner_alive(state: dict[str, Any] | None) -> bool:
    """True for a lab left up on purpose (owner 0) or one whose owning process still runs."""
    if state is None:
        return False
    pid = int(state.get("owner_pid", -1))
    if pid == 0:
        return True
    return pid > 0 and _start_time(pid) == state.get("owner_start")


def all_lab_ids() -> set[str]:
    ids = net.lab_ids_in_kernel() | cgroup.lab_ids_in_cgroups()
    if STATE_DIR.exists():
        ids |= {p.stem for p in STATE_DIR.glob("*.json")}
    return ids


def remove_lab(lab_id: str) -> list[str]:
    """Remove every kernel object and the state file of ``lab_id``; returns what was removed."""
    removed = net.delete_lab_namespaces(lab_id)
    for path in cgroup.lab_cgroups(lab_id):
        cgroup.remove(path)
        removed.append(str(path))
    _state_path(lab_id).unlink(missing_ok=True)
    return removed


def cleanup_stale() -> list[str]:
    """Remove labs whose owner died; returns the ids removed."""
    stale = [i for i in sorted(all_lab_ids()) if not owner_alive(read_state(i))]
    for lab_id in stale:
        remove_lab(lab_id)
    return stale


@dataclass
class NodeResult:
    """What one node's torchrun did: its exit status and (when captured) its output."""

    node: str
    returncode: int
    output: str


@dataclass
class Elastic:
    """torchrun's elastic launch for a lab job: ``--nnodes MIN:MAX`` (MAX: the lab's nodes), c10d rendezvous on
    node 0, ``--max-restarts``. The rendezvous timeouts are short (a lab's nodes start within seconds)."""

    min_nodes: int
    max_restarts: int
    run_id: str
    conf: str = "join_timeout=60,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


class LabCluster:
    """A lab on this machine. Use as a context manager: ``with LabCluster(spec) as lab: lab.run([...])``."""

    def __init__(self, spec: LabSpec, persistent: bool = False) -> None:
        self.spec = spec
        self.persistent = persistent
        self.is_up = False
        self._old_handlers: dict[int, Any] = {}

    # --- naming -------------------------------------------------------------------------------------
    def namespace(self, node: str) -> str:
        return net.ns_name(self.spec.lab_id, node)

    @property
    def hub(self) -> str:
        return net.hub_name(self.spec.lab_id)

    def node_index(self, node: str) -> int:
        for i, n in enumerate(self.spec.nodes):
            if n.name == node:
                return i
        raise UserError(f"lab {self.spec.lab_id} has no node {node!r}; nodes: {[n.name for n in self.spec.nodes]}")

    def address(self, node: str, nic: int = 0) -> str:
        return net.nic_address(nic, self.node_index(node))

    def nics(self, node: str) -> list[str]:
        return [net.nic_name(k) for k in range(self.spec.nodes[self.node_index(node)].nics)]

    @property
    def master_addr(self) -> str:
        return self.address(self.spec.nodes[0].name, 0)

    # --- life cycle ---------------------------------------------------------------------------------
    def up(self) -> LabCluster:
        net.require_root()
        if any(s is not None for n in self.spec.nodes for s in n.cpu_share):
            cgroup.require_cpu_controller()
        cleanup_stale()
        lab_id = self.spec.lab_id
        if owner_alive(read_state(lab_id)):
            state = read_state(lab_id) or {}
            raise UserError(
                f"lab {lab_id!r} is already up (owner pid {state.get('owner_pid')}); "
                f"run 'bimetal lab down --id {lab_id}' or pick another lab.name"
            )
        self._install_signal_handlers()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        # The state file comes first, owned by this process: if we die half way, the next run removes it all.
        me = os.getpid()
        state = {"lab_id": lab_id, "owner_pid": me, "owner_start": _start_time(me), "source": self.spec.source,
                 "nodes": [n.name for n in self.spec.nodes], "created": time.time()}
        _state_path(lab_id).write_text(json.dumps(state))
        try:
            net.build_network(lab_id, [(n.name, n.nics, n.rate_mbit, n.latency_ms) for n in self.spec.nodes])
            if cgroup.CPU_ROOT.exists():
                for n in self.spec.nodes:
                    for r in range(n.ranks):
                        cgroup.create(cgroup.rank_cgroup(lab_id, n.name, r), n.cpu_share[r])
        except BaseException:
            self.down()
            raise
        if self.persistent:
            state["owner_pid"] = 0
            _state_path(lab_id).write_text(json.dumps(state))
        self.is_up = True
        return self

    def down(self) -> list[str]:
        removed = remove_lab(self.spec.lab_id)
        self.is_up = False
        self._restore_signal_handlers()
        return removed

    def __enter__(self) -> LabCluster:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    def _install_signal_handlers(self) -> None:
        def to_exit(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        if not hasattr(signal, "SIGHUP"):
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, to_exit)
            except ValueError:  # not the main thread: the owner must tear down itself
                return

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # --- running ------------------------------------------------------------------------------------
    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``node``'s network namespace.

        ``nsenter --net`` rather than ``ip netns exec``: the latter remounts /sys for the namespace, which
        hides /sys/fs/cgroup, so a rank could not join its CPU cgroup.
        """
        return ["nsenter", f"--net={net.NETNS_DIR}/{self.namespace(node)}", "--", *argv]

    def popen(self, node: str, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start any program inside ``node``'s namespace (own session, so teardown can kill its group)."""
        return subprocess.Popen(self.exec_argv(node, argv), env=env, start_new_session=True, **kwargs)

    def node_env(self, node: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a node's ranks: simulated vendor, host name, and Gloo/c10d bound to NIC 0."""
        n = self.spec.nodes[self.node_index(node)]
        env = {k: v for k, v in os.environ.items() if k not in ("BIMETAL_SIMULATE", "MASTER_ADDR", "MASTER_PORT")}
        env.update({
            "BIMETAL_VENDOR": n.vendor,
            "BIMETAL_HOST": node,
            "BIMETAL_LAB": self.spec.lab_id,
            "GLOO_SOCKET_IFNAME": net.nic_name(0),
            "TP_SOCKET_IFNAME": net.nic_name(0),
            "OMP_NUM_THREADS": "1",
        })
        env.update(extra or {})
        return env

    def torchrun_argv(self, node: str, rank_argv: Sequence[str], master_port: int = MASTER_PORT,
                      elastic: Elastic | None = None) -> list[str]:
        """The torchrun command line of one node; each rank first joins its CPU cgroup.

        ``elastic``: node 0 hosts the c10d rendezvous (``is_host``: every namespace has the same host name, so
        torchrun cannot tell which node the endpoint is), and each node gives its own address (``--local-addr``),
        where the ranks of a round reach the store of the node that is rank 0 of its first round.
        """
        i = self.node_index(node)
        n = self.spec.nodes[i]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n.ranks}"]
        if elastic is None:
            cmd += [f"--nnodes={len(self.spec.nodes)}", f"--node-rank={i}", f"--master-addr={self.master_addr}",
                    f"--master-port={master_port}", "--max-restarts=0"]
        else:
            cmd += [f"--nnodes={elastic.min_nodes}:{len(self.spec.nodes)}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.master_addr}:{master_port}", f"--rdzv-id={elastic.run_id}",
                    f"--rdzv-conf={elastic.conf},is_host={'true' if i == 0 else 'false'}",
                    f"--local-addr={self.address(node)}", f"--max-restarts={elastic.max_restarts}",
                    "--monitor-interval=0.5"]
        if cgroup.CPU_ROOT.exists():
            base = str(cgroup.cgroup_base(self.spec.lab_id, node))
            return [*cmd, str(Path(cgroup.__file__).resolve()), "enter", base, "--", *rank_argv]
        return [*cmd, *rank_argv] if rank_argv[0] != "-m" else [*cmd, "--module", *rank_argv[1:]]

    def run(self, rank_argv: Sequence[str], timeout: float = 600, extra_env: dict[str, str] | None = None,
            capture: bool = False, master_port: int = MASTER_PORT, grace: float = 60.0,
            per_node_env: dict[str, dict[str, str]] | None = None) -> list[NodeResult]:
        """Run ``rank_argv`` (a script or ``-m module`` plus args) as the ranks of every node; wait for all.
        ``extra_env`` goes to every node, ``per_node_env[node]`` to that node only (a setting one node differs in).

        On timeout or interrupt every node's process group is killed (status 124). Once a node fails, the
        others get ``grace`` seconds to notice and say so themselves (their transports' timeouts), then they
        are killed too (status 124, a line in the captured output says why): a failed job never holds the lab
        for the whole ``timeout``. A node's status is otherwise its torchrun's.
        """
        if not self.is_up:
            raise UserError("the lab is not up; call up() (or use 'with LabCluster(spec) as lab')")
        if not rank_argv:
            raise UserError("nothing to run: give a script or '-m module' after '--'")
        logdir = Path(tempfile.mkdtemp(prefix=f"bml-{self.spec.lab_id}-"))
        procs: list[tuple[str, subprocess.Popen[Any], Path]] = []
        try:
            for n in self.spec.nodes:
                log = logdir / f"{n.name}.log"
                out: Any = open(log, "w") if capture else None  # noqa: SIM115 (closed when the process ends)
                env = self.node_env(n.name, {**(extra_env or {}), **(per_node_env or {}).get(n.name, {})})
                proc = self.popen(n.name, self.torchrun_argv(n.name, rank_argv, master_port), env=env,
                                  stdout=out, stderr=subprocess.STDOUT if capture else None)
                if out is not None:
                    out.close()
                procs.append((n.name, proc, log))
            deadline = time.monotonic() + timeout
            codes: dict[str, int] = {}
            why: dict[str, str] = {}
            reason = f"the run exceeded its {timeout:g} s timeout"
            while len(codes) < len(procs):
                for name, proc, _ in procs:
                    if name not in codes and proc.poll() is not None:
                        codes[name] = proc.returncode
                        if proc.returncode != 0 and sum(c != 0 for c in codes.values()) == 1:  # the first failure
                            deadline = min(deadline, time.monotonic() + grace)
                            reason = f"node {name} failed (exit {proc.returncode}); it did not end within {grace:g} s"
                if len(codes) < len(procs) and time.monotonic() > deadline:
                    for name, proc, _ in procs:
                        if name not in codes:
                            _kill_group(proc)
                            codes[name] = 124
                            why[name] = reason
                    break
                time.sleep(0.05)
        finally:
            for _, proc, _ in procs:
                if proc.poll() is None:
                    _kill_group(proc)
        results = []
        for name, _, log in procs:
            text = log.read_text(errors="replace") if capture and log.exists() else ""
            if name in why:
                text += f"\n[bimetal lab] node {name} was killed: {why[name]}\n"
                if not capture:
                    _log.warning("bimetal lab: node %s was killed: %s", name, why[name])
            results.append(NodeResult(name, codes.get(name, 130), text))
        for f in logdir.iterdir():
            f.unlink()
        logdir.rmdir()
        return results


def _kill_group(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM the process group (torchrun forwards it to its ranks), SIGKILL after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
