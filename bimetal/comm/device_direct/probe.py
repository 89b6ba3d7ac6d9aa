"""The start-up probe of a device-direct group: every rank writes to every peer once before the group is used.

A group whose ranks cannot reach each other through the engine would otherwise hang or fail at its first
message, minutes into a job. Typical on a mixed cluster: one vendor's nodes on InfiniBand, the other's on RoCE
(Ethernet), which no RDMA write crosses. So at group creation each rank

* publishes its fabric (``local_fabric``: the protocol and, over RDMA, the devices the engine may use with the
  link layer of their ports, from ``/sys/class/infiniband``, and whether the RoCE GID the engine will use routes
  between nodes, ``gids.py``) and its host;
* refuses at once a peer whose RDMA devices share no link layer with its own (``fabrics_meet``);
* writes ``PROBE_BYTES`` (at most the slots' size) from its registered receive slots into the peer's (the slots it
  publishes for us, which nothing else writes before the group starts) and waits for every write, until
  ``PROBE_S`` at most.

The first failure becomes one sentence naming both ranks, their hosts and their fabrics (``probe_peers``); when a
write to a peer on another node fails and either side's GID does not route, the sentence says that instead of the
general advice, naming the variable to set (``BIMETAL_DD_GID_INDEX``). The group then agrees over the store and
follows its fallback policy (``creator.py``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bimetal.comm.device_direct import engine as engines
from bimetal.comm.device_direct import engine_env, gids
from bimetal.comm.device_direct.engine import Engine, GroupStartError, PeerFailedError, WriteStatus

PROBE_S = 10.0
"""How long the probe writes may take (bounded by the group's timeout)."""
PROBE_BYTES = 64
_LINK_NAMES = {"InfiniBand": "InfiniBand", "Ethernet": "RoCE"}
log = logging.getLogger(__name__)


class ProbeFailedError(GroupStartError):
    """A rank of the group could not write to a peer at start-up; the message is the sentence to show."""


def link_layers(device: str, root: Path | None = None) -> list[str]:
    """The link layers of ``device``'s active ports (``InfiniBand``, ``Ethernet`` for RoCE), from sysfs (a port
    whose state cannot be read counts as active; the engine skips ports that are not)."""
    ports = (root or engines.VERBS_SYSFS) / device / "ports"
    found = set()
    try:
        for port in ports.iterdir():
            try:
                if "ACTIVE" not in (port / "state").read_text():
                    continue
            except OSError:
                pass
            found.add((port / "link_layer").read_text().strip())
    except OSError:
        return []
    return sorted(found - {""})


def local_fabric(protocol: str, devices: tuple[str, ...], present: list[str], root: Path | None = None
                 ) -> dict[str, Any]:
    """What this rank's engine runs over: ``{"protocol", "devices": {name: [link layers]}, "gid": why}``; over RDMA
    the devices are the ones named (``devices``), else those of Mooncake's own whitelist ``MC_TE_FILTERS``, else
    every one ``present``; ``gid``: why the RoCE GID the engine will use does not route between nodes (empty when
    it does, ``gids.problem``)."""
    if protocol == "tcp":
        return {"protocol": "tcp", "devices": {}, "gid": ""}
    whitelist = [d.strip() for d in os.environ.get("MC_TE_FILTERS", "").split(",") if d.strip()]
    used = devices or tuple(d for d in present if not whitelist or d in whitelist)
    index, source, fix = engine_env.gid_in_effect()
    gid = gids.problem(root or engines.VERBS_SYSFS, used, index, source, fix)
    return {"protocol": protocol, "devices": {d: link_layers(d, root) for d in used}, "gid": gid or ""}


def describe(fabric: dict[str, Any]) -> str:
    """``RDMA mlx5_0 (InfiniBand), mlx5_1 (RoCE)``, or ``TCP``."""
    if fabric.get("protocol") == "tcp":
        return "TCP"
    parts = [f"{d} ({'/'.join(_LINK_NAMES.get(x, x) for x in layers) or 'link layer unknown'})"
             for d, layers in sorted(fabric.get("devices", {}).items())]
    return "RDMA " + (", ".join(parts) if parts else "with no device")


def fabrics_meet(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """False only when both sides run RDMA, both know their link layers, and no link layer is on both sides."""
    if mine.get("protocol") != "rdma" or theirs.get("protocol") != "rdma":
        return True
    a = {x for layers in mine.get("devices", {}).values() for x in layers}
    b = {x for layers in theirs.get("devices", {}).values() for x in layers}
    return not (a and b) or bool(a & b)


@dataclass(frozen=True)
class Side:
    """One end of a probe: who it is and what it runs over."""

    rank: int  # global rank
    host: str
    fabric: dict[str, Any]

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} ({describe(self.fabric)})"


_FIX = ("name RDMA devices on a fabric both hosts reach with BIMETAL_DD_DEVICES, or set BIMETAL_DD_PROTOCOL=tcp")


def probe_peers(engine: Engine, me: Side, peers: dict[int, tuple[Side, int]], source: dict[int, int],
                deadline_s: float = PROBE_S, nbytes: int = PROBE_BYTES) -> str | None:
    """Write ``nbytes`` to every peer at once; the first failure as one sentence, else None.

    ``peers``: group rank -> (its side, the address to write to there); ``source``: group rank -> a registered
    address of ours to write from (both at least ``nbytes`` long)."""
    for _, (side, _) in sorted(peers.items()):
        if not fabrics_meet(me.fabric, side.fabric):
            return (f"the device-direct start-up probe found that {me} and {side} share no fabric "
                    f"(InfiniBand and RoCE do not reach each other); {_FIX}")

    def fix(peer: int) -> str:
        """The advice for a failed write to ``peer``: its or our unroutable GID when it is on another node."""
        side = peers[peer][0]
        if side.host != me.host:
            for who in (me, side):
                if who.fabric.get("gid"):
                    return f"on rank {who.rank} ({who.host}) {who.fabric['gid']}"
        return _FIX

    pending: dict[int, int] = {}
    for peer, (side, remote) in sorted(peers.items()):
        try:
            pending[peer] = engine.post_write(peer, source[peer], remote, nbytes)
        except PeerFailedError as exc:
            return f"the device-direct start-up probe: {me} could not write to {side} ({exc}); {fix(peer)}"
    end = time.monotonic() + deadline_s
    nap = 1e-4
    while pending:
        for peer in list(pending):
            status = engine.poll(pending[peer])
            if status is WriteStatus.DONE:
                del pending[peer]
            elif status is WriteStatus.FAILED:
                return (f"the device-direct start-up probe: a write from {me} to {peers[peer][0]} failed; "
                        f"{fix(peer)}")
        if not pending:
            break
        if time.monotonic() > end:
            peer = min(pending)
            return (f"the device-direct start-up probe: a write from {me} to {peers[peer][0]} did not complete "
                    f"within {deadline_s:g} s; {fix(peer)}")
        time.sleep(nap)
        nap = min(nap * 2, 0.01)
    if me.fabric.get("gid") and any(side.host != me.host for side, _ in peers.values()):
        # the writes arrived (one layer-2 segment carries them), but a routed network would not
        log.warning("device-direct: %s", me.fabric["gid"])
    return None
