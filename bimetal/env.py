"""Every ``BIMETAL_*`` environment variable a user may set: one table, checked before any rank starts, and
the one reader the code uses.

``VARIABLES`` lists each variable with the check of its values, its default and what it does (the reference
page ``docs/environment.md`` is rendered from it by ``reference_page``), so that ``bimetal train``/``bimetal launch``
refuse a bad value with one sentence naming the variable before any process is started, and a rank started by
torchrun refuses it at its entry point instead of deep inside group creation. A variable bimetal does not know
is named in a warning (a misspelt one would otherwise be ignored silently). The code reads a variable through
``read``, ``read_int``, ``read_size``, ``read_float`` or ``read_flag``, which apply the same check, so a value
that passes at launch reads the same inside a rank.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from bimetal.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Check:
    """What a variable takes: ``values`` in words (the reference page's column), and ``test``, which raises
    ``UserError`` naming the variable when a raw value is not one of them."""

    values: str
    test: Callable[[str, str], None]

    def __call__(self, name: str, raw: str) -> None:
        self.test(name, raw)


def _integer(least: int, most: int | None = None) -> Check:
    bounds = f"an integer from {least} to {most}" if most is not None else f"an integer >= {least}"

    def check(name: str, raw: str) -> None:
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            raise UserError(f"{name}={raw!r} is not valid; set it to {bounds}.")
    return Check(bounds, check)


def _size(least: int) -> Check:
    def check(name: str, raw: str) -> None:
        from bimetal.sizes import parse_size

        try:
            value = parse_size(raw)
        except UserError:
            value = -1
        if value < least:
            raise UserError(f"{name}={raw!r} is not valid; set it to a size of at least {least} bytes, like 64K or 4M.")
    return Check(f"a size of at least {least} bytes (65536, 64K, 4M)", check)


def _number(least: float) -> Check:
    def check(name: str, raw: str) -> None:
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < least:
            raise UserError(f"{name}={raw!r} is not valid; set it to a number >= {least:g} (seconds).")
    return Check(f"seconds, a number >= {least:g}", check)


def _choice(*allowed: str) -> Check:
    def check(name: str, raw: str) -> None:
        if raw.strip().lower() not in allowed:
            raise UserError(f"{name}={raw!r} is not valid; set it to one of {', '.join(allowed)}.")
    return Check(" or ".join(f"`{a}`" for a in allowed), check)


def _simulate(name: str, raw: str) -> None:
    from bimetal.simulate import parse_simulate

    try:
        parse_simulate(raw)
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def _interfaces(name: str, raw: str) -> None:
    names = raw.split(",")
    if not all(n.strip() for n in names):
        raise UserError(f"{name}={raw!r} is not valid; give interface names separated by commas, e.g. eth0,eth1.")


def _rdma_devices(name: str, raw: str) -> None:
    if not all(n.strip() for n in raw.split(",")):
        raise UserError(f"{name}={raw!r} is not valid; give RDMA device names separated by commas, e.g. mlx5_0,mlx5_1.")


_CLAIM = r"\d+:(?:torch|bimetal|engine)=[^,;=:\s]+(?:,(?:torch|bimetal|engine)=[^,;=:\s]+)*"


def _claims(name: str, raw: str) -> None:
    import re

    if not re.fullmatch(rf"\s*{_CLAIM}(?:\s*;\s*{_CLAIM})*\s*;?\s*", raw):
        raise UserError(f"{name}={raw!r} is not valid; write RANK:field=version[,field=version] separated by ';' "
                        "with fields torch, bimetal or engine, e.g. 1:bimetal=0.0.9 (a test hook).")


def _host(name: str, raw: str) -> None:
    try:
        ipaddress.ip_address(raw.strip())
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an IP address; set it to the address the engine should listen on.") \
            from None


def _device(name: str, raw: str) -> None:
    import torch

    try:
        torch.device(raw.strip())
    except RuntimeError:
        raise UserError(f"{name}={raw!r} is not a torch device; use e.g. cpu or cuda:0.") from None


def _fields(count: int, shape: str, optional: int = 0) -> Check:
    """``count`` numbers separated by ':' (then up to ``optional`` more), the first two and the optional ones
    whole."""
    def check(name: str, raw: str) -> None:
        parts = raw.strip().split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        whole = values[:2] + values[count:]
        if not count <= len(values) <= count + optional or any(v < 0 or not math.isfinite(v) for v in values) or \
                any(v != int(v) for v in whole):
            raise UserError(f"{name}={raw!r} is not valid; write {shape}.")
    return Check(f"`{shape.replace(', e.g. ', '`, e.g. `')}`", check)


def _nonempty(name: str, raw: str) -> None:
    if not raw.strip():
        raise UserError(f"{name} is set but empty; unset it or give a value.")


def _folder(name: str, raw: str) -> None:
    _nonempty(name, raw)
    if not os.path.isdir(raw):
        raise UserError(f"{name}={raw!r} is not a folder; unset it or name the folder a sysfs tree is copied under.")


def _json_object(name: str, raw: str) -> None:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UserError(f"{name} is not a JSON object; it maps setting names to values.")


_FLAG = _choice("0", "1")
_IFACE_LIST = Check("interface names or shell patterns, comma-separated (`eth0,eth1`, `ib*`)", _interfaces)


@dataclass(frozen=True)
class Variable:
    """One ``BIMETAL_*`` variable: its check, its default and what it does (``docs/environment.md`` is made
    from these, by ``reference_page``)."""

    group: str
    """The reference page's section (one of ``GROUPS``)."""
    check: Check
    default: str
    """What applies when the variable is unset, in words."""
    meaning: str


GROUPS = {
    "vendors": "Vendors, devices and threads",
    "network": "Nodes and network interfaces",
    "cf": "cpu-forward transport",
    "dd": "device-direct transport",
    "debug": "Diagnostics and test hooks",
    "internal": "Set by bimetal for its ranks (not for users)",
}
"""Section key -> title, in the order the reference page lists them."""

VARIABLES: dict[str, Variable] = {
    "BIMETAL_SIMULATE": Variable(
        "vendors", Check("vendors by global rank, `nvidia:2,amd:2`", _simulate), "unset: each rank's vendor is its "
        "torch build's", "Simulated vendor of every rank, by global rank (what `--simulate` sets)."),
    "BIMETAL_VENDOR": Variable(
        "vendors", _choice("nvidia", "amd"), "unset", "Simulated vendor of this one process, e.g. per lab node or "
        "per Slurm component under `bimetal slurm --simulate`."),
    "BIMETAL_SIMULATE_DEVICE": Variable(
        "vendors", _choice("cpu", "cuda", "cpu-staged"), "`cpu`", "With `--simulate`: `cuda` trains every simulated "
        "rank on GPU 0 (the GPU check), and the simulated native groups take device tensors through cpu-forward's "
        "staged path; `cpu-staged` keeps the ranks on the CPU but sends the native groups through that same staged "
        "path (the GPU check's `--cpu` rehearsal). Refused without simulation; `cuda` also where torch sees no GPU."),
    "BIMETAL_LAUNCH_FORK": Variable(
        "vendors", _FLAG, "`1`", "bimetal's launcher starts the ranks of a job simulated on the CPU as forks of "
        "itself, with torch already imported (about 3 s of CPU less per rank); `0` starts each as a new "
        "interpreter (for a rank program that needs one, e.g. one that starts `multiprocessing` children with "
        "`spawn`). Jobs on GPUs always start new interpreters."),
    "BIMETAL_THREADS": Variable(
        "vendors", _integer(1), "`1`", "torch CPU threads per trainer rank."),
    "BIMETAL_HOST": Variable(
        "network", Check("any non-empty name", _nonempty), "the host name (plus the network namespace, in the lab)",
        "This rank's node name in the topology: ranks with one name share a node. The lab sets it per namespace; "
        "under `srun`, the Slurm node name."),
    "BIMETAL_SYSFS": Variable(
        "network", Check("a folder", _folder), "`/`", "The folder sysfs is read under when GPUs are paired with "
        "NICs by the PCI topology (`<folder>/sys/bus/pci`, `<folder>/sys/class/net`, `<folder>/sys/class/infiniband`"
        "). For tests and previews on a copy of a node's tree; a real job leaves it unset."),
    "BIMETAL_IFACES": Variable(
        "network", _IFACE_LIST, "every up IPv4 interface less loopback, bridges and container networks, narrowed "
        "to the peers' subnets", "Interfaces the cross-vendor transports may use on this node. The config's "
        "`parallel.interfaces` wins. See [interfaces](clusters-devices-and-interfaces.md#2-network-interfaces-named-"
        "or-chosen-from-what-reaches-the-peers)."),
    "BIMETAL_REACH_S": Variable(
        "network", _number(0.0), "`10`", "Seconds each member of a new cpu-forward or device-direct group has to "
        "reach every other member; `0` skips the check."),
    "BIMETAL_CF_STRIPES": Variable(
        "cf", _integer(1, 62), "the number of `BIMETAL_CF_IFACES` names, else 1", "Gloo contexts (stripes) per "
        "group; a large message is split over them."),
    "BIMETAL_CF_IFACES": Variable(
        "cf", Check("interface names, comma-separated (`eth0,eth1`)", _interfaces), "chosen from `BIMETAL_IFACES`'s "
        "candidates", "The interface of each stripe, used exactly (the lab and the benchmarks use it)."),
    "BIMETAL_CF_CHUNK_BYTES": Variable(
        "cf", _size(1024), "`4M`", "Chunk size of pipelined transfers; each pinned staging slab is the size of the "
        "largest chunk."),
    "BIMETAL_CF_POOL_BUFFERS": Variable(
        "cf", _integer(2), "`8`", "Pinned staging slabs in the pool, its bound in bytes (slabs x chunk); with "
        "several stripes, at least 4 per stripe."),
    "BIMETAL_CF_FORCE_STAGING": Variable(
        "cf", _FLAG, "`0`", "`1` stages CPU tensors through the pinned pool as device tensors are (tests, "
        "`scripts/gpu_check.sh --cpu`)."),
    "BIMETAL_CF_CHECKSUM": Variable(
        "cf", _FLAG, "`0`", "`1` adds a CRC32 to point-to-point messages; corrupted data fails the receive."),
    "BIMETAL_CF_STALL_S": Variable(
        "cf", _number(0.0), "min(10, group timeout / 3)", "Seconds without progress before one stripe of a "
        "point-to-point transfer is left for good and its chunks are re-sent on the others. Must exceed two "
        "chunks' time on the slowest link."),
    "BIMETAL_DD_PROTOCOL": Variable(
        "dd", _choice("rdma", "tcp", "auto"), "`auto`", "The engine's transport; `auto` is RDMA where the host has an "
        "RDMA (verbs) device, else TCP."),
    "BIMETAL_DD_ENGINE": Variable(
        "dd", _choice("mooncake"), "`mooncake`", "The transfer engine adapter."),
    "BIMETAL_DD_HOST": Variable(
        "dd", Check("an IP address", _host), "this rank's address among the interfaces the group agrees on",
        "The address the engine and the control channel listen on."),
    "BIMETAL_DD_DEVICES": Variable(
        "dd", Check("RDMA device names, comma-separated (`mlx5_0,mlx5_1`)", _rdma_devices), "the RDMA device "
        "paired with the rank's GPU by the PCI topology (same PCIe switch, root complex, NUMA node), else every RDMA "
        "device of the node", "The RDMA devices the engine may open; each must exist on the host. Names win over "
        "the pairing `bimetal topo` shows."),
    "BIMETAL_DD_DEVICE": Variable(
        "dd", Check("a torch device (`cpu`, `cuda:0`)", _device), "this rank's GPU, else the CPU", "Where the "
        "receive slots live."),
    "BIMETAL_DD_GID_INDEX": Variable(
        "dd", _integer(0, 255), "the engine picks one", "The RoCE GID index the engine uses, passed on as "
        "`MC_GID_INDEX` (a value the user set there wins). Between nodes it must be a RoCE v2 GID with an IP address "
        "(often 3); the start-up probe names one when a write fails."),
    "BIMETAL_DD_FALLBACK": Variable(
        "dd", _choice("error", "cpu-forward"), "`error`", "When the engine cannot start or the start-up probe "
        "fails: stop with one sentence naming the missing piece, or warn and use cpu-forward."),
    "BIMETAL_DD_CHUNK_BYTES": Variable(
        "dd", _integer(1), "`4194304` (4 MiB)", "Receive-slot size: the eager limit and the rendezvous write "
        "size."),
    "BIMETAL_DD_SLOTS": Variable(
        "dd", _integer(1), "`8`", "Receive slots (credits) per peer."),
    "BIMETAL_DD_WINDOW": Variable(
        "dd", _integer(1), "`16`", "Rendezvous writes in flight per message; on RDMA also the send pool's chunks."),
    "BIMETAL_DD_INLINE_BYTES": Variable(
        "dd", _integer(0, 256 << 10), "`16384`", "Host-tensor messages up to this size ride inside the control "
        "note; `0`: never."),
    "BIMETAL_DD_REG_CACHE_BYTES": Variable(
        "dd", _integer(1), "`4294967296` (4 GiB)", "Bytes of receive tensors kept registered with the engine, "
        "least recently used out first."),
    "BIMETAL_TRACEBACK": Variable(
        "debug", _FLAG, "`0`", "`1` prints the traceback behind a \"stopped in step\" sentence."),
    "BIMETAL_FAULT_KILL": Variable(
        "debug", _fields(2, "rank:step, e.g. 3:6"), "unset", "Fault injection: that rank SIGKILLs itself after "
        "that step (first attempt only)."),
    "BIMETAL_FAULT_KILL_IN_CHECKPOINT": Variable(
        "debug", _fields(2, "rank:step, e.g. 1:4"), "unset", "Fault injection: that rank SIGKILLs itself while the "
        "checkpoint of that step is being written (first attempt only)."),
    "BIMETAL_FAULT_STALL": Variable(
        "debug", _fields(3, "rank:step:seconds[:attempt], e.g. 3:3:300", optional=1), "unset", "Fault injection: "
        "that rank sleeps after that step, in that attempt only (`TORCHELASTIC_RESTART_COUNT`; default 0, the "
        "first)."),
    # tests only: ranks that claim other software versions (bimetal.topology.versions), to test the refusal
    "BIMETAL_TEST_CLAIM_VERSIONS": Variable(
        "debug", Check("`RANK:field=version[,...]`, `;` between ranks (fields `torch`, `bimetal`, `engine`)",
                       _claims), "unset", "Tests only: `1:bimetal=0.0.9` makes rank 1 claim another version "
        "(start-up refuses ranks whose bimetal, torch minor or wire versions differ)."),
    "BIMETAL_LAB": Variable(
        "internal", Check("any non-empty name", _nonempty), "unset", "The lab's id, for the ranks it starts."),
    "BIMETAL_LAB_RANK_ENV": Variable(
        "internal", Check("a JSON object", _json_object), "unset", "Per-rank settings the lab hands each rank "
        "(`{nic}` and `{nic_addr}` are that rank's NIC)."),
    "BIMETAL_LAUNCH_REPORT": Variable(
        "internal", Check("a folder", _nonempty), "unset", "bimetal's launcher: the folder where each rank leaves "
        "its last step and its final sentence."),
}
"""Every variable bimetal reads; ``check_environment`` and ``read`` apply its check."""


def check_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """Refuse the first bad ``BIMETAL_*`` value in one sentence; returns the ``BIMETAL_*`` names bimetal does not
    know (the caller warns about them once per job)."""
    env = os.environ if env is None else env
    unknown = []
    for name in sorted(env):
        if not name.startswith("BIMETAL_"):
            continue
        variable = VARIABLES.get(name)
        if variable is None:
            unknown.append(name)
        elif env[name] != "":
            variable.check(name, env[name])
    return unknown


def unknown_warning(names: list[str]) -> str:
    """The one-line warning about variables bimetal does not read."""
    return (f"bimetal does not know the environment variable(s) {', '.join(names)}; they have no effect "
            "(docs/environment.md lists the variables it reads).")


def read(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the listed variable ``name`` after its check; None when it is unset or empty."""
    check = VARIABLES[name].check  # a KeyError here is a bug: list the variable in VARIABLES first
    raw = (os.environ if env is None else env).get(name, "")
    if raw == "":
        return None
    check(name, raw)
    return raw


def _read_as(name: str, default: T, convert: Callable[[str], T], errors: type[Exception] | tuple[type[Exception], ...],
             not_one: str) -> T:
    """``name`` through ``convert`` (``default`` when unset), then the table's check; a value ``convert``
    refuses is one sentence: ``<name>=<raw> <not_one>``."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = convert(raw)
    except errors:
        raise UserError(f"{name}={raw!r} {not_one}") from None
    read(name)
    return value


def read_int(name: str, default: int) -> int:
    """``name`` as an integer (``default`` when unset); one sentence naming it when it is not one."""
    return _read_as(name, default, int, ValueError, "is not an integer; set it to a whole number")


def read_size(name: str, default: int) -> int:
    """Bytes from ``name``, with the size syntax of ``bimetal bench comm`` (``65536``, ``64K``, ``4M``)."""
    from bimetal.sizes import parse_size

    return _read_as(name, default, parse_size, UserError, "is not a size; write bytes like 65536, 64K or 4M")


def read_float(name: str, default: float) -> float:
    """``name`` as a number (``default`` when unset); one sentence naming it when it is not one."""
    return _read_as(name, default, float, ValueError, "is not a number; set it to seconds, e.g. 5")


def read_flag(name: str) -> bool:
    """True when the 0/1 variable ``name`` is set to 1."""
    return (read(name) or "0").strip() == "1"


def check_needs(simulated: bool, env: Mapping[str, str] | None = None) -> None:
    """Refuse a variable that asks for something this run will not have: a GPU torch cannot see, or a setting
    of simulated ranks in a run that simulates none (it would be ignored without a word)."""
    env = os.environ if env is None else env
    sim_device = (env.get("BIMETAL_SIMULATE_DEVICE") or "").strip().lower()
    if sim_device and not simulated:
        raise UserError(f"BIMETAL_SIMULATE_DEVICE={sim_device} only applies to simulated ranks; add --simulate "
                        "(or BIMETAL_SIMULATE) or unset it.")
    wanted: list[tuple[str, str, int]] = []
    if sim_device == "cuda":
        wanted.append(("BIMETAL_SIMULATE_DEVICE", "cuda", 0))
    dd_device = (env.get("BIMETAL_DD_DEVICE") or "").strip()
    if dd_device.startswith("cuda"):
        number = dd_device.partition(":")[2]
        wanted.append(("BIMETAL_DD_DEVICE", dd_device, int(number) if number.isdigit() else 0))
    if not wanted:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name, value, index in wanted:
        if index >= have:
            sees = f"only {have} GPU(s)" if have else "no GPU"
            raise UserError(f"{name}={value} asks for GPU {index} but this torch ({torch.__version__}) sees {sees}; "
                            "unset it to run on the CPU, or run where that GPU is.")


def reference_page() -> str:
    """``docs/environment.md``: the table above as markdown (``scripts/env_page.py`` writes it; a test holds the
    committed page equal to this)."""
    lines = ["# Environment variables", "",
             "<!-- Generated from bimetal/env.py (VARIABLES) by `python scripts/env_page.py`: edit it there. -->", "",
             "Every `BIMETAL_*` variable bimetal reads. `bimetal train` and `bimetal launch` check each value before "
             "any rank starts, and a rank started by torchrun checks them at its entry point: a bad value is one "
             "sentence naming the variable, exit status 2. A `BIMETAL_*` name bimetal does not read is named in a "
             "warning. Where a config key or an option sets the same thing, it wins (`parallel.interfaces` over "
             "`BIMETAL_IFACES`, a group's `pg_options` over the transport's variables)."]
    for key, title in GROUPS.items():
        lines += ["", f"## {title}", "", "| variable | values | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {v.check.values} | {v.default} | {v.meaning} |"
                  for name, v in VARIABLES.items() if v.group == key]
    return "\n".join(lines) + "\n"
