"""At group creation: agree on each rank's interfaces, then prove every pair reaches the other on them.

A cross-vendor transport calls ``choose_and_confirm`` from its creator, over the group's own store:

1. **agree**: each member publishes its candidate interfaces (``interfaces.candidate_nics``) with its host;
   each takes the candidates that share a subnet with every member on another host, then the one nearest its
   GPU in the PCI topology (``interfaces.usable_toward``, ``pick``, ``pci``);
2. **confirm**: each member listens on the addresses it took (port 0, one small TCP listener each), publishes
   them, and connects to every other member's, stripe by stripe, until the peer's listener answers with a
   token or the deadline (``BIMETAL_REACH_S``, 10 s by default) passes; then it publishes what it found and
   reads what every member found. A member that could not reach another stops the job on every member
   with one sentence naming both ranks, their hosts, the interface and the address, instead of Gloo or the
   engine waiting for the group's whole timeout (minutes) on a connection that cannot succeed.

A connection goes where the kernel routes it, as Gloo's and the engine's do, so the check answers the
question they would ask. Records are JSON over the store (``store_exchange``).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bimetal import env
from bimetal.errors import UserError
from bimetal.topology import store_exchange
from bimetal.topology.exchange import host_identity
from bimetal.topology.interfaces import NicInfo, pick, preference, usable_toward

ENV_DEADLINE = "BIMETAL_REACH_S"
DEFAULT_DEADLINE_S = 10.0
TOKEN = b"bimetal-reach/1\n"


class UnreachableError(UserError):
    """A member of a new group cannot reach another on the interfaces they chose."""


def deadline_s() -> float:
    """Seconds a member may take to reach every other (``BIMETAL_REACH_S``; 0 skips the check)."""
    return env.read_float(ENV_DEADLINE, DEFAULT_DEADLINE_S)


def _nics(value: Any) -> list[NicInfo]:
    return [NicInfo(str(n), str(a), int(p)) for n, a, p in value]


def agree(store: dist.Store, rank: int, size: int, find: Callable[[], list[NicInfo]], local_rank: int, count: int,
          prefix: str, timeout: timedelta, exact: bool = False) -> list[NicInfo]:
    """This member's ``count`` interfaces, from its candidates (``find()``) and those of the members on other
    hosts; ``exact``: ``find()`` already is the list (one per stripe, as the user named them). A member whose
    ``find`` refuses (a named interface it lacks) tells the others before it raises, so every member stops with
    its sentence instead of waiting for its record."""
    host = host_identity()
    try:
        candidates = find()
    except UserError as exc:
        store_exchange.publish(store, f"{prefix}/cand", rank, {"host": host, "error": str(exc)})
        raise
    mine = {"host": host, "nics": [[n.name, n.address, n.prefix] for n in candidates]}
    members: list[dict[str, Any]] = store_exchange.exchange(store, f"{prefix}/cand", rank, mine, range(size), timeout)
    for m in members:
        if "error" in m:
            raise UnreachableError(str(m["error"]))
    if exact:
        return candidates
    peers = [_nics(m["nics"]) for p, m in enumerate(members) if p != rank and m["host"] != host]
    return pick(usable_toward(candidates, peers), local_rank, count, preference(candidates, local_rank))


class _Listeners:
    """One listening socket per address; a thread answers every connection with ``TOKEN``."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.sockets: dict[str, socket.socket] = {}
        for address in dict.fromkeys(addresses):
            s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, 0))
            s.listen(64)
            s.setblocking(False)
            self.sockets[address] = s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bimetal-reach", daemon=True)
        self._thread.start()

    def port(self, address: str) -> int:
        return int(self.sockets[address].getsockname()[1])

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            for s in self.sockets.values():
                sel.register(s, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(0.1):
                    with contextlib.suppress(OSError):
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                        with conn:
                            conn.settimeout(1.0)
                            conn.sendall(TOKEN)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self.sockets.values():
            s.close()


def _reach(address: str, port: int, until: float) -> str | None:
    """None once ``address:port`` answered with the token before monotonic time ``until``; else the last error."""
    error = "no attempt"
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return error
        try:
            with socket.create_connection((address, port), timeout=min(left, 2.0)) as conn:
                conn.settimeout(max(0.1, until - time.monotonic()))
                got = b""
                while len(got) < len(TOKEN):
                    part = conn.recv(len(TOKEN) - len(got))
                    if not part:
                        break
                    got += part
                if got == TOKEN:
                    return None
                error = f"something other than a bimetal rank answered ({got[:32]!r})"
        except OSError as exc:
            error = exc.strerror or str(exc) or type(exc).__name__
        time.sleep(0.2)


def confirm(store: dist.Store, rank: int, size: int, global_ranks: Sequence[int], chosen: Sequence[NicInfo],
            prefix: str, what: str, timeout: timedelta, deadline: float | None = None) -> None:
    """Every member reaches every other on the interfaces it took, within ``deadline`` seconds, or every member
    raises ``UnreachableError`` with the first failure (in group-rank order)."""
    deadline = deadline_s() if deadline is None else deadline
    if deadline <= 0 or size < 2 or not chosen:
        return
    host = host_identity()
    listeners = _Listeners([n.address for n in chosen])
    try:
        mine = {"host": host, "listen": [[n.name, n.address, listeners.port(n.address)] for n in chosen]}
        members: list[dict[str, Any]] = store_exchange.exchange(store, f"{prefix}/listen", rank, mine, range(size),
                                                                timeout)
        until = time.monotonic() + deadline
        failure = ""
        for p, member in enumerate(members):
            if p == rank or failure:
                continue
            for s in range(len(chosen)):
                name, address, port = member["listen"][s % len(member["listen"])]
                why = _reach(address, int(port), until)
                if why is not None:
                    failure = (f"{what}: rank {global_ranks[rank]} (host {host}, interface {chosen[s].name} "
                               f"{chosen[s].address}) cannot reach rank {global_ranks[p]} (host {member['host']}) on "
                               f"its interface {name} ({address}) within {deadline:g} s: {why}; name interfaces "
                               "both nodes reach with parallel.interfaces or BIMETAL_IFACES (or raise "
                               f"{ENV_DEADLINE}).")
                    break
        store_exchange.publish(store, f"{prefix}/result", rank, failure)
        wait = timedelta(seconds=2 * deadline + 10)

        def missing(r: int, exc: BaseException) -> Exception:
            return UnreachableError(f"{what}: rank {global_ranks[r]} did not finish its reachability check within "
                                    f"{wait.total_seconds():g} s; check that it is alive and reaches this host.")

        results: list[str] = store_exchange.gather(store, f"{prefix}/result", range(size), wait, missing=missing)
    finally:
        store.set_timeout(timeout)
        listeners.close()
    failed = [r for r in results if r]
    if failed:
        raise UnreachableError(failed[0])


def choose_and_confirm(store: dist.Store, rank: int, size: int, global_ranks: Sequence[int],
                       find: Callable[[], list[NicInfo]], local_rank: int, count: int, prefix: str, what: str,
                       timeout: timedelta, exact: bool = False) -> list[NicInfo]:
    """``agree`` then ``confirm``: this member's ``count`` interfaces, proven to reach every other member."""
    chosen = agree(store, rank, size, find, local_rank, count, prefix, timeout, exact)
    confirm(store, rank, size, global_ranks, chosen, prefix, what, timeout)
    return chosen
