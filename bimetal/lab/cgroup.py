"""Per-rank CPU caps (cgroup v1 ``cpu`` controller): an emulated device of a given speed.

Each rank of a lab gets ``/sys/fs/cgroup/cpu/bml-<id>-<node>-r<local_rank>``; ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us`` is its CPU share (-1 = unlimited, which still lets a fault slow it later).
A rank joins its cgroup itself before it execs the real program::

    python .../bimetal/lab/cgroup.py enter /sys/fs/cgroup/cpu/bml-pair-n0 -- -m bimetal.train ...

so torchrun's per-rank processes (and every thread and child of them) are capped, not torchrun itself. The step
runs this file by its path, not as ``-m bimetal.lab.cgroup``: importing the ``bimetal`` package imports torch
(about 2.3 s of CPU) to register its back-ends, which a process that only joins a cgroup and execs does not need.
So this module imports nothing of bimetal at the top (bimetal's own modules only where a function needs them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
PREFIX = "bml-"


def cgroup_base(lab_id: str, node: str) -> Path:
    """Path prefix of a node's rank cgroups; rank k's is ``<base>-r<k>``."""
    return CPU_ROOT / f"{PREFIX}{lab_id}-{node}"


def rank_cgroup(lab_id: str, node: str, local_rank: int) -> Path:
    return Path(f"{cgroup_base(lab_id, node)}-r{local_rank}")


def require_cpu_controller() -> None:
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        from bimetal.errors import UserError

        raise UserError(
            f"no cgroup v1 cpu controller at {CPU_ROOT} (cpu.cfs_quota_us missing); mount it "
            "(mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu) or leave cpu_share out of the spec"
        )


def set_share(path: Path, share: float | None) -> None:
    """Cap the cgroup at ``share`` CPUs (None: no cap)."""
    quota = -1 if share is None else max(int(share * PERIOD_US), 1000)
    (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (path / "cpu.cfs_quota_us").write_text(str(quota))


def get_share(path: Path) -> float | None:
    quota = int((path / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int((path / "cpu.cfs_period_us").read_text())


def create(path: Path, share: float | None) -> None:
    path.mkdir(exist_ok=True)
    set_share(path, share)


def join(path: Path, pid: int | None = None) -> None:
    (path / "cgroup.procs").write_text(str(pid or os.getpid()))


def pids_in(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def remove(path: Path, timeout: float = 5.0) -> None:
    """Kill what is left in the cgroup and remove it; rmdir fails while any task remains, so retry briefly."""
    deadline = time.monotonic() + timeout
    while path.exists():
        pids = [p for p in pids_in(path) if p != os.getpid()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                from bimetal.errors import UserError

                raise UserError(f"cannot remove cgroup {path}: tasks {pids} stay in it") from None
            time.sleep(0.05)


def lab_cgroups(lab_id: str | None = None) -> list[Path]:
    """Every lab cgroup on this machine (of one lab, or of all labs)."""
    if not CPU_ROOT.exists():
        return []
    prefix = f"{PREFIX}{lab_id}-" if lab_id else PREFIX
    return sorted(p for p in CPU_ROOT.iterdir() if p.is_dir() and p.name.startswith(prefix))


def lab_ids_in_cgroups() -> set[str]:
    return {p.name[len(PREFIX):].split("-", 1)[0] for p in lab_cgroups()}


RANK_ENV = "BIMETAL_LAB_RANK_ENV"


def apply_rank_env(local_rank: int) -> None:
    """Per-rank settings a node-wide environment cannot give: ``$BIMETAL_LAB_RANK_ENV`` is a JSON object of
    templates, ``{nic}`` / ``{nic_addr}`` being NIC ``local_rank % K`` of this namespace (one NIC per rank)."""
    if not os.environ.get(RANK_ENV):  # unset: no bimetal import (and so no torch) in the rank's cgroup step
        return
    from bimetal import env

    raw = env.read(RANK_ENV)
    if not raw:
        return
    import json

    from bimetal.topology.records import local_nics

    nics = local_nics()
    nic = nics[local_rank % len(nics)] if nics else None
    for key, template in dict(json.loads(raw)).items():
        os.environ[key] = str(template).format(local_rank=local_rank, nic=nic.name if nic else "lo",
                                               nic_addr=nic.address if nic else "127.0.0.1")


def _enter(argv: list[str]) -> int:
    """``enter BASE -- ARGS``: join ``BASE-r$LOCAL_RANK`` and exec ``python ARGS``."""
    if len(argv) < 3 or argv[0] != "enter" or argv[2] != "--" or len(argv) < 4:
        print("usage: python bimetal/lab/cgroup.py enter BASE -- <script or -m module> [args]", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    join(Path(f"{argv[1]}-r{local_rank}"))
    apply_rank_env(local_rank)
    os.execv(sys.executable, [sys.executable, *argv[3:]])
    return 0  # not reached


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run by its path: this package's folder is no place to find other modules
    sys.exit(_enter(sys.argv[1:]))
