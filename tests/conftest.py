"""Shared fixtures. ``lab`` / ``make_lab``: an emulated cluster (network namespaces, tc, cgroups).

Lab tests skip with a reason where the machine cannot host a lab (not root, no ``ip netns``, no
``nsenter``); every lab a test makes is torn down when the test ends, pass or fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def engine_unavailable() -> str | None:
    """Why the device-direct engine (Mooncake) cannot start here, or None when it can.

    Checked for real: the wheel must be importable and its library's dependency ``libibverbs.so.1`` loadable
    (Mooncake links it even for TCP; Debian package ``libibverbs1``, which ``make test`` installs as root).
    """
    import ctypes
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake Transfer Engine wheel is not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return ("libibverbs.so.1 is missing (Debian package libibverbs1, needed by Mooncake even for TCP); "
                "run `make test` as root or `sudo apt-get install libibverbs1`")
    return None


def iptables_unavailable() -> str | None:
    """Why lab packet loss cannot be emulated here (no netem in this kernel and no iptables), or None."""
    if shutil.which("iptables") is None:
        return ("iptables is not installed (the lab's packet-loss fault on kernels without netem); run `make test` "
                "as root or `sudo apt-get install iptables`")
    return None


def lab_unavailable() -> str | None:
    """Why this machine cannot host a lab, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the lab needs root (network namespaces, tc, cgroups)"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2 / util-linux)"
    probe = f"bml-probe{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return f"'ip netns add' fails here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _lab_id() -> str:
    # Unique per test so parallel or leftover labs never collide; 't' + 8 hex digits fits the 12-char id.
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture
def make_lab() -> Iterator[Callable[..., Any]]:
    """``make_lab(nodes=[...], nics=2, rate_mbit=200)`` -> a LabCluster that is up; all torn down after the test.

    ``nodes`` is a list of dicts as in a spec's [[node]] tables (default: an nvidia and an amd node, 1 rank each).
    """
    why = lab_unavailable()
    if why:
        pytest.skip(why)
    from bimetal.lab.cluster import LabCluster
    from bimetal.lab.net import netem_available
    from bimetal.lab.spec import parse_spec

    made: list[LabCluster] = []

    def make(nodes: list[dict[str, Any]] | None = None, nics: int = 2, rate_mbit: float = 200,
             latency_ms: float = 0) -> LabCluster:
        nodes = nodes or [{"name": "nv", "vendor": "nvidia", "ranks": 1}, {"name": "amd", "vendor": "amd", "ranks": 1}]
        if latency_ms and (why := iptables_unavailable()) and not netem_available():
            pytest.skip(f"link latency without netem needs iptables: {why}")
        spec = parse_spec({"lab": {"name": _lab_id(), "nics": nics, "rate_mbit": rate_mbit, "latency_ms": latency_ms},
                           "node": nodes}, source="<test lab>")
        lab = LabCluster(spec)
        made.append(lab)
        return lab.up()

    try:
        yield make
    finally:
        for lab in made:
            lab.down()


@pytest.fixture
def lab(make_lab: Callable[..., Any]) -> Any:
    """A 2-node lab (nvidia + amd, one rank each), 2 NICs per node at 200 Mbit/s."""
    return make_lab()


# The files whose tests take longest, run first, longest first (summed test wall seconds of a CI run): `make test`
# runs the suite on two workers (pytest-xdist, each file on one worker, `--no-loadscope-reorder` so that this order
# holds rather than xdist's most-tests-first), and a long file started last leaves the other worker idle at the end.
SLOW_FILES_FIRST = ("test_torchtitan.py", "test_gpu_check.py", "test_slurm_real.py", "test_megatron.py",
                    "test_train_parity.py", "test_train_fsdp.py", "test_moving_a_run.py", "test_lab.py",
                    "test_train_shapes.py", "test_torch_conformance.py", "test_cf_failover.py", "test_titan_output.py",
                    "test_first_contact.py", "test_train_faults.py", "test_demo.py", "test_cpu_forward.py",
                    "test_rank_fork.py", "test_lab_elastic.py", "test_checkpoints_kept.py", "test_nothing_lost.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-log", metavar="PATH", default=None,
                     help="append one line per test to PATH: the CPU seconds it cost (this process and the child "
                          "processes it waited for, setup to teardown), its wall seconds and its id")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Wall time says little on a shared 2-core machine; CPU time is what a test costs the suite. Children count
    # once reaped (a launcher reaps its ranks, so a job's ranks land on the test that ran it).
    path = item.config.getoption("--cpu-log")
    if not path:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    cpu0, wall0 = cpu(), time.monotonic()
    yield
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{cpu() - cpu0:8.2f} {time.monotonic() - wall0:8.2f} {item.nodeid}\n")
