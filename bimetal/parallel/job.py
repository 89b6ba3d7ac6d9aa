"""One job across torchrun's restarts: what makes a round "the same job" as the rounds before it, a key prefix per
round where the agent's store outlives rounds, and what one round tells the next (the world it had, the last step
it finished).

**The same job.** A later round of a started job resumes by itself (no ``--resume``); a user's second job on the
same folders is a start and is refused where checkpoints are. What tells them apart must hold with and without the
agent's store (torchrun shares one with the ranks unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which growing
back needs: see docs/moving-a-run.md), with and without a process group (a one-rank round has none), and when the
node that hosted a store is the one lost. It is the agents: torchrun's agent on each node lives as long as the job
(it restarts its ranks, it is not restarted), and a second job has agents of its own. So the first round that
starts writes ``elastic-job.json`` into the run folder, naming the agents of its ranks (``agent_id``: the process
that started the rank, by host, boot, pid and start time), and every later round adds its own; a round one of
whose ranks' agents the record names continues the job (``Job.continues``, decided once every rank's agent is
known, before anything is written). A node that returns has a new agent, but joins agents the record names.
torchrun's ``TORCHELASTIC_RESTART_COUNT`` cannot serve: it stays put on a restart for a node that joins, and a
node that joins later counts from 0 while the others do not. bimetal's own launcher is such an agent too.

**Keys per round.** Where the agent's store is shared (torch 2.13's default; bimetal's launcher), the keys a round
leaves stay in it, so each round needs keys of its own (the world's Gloo addresses of a dead round point at dead
ports); without it every round has a new store. ``round_prefix``: rank 0 of the round publishes a new token; every
other rank answers the token it reads with a token of its own and waits for rank 0 to confirm that answer; a rank
that read the previous round's token (its rank 0 is gone, no confirmation comes) reads again. This is no rendezvous
- torchrun's agents chose the nodes and ranks - only the name of the round's keys.

**The restart line** needs the world of the round before and the last step the job finished: the record holds the
world; the step is in the store where it outlives rounds, else the last line of ``metrics.jsonl``.
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

STEP = "bimetal/job/step"
"""In a store that outlives rounds: the last step the job finished, in whichever round."""
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
"""In the run folder: the agents of the job that started there (every round's) and the world of its newest round."""


def agent_id() -> str:
    """This rank's agent: the process that started it (torchrun's agent on this node, or bimetal's launcher), by
    host, boot, pid and start time, so that no other process, before or after a reboot, has the same."""
    import socket

    ppid = os.getppid()
    try:
        # /proc/PID/stat: the start time is field 22; the name (field 2, in parentheses) may hold spaces
        start = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        start, boot = "?", "?"
    return f"{socket.gethostname()}/{boot}/{ppid}/{start}"


def read_record(run_dir: str) -> dict[str, Any] | None:
    """``elastic-job.json`` of ``run_dir``, or None where there is none (or it is not one)."""
    try:
        record = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("agents"), list) and isinstance(record.get("world"), dict)
    return record if ok else None


class Job:
    """This rank's job under an agent (torchrun's, or bimetal's launcher): ``connect`` gives None outside one.
    ``store``: the agent's store where the agent shares it with the ranks (it outlives rounds), else None."""

    def __init__(self, store: dist.Store | None) -> None:
        self.store = store

    @staticmethod
    def connect(timeout: timedelta) -> Job | None:
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's agent and bimetal's launcher set it
            return None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
            return Job(None)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        return Job(store)

    @staticmethod
    def continues(run_dir: str, agents: list[str]) -> bool:
        """The one "same job" decision (see the module's docstring): the run folder's record names one of the
        agents of this round's ranks, ``agents`` (every rank's, in a round with a process group)."""
        record = read_record(run_dir)
        return record is not None and bool(set(record["agents"]) & set(agents))

    def previous(self, run_dir: str) -> tuple[World | None, int | None]:
        """The world of the newest round that started before this one, and the last step the job finished (from
        the store where it outlives rounds and holds it, else ``metrics.jsonl``)."""
        record = read_record(run_dir)
        if record is None:
            return None, None
        step = self.store.get(STEP).decode() if self.store is not None and self.store.check([STEP]) else None
        done = int(step) if step else _last_step(run_dir)
        try:
            return World(**record["world"]), done
        except TypeError:
            return None, done

    def begin(self, world: World, run_dir: str, agents: list[str], continued: bool) -> None:
        """Rank 0, once every rank of the round passed its checks: this round has started, with ``world`` and the
        ranks' ``agents`` (added to the earlier rounds' where it ``continued`` the job; a start names its own)."""
        from bimetal.outputs import write_text

        old = (read_record(run_dir) or {}).get("agents", []) if continued else []
        record = {"run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "agents": list(dict.fromkeys([*old, *agents])),
                  "world": {"hosts": world.hosts, "layout": world.layout}}
        write_text(Path(run_dir) / RECORD, json.dumps(record))

    def finished(self, step: int) -> None:
        """The job finished ``step`` (said by the rank that logs the steps), where the store outlives rounds."""
        if self.store is not None:
            self.store.set(STEP, str(step))

    def round_prefix(self, rank: int, world: int, timeout: timedelta) -> str:
        """The key prefix of this round, the same on every rank of it, in the agent's store (see the module's
        docstring)."""
        store = self.store
        if store is None:
            raise RuntimeError("round_prefix needs the agent's store, which this round does not share")
        deadline = time.monotonic() + timeout.total_seconds()

        def wait(key: str, seconds: float, who: str) -> bool:
            # polled with check(): a TCPStore wait() that times out prints C++ warnings, and the previous round's
            # token times out here by design
            end = min(deadline, time.monotonic() + seconds)
            while not store.check([key]):
                if time.monotonic() >= deadline:
                    raise JobAborted(f"bimetal: rank {rank} waited {timeout.total_seconds():g} s for {who} to join "
                                     "this round of the job; it did not (see its own output).")
                if time.monotonic() >= end:
                    return False
                time.sleep(0.02)
            return True

        if rank == 0:
            token = uuid.uuid4().hex
            store.set(ROUND, token)
            for r in range(1, world):
                wait(f"bimetal/round/{token}/ack/{r}", timeout.total_seconds(), f"rank {r}")
                answer = store.get(f"bimetal/round/{token}/ack/{r}").decode()
                store.set(f"bimetal/round/{token}/go/{answer}", "1")
            return f"bimetal/round/{token}"
        mine = uuid.uuid4().hex
        while True:
            wait(ROUND, timeout.total_seconds(), "rank 0")
            token = store.get(ROUND).decode()
            store.set(f"bimetal/round/{token}/ack/{rank}", mine)
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
