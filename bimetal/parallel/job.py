"""One job across torchrun's restarts: the store every round of it shares, a key prefix per round, and what one
round tells the next (the world it had, the last step it finished).

torchrun's agent hosts one TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``: c10d and static
rendezvous, and bimetal's own launcher); the ranks of every round reach it at ``MASTER_ADDR:MASTER_PORT``. That
store is what makes "the same job": it lives exactly as long as the job, and a user's second job, even on the same
folders, has its own. So a round that finds ``STARTED`` in it continues a job whose earlier round passed the checks
of a start (a fresh folder, or ``--resume``), and resumes by itself; one that does not find it is a start, checked
as one, whatever ``TORCHELASTIC_RESTART_COUNT`` says (a start refused in round 0 is refused in every round).

That store lives on the node whose agent was rank 0 of the job's first round (torch 2.13 shares it with the
workers), which need not be the rendezvous node. Where that node is the one lost, the next round's rank 0 starts a
new, empty store. So the first round that starts also writes ``elastic-job.json`` into the run folder, naming the
rendezvous id (``TORCHELASTIC_RUN_ID``: torchrun's ``--rdzv-id``, Slurm's job id in ``bimetal slurm``'s script)
and its world; a round whose store is new continues the job when that file names its own rendezvous id. torchrun's
default id ``none`` names no job, so a job started without ``--rdzv-id`` has only its store.

The keys a round leaves stay in that store, so each round needs keys of its own (the world's Gloo addresses of a
dead round point at dead ports). ``TORCHELASTIC_RESTART_COUNT`` cannot name a round: torchrun keeps it on a restart
for a membership change (a node joining), and a node that joins later counts from 0 while the others do not. So
``round_prefix``: rank 0 of the round publishes a new token; every other rank answers the token it reads with a
token of its own and waits for rank 0 to confirm that answer; a rank that read the previous round's token (its rank
0 is gone, no confirmation comes) reads again. This is no rendezvous - torchrun's agents chose the nodes and ranks
- only the name of the round's keys.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bimetal.errors import JobAborted

STARTED = "bimetal/job/started"
"""Set by rank 0 once a round passed the checks of a start: later rounds of the job resume by themselves."""
WORLD = "bimetal/job/world"
"""The world of the newest round that started (``World`` as JSON), for the next round's restart line."""
STEP = "bimetal/job/step"
"""The last step the job finished, in whichever round."""
ROUND = "bimetal/job/round"
_RETRY_S = 2.0  # how long a rank waits for rank 0 to confirm the token it read before reading it again


@dataclass
class World:
    """The ranks of one round by node: ``hosts`` is ``[[host, vendor, [global ranks]], ...]`` in rank order."""

    hosts: list[list[Any]]
    layout: str

    @property
    def size(self) -> int:
        return sum(len(r) for _, _, r in self.hosts)

    def mix(self) -> str:
        """The vendor mix, ``nvidia:2,amd:2``."""
        counts: dict[str, int] = {}
        for _, vendor, ranks in self.hosts:
            counts[vendor] = counts.get(vendor, 0) + len(ranks)
        return ",".join(f"{v}:{n}" for v, n in counts.items())

    @staticmethod
    def of(ranks: list[tuple[str, str]], layout: str) -> World:
        """From each global rank's (host, vendor); a simulated host holding two vendors is two entries."""
        hosts: dict[tuple[str, str], list[Any]] = {}
        for r, (host, vendor) in enumerate(ranks):
            hosts.setdefault((host, vendor), [host, vendor, []])[2].append(r)
        return World(list(hosts.values()), layout)


RECORD = "elastic-job.json"
"""In the run folder: the rendezvous id of the job that started there and the world of its newest round."""


def run_id() -> str | None:
    """This torchrun job's rendezvous id, or None where it names no job (torchrun's default ``none``)."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return rid if rid and rid != "none" else None


def read_record(run_dir: str) -> dict[str, Any] | None:
    """``elastic-job.json`` of ``run_dir`` where it names this job's rendezvous id, else None."""
    try:
        record = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    rid = run_id()
    return record if isinstance(record, dict) and rid is not None and record.get("run_id") == rid else None


class JobStore:
    """The agent's store of this torchrun job, as a client; ``connect`` gives None outside such a job."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    @staticmethod
    def connect(timeout: timedelta) -> JobStore | None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
            return None
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        return JobStore(store)

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def started(self, run_dir: str) -> bool:
        """An earlier round of this job passed the checks of a start (see the module's docstring)."""
        return self.store.check([STARTED]) or read_record(run_dir) is not None

    def previous(self, run_dir: str) -> tuple[World | None, int | None]:
        """The world of the newest round that started before this one, and the last step the job finished (from
        the store; where the store is new, the run folder's record and ``metrics.jsonl``)."""
        world, step = self._get(WORLD), self._get(STEP)
        if world is None and (record := read_record(run_dir)) is not None:
            world, step = json.dumps(record["world"]), str(_last_step(run_dir) or "")
        return (World(**json.loads(world)) if world else None), (int(step) if step else None)

    def begin(self, world: World, run_dir: str) -> None:
        """Rank 0, once every rank of the round passed its checks: this round has started, with ``world``."""
        text = json.dumps({"hosts": world.hosts, "layout": world.layout})
        self.store.set(WORLD, text)
        self.store.set(STARTED, "1")
        if run_id() is not None:
            from bimetal.outputs import write_text

            write_text(Path(run_dir) / RECORD, json.dumps({"run_id": run_id(), "world": json.loads(text)}))

    def finished(self, step: int) -> None:
        """The job finished ``step`` (said by the rank that logs the steps)."""
        self.store.set(STEP, str(step))

    def round_prefix(self, rank: int, world: int, timeout: timedelta) -> str:
        """The key prefix of this round, the same on every rank of it (see the module's docstring)."""
        deadline = time.monotonic() + timeout.total_seconds()

        def wait(key: str, seconds: float, who: str) -> bool:
            # polled with check(): a TCPStore wait() that times out prints C++ warnings, and the previous round's
            # token times out here by design
            end = min(deadline, time.monotonic() + seconds)
            while not self.store.check([key]):
                if time.monotonic() >= deadline:
                    raise JobAborted(f"bimetal: rank {rank} waited {timeout.total_seconds():g} s for {who} to join "
                                     "this round of the job; it did not (see its own output).")
                if time.monotonic() >= end:
                    return False
                time.sleep(0.02)
            return True

        if rank == 0:
            token = uuid.uuid4().hex
            self.store.set(ROUND, token)
            for r in range(1, world):
                wait(f"bimetal/round/{token}/ack/{r}", timeout.total_seconds(), f"rank {r}")
                answer = self.store.get(f"bimetal/round/{token}/ack/{r}").decode()
                self.store.set(f"bimetal/round/{token}/go/{answer}", "1")
            return f"bimetal/round/{token}"
        mine = uuid.uuid4().hex
        while True:
            wait(ROUND, timeout.total_seconds(), "rank 0")
            token = self.store.get(ROUND).decode()
            self.store.set(f"bimetal/round/{token}/ack/{rank}", mine)
            if wait(f"bimetal/round/{token}/go/{mine}", _RETRY_S, "rank 0"):
                return f"bimetal/round/{token}"


def _last_step(run_dir: str) -> int | None:
    """The last step ``metrics.jsonl`` holds (rank 0 writes a line per step), before a resume cuts it back."""
    try:
        lines = [ln for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def restart_line(before: World, now: World, done: int | None, step: int, path: str | None) -> str:
    """The one line a restarted round logs: which nodes (and vendor islands) were lost or joined, with their ranks
    in the round before, the world now, the checkpoint it goes on from and how many steps are redone."""
    old = {(h, v): r for h, v, r in before.hosts}
    new = {(h, v): r for h, v, r in now.hosts}
    changes = []
    lost = [k for k in old if k not in new]
    if lost:
        gone = [v for v in dict.fromkeys(v for _, v in old) if v not in {v for _, v in new}]
        island = f"; the whole {' and '.join(gone)} island" if gone else ""
        changes.append("lost " + "; ".join(f"node {h} ({v}, {_ranks(old[h, v])} of {before.size})" for h, v in lost)
                       + island)
    joined = [k for k in new if k not in old]
    if joined:
        changes.append("joined " + "; ".join(f"node {h} ({v}, now {_ranks(new[h, v])})" for h, v in joined))
    if not changes:
        changes.append(f"no node lost: the same {_count(before.size, 'rank')} on "
                       f"{', '.join(dict.fromkeys(h for h, _ in old))}")
    nodes = ", ".join(dict.fromkeys(h for h, _ in new))
    world = (f"world {before.mix()} -> {now.mix()} on {nodes}" if before.mix() != now.mix() or lost or joined
             else "world unchanged")
    layout = f"layout {before.layout} -> {now.layout}" if before.layout != now.layout else f"layout {now.layout}"
    where = ("no complete checkpoint: going on from step 0" if path is None
             else f"going on from the checkpoint of step {step} ({path})")
    redone = f"{_count(max(0, (done or 0) - step), 'step')} redone (the job had finished step {done or 0})"
    return f"bimetal restart: {'; '.join(changes)}; {world}, {layout}; {where}, {redone}."
