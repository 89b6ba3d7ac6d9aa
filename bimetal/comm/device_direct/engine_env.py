"""The environment the transfer engine starts in: what bimetal sets from its own settings, and what the user set.

Mooncake takes its configuration from ``MC_*`` environment variables read when the engine starts, not from the
arguments of ``initialize``. Facts read from the published 0.3.13.post1 wheels (their strings) and Mooncake's
source, with the evidence for each in ``docs/device-direct.md`` ("The engine's environment"):

* **Which transport** is not ``initialize``'s protocol argument (the Python binding uses it to pick a memory
  allocator). The engine installs RDMA whenever its topology discovery finds a verbs device, and TCP only where
  none exists, unless ``MC_FORCE_TCP`` is present (whatever its value, even ``0``): then TCP alone, and nothing
  after it, so not the ROCm build's HIP transport either. So the ``tcp`` protocol sets ``MC_FORCE_TCP=1``.
* **The ROCm build's HIP transport** (intra-node GPU peer access) is installed after the cross-node one and, in the
  published build (made without Mooncake's multi-protocol option), relabels the rank's memory segment ``hip``; a
  peer on another node then has no transport for it (a CUDA peer: "Transport hip not installed"). Deployments turn
  it off with ``MC_DISABLE_HIP_TRANSPORT=1`` or ``MC_DISABLE_HIP=1``, but the 0.3.13.post1 ROCm wheel reads
  neither. So, for an AMD rank whose group has peers on other nodes over RDMA, bimetal sets whichever of the two
  the installed library reads, and where it reads none the engine cannot serve the group: one sentence, and the
  fallback policy.
* **The RoCE GID index**: ``MC_GID_INDEX``, else ``NCCL_IB_GID_INDEX``, else the engine's own choice. bimetal sets
  ``MC_GID_INDEX`` from ``BIMETAL_DD_GID_INDEX`` (or the ``gid_index`` option); the start-up probe explains a
  failed write by an index that does not route (``gids.py``).

* **IPv6**: the engine's handshake listener and connections are IPv4 unless ``MC_USE_IPV6`` is present (read once
  per process); bimetal sets it when the engine's host is an IPv6 address, and names such a peer ``[addr]:port``.

Which variables the installed library reads is taken from the library itself (``library_facts``: the names in its
``engine.so``, as ``strings`` shows them), not from a table of releases. A variable the user set wins over the one
bimetal would set; the difference is logged. Only what bimetal itself set is changed or removed for a later engine
of the same process.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORCE_TCP = "MC_FORCE_TCP"
GID_INDEX = "MC_GID_INDEX"
NCCL_GID_INDEX = "NCCL_IB_GID_INDEX"
USE_IPV6 = "MC_USE_IPV6"
HIP_OFF = ("MC_DISABLE_HIP_TRANSPORT", "MC_DISABLE_HIP")
"""The variables deployments use to keep the HIP transport off, in the order bimetal prefers them."""
MANAGED = (FORCE_TCP, GID_INDEX, USE_IPV6, *HIP_OFF)
"""Every engine variable bimetal may set."""
_HIP_MARK = b"HIP transport installed"  # the log line of a build that installs the HIP transport
_NAME = re.compile(rb"(?:MC|MOONCAKE)_[A-Z0-9_]{2,}")  # (no look-behind: 20 ms over a 5 MB library, not 1.5 s)
_WORD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


@dataclass(frozen=True)
class LibraryFacts:
    """What an engine library reads and holds, from its own bytes."""

    reads: frozenset[str]
    """The ``MC_*``/``MOONCAKE_*`` names in the library (the variables it can read)."""
    hip_transport: bool
    """Whether it installs a HIP transport (the ROCm build)."""
    where: str = ""
    """The file they were read from."""


def library_facts(library: Path | None = None) -> LibraryFacts | None:
    """The facts of ``library`` (default: the installed ``mooncake/engine.so``, found without importing it); None
    when there is none."""
    if library is None:
        spec = importlib.util.find_spec("mooncake")
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(p) / "engine.so" for p in places if (Path(p) / "engine.so").is_file()]
        if not found:
            return None
        library = found[0]
    try:
        stat = library.stat()
    except OSError:
        return None
    return _read_facts(str(library), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _read_facts(path: str, mtime_ns: int, size: int) -> LibraryFacts:
    # (mtime and size key the cache: a reinstalled wheel is read again)
    data = Path(path).read_bytes()
    names = {m.group().decode() for m in _NAME.finditer(data) if m.start() == 0 or data[m.start() - 1] not in _WORD}
    return LibraryFacts(frozenset(names), _HIP_MARK in data, path)


@dataclass
class Plan:
    """What the engine's environment should hold for one engine."""

    want: dict[str, str | None]
    """Variable -> the value bimetal sets (None: bimetal does not set it, and removes its own earlier value)."""
    protocol: str
    """The transport the engine will really use (``tcp`` when the user's ``MC_FORCE_TCP`` forces it)."""
    refusal: str | None = None
    """One sentence when the engine cannot serve this group as configured."""
    notes: list[str] | None = None
    """What was logged (the user's settings that won)."""


_ours: dict[str, str] = {}
"""The values bimetal itself put in this process's environment (so a later engine may change them)."""


def _users(name: str, environ: MutableMapping[str, str]) -> str | None:
    """The user's value of ``name`` (one bimetal did not set), or None."""
    value = environ.get(name)
    if value is None or _ours.get(name) == value:
        return None
    return value


def plan(protocol: str, facts: LibraryFacts | None, remote_peers: bool, gid_index: int | None,
         environ: MutableMapping[str, str] | None = None, wheel: str = "the installed Mooncake build",
         ipv6: bool = False) -> Plan:
    """The engine environment for a group over ``protocol`` (``rdma`` or ``tcp``), on a rank whose group has
    peers on other nodes (``remote_peers``), with the GID index bimetal was given (None: not set), for an engine
    whose host is an IPv6 address (``ipv6``)."""
    env = os.environ if environ is None else environ
    notes: list[str] = []
    want: dict[str, str | None] = dict.fromkeys(MANAGED)
    forced = _users(FORCE_TCP, env)
    if protocol == "tcp":
        want[FORCE_TCP] = "1"
    elif forced is not None:
        notes.append(f"{FORCE_TCP}={forced!r} is set, and Mooncake uses TCP alone whenever it is set (whatever its "
                     f"value), so the engine runs TCP although device-direct chose {protocol}")
        protocol = "tcp"
    if protocol != "tcp" and gid_index is not None:
        want[GID_INDEX] = str(gid_index)
    if ipv6:
        want[USE_IPV6] = "1"
    refusal = None
    if protocol != "tcp" and remote_peers and facts is not None and facts.hip_transport:
        readable = [name for name in HIP_OFF if name in facts.reads]
        if readable:
            want[readable[0]] = "1"
        else:
            named = [f"{n}={env[n]}" for n in HIP_OFF if n in env]
            yours = f" (so {' and '.join(named)} set here has no effect)" if named else ""
            refusal = (f"{wheel} installs its HIP transport beside RDMA, which labels this rank's memory 'hip' so "
                       f"that peers on other nodes cannot write to it, and it reads no variable that turns the HIP "
                       f"transport off (neither {' nor '.join(HIP_OFF)} is in {Path(facts.where).name}){yours}; "
                       "set BIMETAL_DD_PROTOCOL=tcp for groups that cross nodes")
    for name, value in want.items():
        theirs = _users(name, env)
        if theirs is not None and value is not None and theirs != value:
            notes.append(f"{name}={theirs!r} set by the user is kept (device-direct would set {value!r})")
    for note in notes:
        log.warning("device-direct: %s", note)
    return Plan(want, protocol, refusal, notes)


def apply(chosen: Plan, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``chosen`` into the environment before the engine starts, leaving every value the user set alone;
    returns what bimetal set."""
    env = os.environ if environ is None else environ
    done: dict[str, str] = {}
    for name, value in chosen.want.items():
        if _users(name, env) is not None:
            continue  # the user's value wins (``plan`` logged it)
        if value is None:
            if name in _ours:  # our value from an earlier engine of this process: not this one's
                env.pop(name, None)
                del _ours[name]
            continue
        env[name] = value
        _ours[name] = value
        done[name] = value
    return done


def gid_in_effect(environ: MutableMapping[str, str] | None = None) -> tuple[int | None, str, str]:
    """The GID index the engine will use (None: its own choice), where it comes from in words, and the variable to
    set to change it (the user's ``MC_GID_INDEX`` wins over ``BIMETAL_DD_GID_INDEX``)."""
    env = os.environ if environ is None else environ
    for name, source, fix in ((GID_INDEX, "from BIMETAL_DD_GID_INDEX", "BIMETAL_DD_GID_INDEX"),
                              (NCCL_GID_INDEX, f"from {NCCL_GID_INDEX}, which Mooncake reads when {GID_INDEX} is not "
                                               "set", "BIMETAL_DD_GID_INDEX")):
        raw = env.get(name)
        if raw is None or not raw.strip().isdigit():
            continue
        if name == GID_INDEX and _ours.get(name) != raw:
            source, fix = f"from {GID_INDEX}, set by the user", GID_INDEX
        return int(raw), source, fix
    return None, "chosen by the engine", "BIMETAL_DD_GID_INDEX"


def engine_variables(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The engine variables in the environment now (``MC_*``, ``MOONCAKE_*``, and ``NCCL_IB_GID_INDEX``)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(("MC_", "MOONCAKE_")) or k == NCCL_GID_INDEX}
