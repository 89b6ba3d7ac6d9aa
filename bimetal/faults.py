"""Fault injection for the reliability tests, driven by environment variables so that a test can set it
for ranks that a launcher starts (and that a restart then runs without it).

* ``BIMETAL_FAULT_KILL="rank:step"``: that global rank SIGKILLs itself right after finishing that step
  (only in the first attempt: ``TORCHELASTIC_RESTART_COUNT`` is 0), as a crashed GPU or node would.
* ``BIMETAL_FAULT_KILL_IN_CHECKPOINT="rank:step"``: that rank SIGKILLs itself while the checkpoint of that step
  is being written (its own files written, the checkpoint not yet complete), first attempt only.
* ``BIMETAL_FAULT_STALL="rank:step:seconds[:attempt]"``: that rank sleeps after the step, as a stalled peer would,
  in that attempt only (``TORCHELASTIC_RESTART_COUNT``; default 0, the first).

Transport-level faults wrap the transport (``bimetal.comm.cpu_forward.faults.inject_fault``) and
link faults live with the lab (``bimetal.lab.faults``). Nothing here runs unless its variable is set.
"""

from __future__ import annotations

import os
import signal
import time

from bimetal.env import read as read_env

KILL_ENV = "BIMETAL_FAULT_KILL"
STALL_ENV = "BIMETAL_FAULT_STALL"
KILL_IN_CHECKPOINT_ENV = "BIMETAL_FAULT_KILL_IN_CHECKPOINT"


def _parse(name: str, parts: int) -> list[float] | None:
    raw = read_env(name)  # the table's check: ``parts`` numbers separated by ':', or one sentence naming it
    if raw is None:
        return None
    return [float(p) for p in raw.strip().split(":")]


def attempt() -> int:
    """Which attempt of its agent this rank is (torchrun keeps the count on a restart for a node that joins)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def first_attempt() -> bool:
    return attempt() == 0


def _die(rank: int, when: str) -> None:
    print(f"bimetal fault injection: rank {rank} kills itself {when}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def in_checkpoint(rank: int, step: int) -> None:
    """Called by ``checkpoint.save`` once this rank's files of ``step`` are written, before the checkpoint is whole."""
    kill = _parse(KILL_IN_CHECKPOINT_ENV, 2)
    if kill and int(kill[0]) == rank and int(kill[1]) == step and first_attempt():
        _die(rank, f"while the checkpoint of step {step} is written")


def after_step(rank: int, step: int) -> None:
    """Called by the trainer after every completed step (cheap when no fault is configured)."""
    kill = _parse(KILL_ENV, 2)
    if kill and int(kill[0]) == rank and int(kill[1]) == step and first_attempt():
        _die(rank, f"after step {step}")
    stall = _parse(STALL_ENV, 3)
    if stall and int(stall[0]) == rank and int(stall[1]) == step and attempt() == int(stall[3] if stall[3:] else 0):
        time.sleep(stall[2])
