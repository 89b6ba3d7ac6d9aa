"""Network side of the lab: one namespace per node, K veth NICs per node to K bridges in a hub namespace.

Wiring: NIC index k of every node plugs into bridge ``br<k>`` in the hub namespace (a "rail" switch, as
on GPU clusters where NIC k of each node sits on rail k). Each rail is its own subnet ``10.77.<k>.0/24``,
so a connection to a peer's NIC k leaves through my NIC k and nothing else. A bridge rather than one veth
per node pair keeps N nodes at N x K links (not N^2 x K) and makes a NIC's line rate shared by all of its
peers, as a real port is. Both veth ends are shaped with tbf (node side: upload, hub side: download).

Nothing is ever created in the init namespace: deleting a lab's namespaces removes every link, bridge and
qdisc with them, which is what makes teardown and stale cleanup complete.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bimetal.errors import UserError

PREFIX = "bml-"
NETNS_DIR = "/run/netns"
SUBNET = "10.77"


class LabError(UserError):
    """A lab operation the kernel refused (missing tool, missing qdisc, not root)."""


def sh(args: Sequence[str], ns: str | None = None, check: bool = True, timeout: float = 15) -> str:
    """Run ``ip``/``tc`` (optionally inside namespace ``ns``) and return stdout; a failure names the command."""
    cmd = list(args)
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LabError(f"{cmd[0]!r} is not installed; install iproute2 (apt-get install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"'{' '.join(cmd)}' did not finish in {timeout:g} s") from None
    if check and out.returncode != 0:
        raise LabError(f"'{' '.join(cmd)}' failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def ns_name(lab_id: str, node: str) -> str:
    return f"{PREFIX}{lab_id}-{node}"


def hub_name(lab_id: str) -> str:
    return ns_name(lab_id, "hub")


def nic_name(k: int) -> str:
    """Interface name of NIC k inside a node namespace (what the job sees)."""
    return f"eth{k}"


def hub_port(node_index: int, k: int) -> str:
    return f"n{node_index}e{k}"


def nic_address(k: int, node_index: int) -> str:
    return f"{SUBNET}.{k}.{node_index + 1}"


def list_namespaces() -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def lab_ids_in_kernel() -> set[str]:
    """Lab ids that own at least one namespace (``bml-<id>-<node>``)."""
    return {n[len(PREFIX):].rsplit("-", 1)[0] for n in list_namespaces()}


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, tc, cgroups); run it as root or in a root container")


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters for a line rate.

    Bucket (burst) of ~2 ms of line rate, at least 64 KiB: veth hands tbf GSO super-packets of up to 64 KiB,
    and a smaller bucket makes tbf split them, which costs throughput. The queue limit of ~20 ms keeps TCP
    from seeing drops at every burst while still bounding the queueing delay.
    """
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(int(bytes_per_s * 0.002), 64 * 1024)
    limit = max(int(bytes_per_s * 0.020), 4 * burst)
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


def shape(ns: str, dev: str, rate_mbit: float, latency_ms: float, change: bool = False, hub: bool = False) -> None:
    """Set the egress shaping of ``dev`` in ``ns``: netem delay (if any) as root with tbf below it, or tbf alone.

    Without netem in the kernel, the latency comes from ``bimetal.lab.delay`` instead: the node holds every
    packet arriving on ``dev`` for both halves (2 x ``latency_ms``: its own and the one netem would add at the
    hub's end, which then gets tbf alone: ``hub=True``).
    """
    verb = "change" if change else "add"
    if change:
        sh(["tc", "qdisc", "del", "dev", dev, "root"], ns=ns, check=False)
        verb = "add"
    if change and not hub:  # a new link has no latency daemon yet
        stop_delay(ns, dev, nic_index(dev))
    if latency_ms > 0 and netem_available():
        sh(["tc", "qdisc", verb, "dev", dev, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms"], ns=ns)
        sh(["tc", "qdisc", verb, "dev", dev, "parent", "1:1", "handle", "10:", "tbf", *tbf_args(rate_mbit)], ns=ns)
        return
    sh(["tc", "qdisc", verb, "dev", dev, "root", "handle", "10:", "tbf", *tbf_args(rate_mbit)], ns=ns)
    if latency_ms > 0 and not hub:
        start_delay(ns, dev, nic_index(dev), 2 * latency_ms)


_NETEM: list[bool] = []


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried once on a scratch namespace's loopback)."""
    if not _NETEM:
        scratch = f"bml-netem-probe-{os.getpid()}"
        sh(["ip", "netns", "add", scratch])
        try:
            out = subprocess.run(["tc", "-n", scratch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                                 capture_output=True)
            _NETEM.append(out.returncode == 0)
        finally:
            sh(["ip", "netns", "del", scratch], check=False)
    return _NETEM[0]


def nic_index(dev: str) -> int:
    """The NIC number of a node-side device name (``eth3`` -> 3)."""
    return int(dev.removeprefix("eth"))


def add_namespace(name: str) -> None:
    sh(["ip", "netns", "add", name])
    sh(["ip", "-n", name, "link", "set", "lo", "up"])


def build_network(lab_id: str, nodes: Sequence[tuple[str, int, float, float]]) -> None:
    """Create the hub, one namespace per node ``(name, nics, rate_mbit, latency_ms)``, their NICs and shaping."""
    hub = hub_name(lab_id)
    add_namespace(hub)
    rails = max(n[1] for n in nodes)
    for k in range(rails):
        sh(["ip", "-n", hub, "link", "add", f"br{k}", "type", "bridge"])
        sh(["ip", "-n", hub, "link", "set", f"br{k}", "up"])
    for j, (node, nics, rate, latency) in enumerate(nodes):
        ns = ns_name(lab_id, node)
        add_namespace(ns)
        for k in range(nics):
            dev, port = nic_name(k), hub_port(j, k)
            sh(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", hub])
            sh(["ip", "-n", ns, "addr", "add", f"{nic_address(k, j)}/24", "dev", dev])
            sh(["ip", "-n", ns, "link", "set", dev, "up"])
            sh(["ip", "-n", hub, "link", "set", port, "master", f"br{k}", "up"])
            # Half the latency each way keeps the round trip at 2 x latency_ms through hub and back.
            shape(ns, dev, rate, latency / 2)
            shape(hub, port, rate, latency / 2, hub=True)


def kill_namespace_pids(ns: str, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, whatever still runs in ``ns`` (a namespace outlives its name while it has pids)."""
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while True:
        pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig, deadline = signal.SIGKILL, time.monotonic() + 2.0
        time.sleep(0.1)


def delete_lab_namespaces(lab_id: str) -> list[str]:
    """Delete every namespace of ``lab_id`` (processes first), returning their names."""
    mine = [n for n in list_namespaces() if n.startswith(f"{PREFIX}{lab_id}-")]
    for ns in mine:
        kill_namespace_pids(ns)
    for ns in mine:
        sh(["ip", "netns", "del", ns], check=False)
    return mine


# -- link latency without netem: one bimetal.lab.delay daemon per NIC --------------------------------------


_DELAY_MARK = "bimetal-delay"
DELAY_SCRIPT = str(Path(__file__).resolve().with_name("delay.py"))
"""The latency daemon, run by its path (see ``bimetal.lab.delay``: no bimetal package, so no torch, to import)."""


def _rule(dev: str, queue: int) -> list[str]:
    """The iptables rule (after -A/-D) that sends what arrives on ``dev`` to ``queue``."""
    return ["INPUT", "-i", dev, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass", "-m", "comment",
            "--comment", f"{_DELAY_MARK}-{dev}"]


def start_delay(ns: str, dev: str, queue: int, delay_ms: float) -> None:
    """Hold every packet that arrives on ``dev`` in namespace ``ns`` for ``delay_ms``."""
    stop_delay(ns, dev, queue)
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, DELAY_SCRIPT, "--queue",
                             str(queue), "--delay-ms", f"{delay_ms:g}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    if not ready or proc.stdout.readline().strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=5)
        raise LabError(f"the latency daemon for {dev} in {ns} did not start: {err.strip()[-300:] or 'no output'}; "
                           "it needs the kernel's nfnetlink_queue (or netem) for link latency")
    proc.stdout.close()
    try:
        sh(["iptables", "-A", *_rule(dev, queue)], ns=ns)
    except LabError as exc:
        stop_delay(ns, dev, queue)
        raise LabError(f"link latency without netem needs iptables with NFQUEUE ({exc}); install iptables "
                           "(apt-get install iptables) or set latency_ms = 0") from None


def stop_delay(ns: str, dev: str, queue: int) -> None:
    """Remove ``dev``'s latency rules and its daemon (no-op when there are none)."""
    sh(["iptables", "-D", *_rule(dev, queue)], ns=ns, check=False)
    for pid in sh(["ip", "netns", "pids", ns], check=False).split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if DELAY_SCRIPT in argv and "--queue" in argv and argv[argv.index("--queue") + 1:][:1] == [str(queue)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
