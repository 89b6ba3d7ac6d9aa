"""Every ``BIMETAL_*`` environment variable a user may set: one table, checked before any rank starts, and
the one reader the code uses.

``VARIABLES`` lists each variable with the check of its values, so that ``bimetal train``/``bimetal launch``
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
from typing import TypeVar

from bimetal.errors import UserError

Check = Callable[[str, str], None]
T = TypeVar("T")


def _integer(least: int, most: int | None = None) -> Check:
    def check(name: str, raw: str) -> None:
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            bounds = f"an integer from {least} to {most}" if most is not None else f"an integer >= {least}"
            raise UserError(f"{name}={raw!r} is not valid; set it to {bounds}.")
    return check


def _size(least: int) -> Check:
    def check(name: str, raw: str) -> None:
        from bimetal.sizes import parse_size

        try:
            value = parse_size(raw)
        except UserError:
            value = -1
        if value < least:
            raise UserError(f"{name}={raw!r} is not valid; set it to a size of at least {least} bytes, like 64K or 4M.")
    return check


def _number(least: float) -> Check:
    def check(name: str, raw: str) -> None:
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < least:
            raise UserError(f"{name}={raw!r} is not valid; set it to a number >= {least:g} (seconds).")
    return check


def _choice(*allowed: str) -> Check:
    def check(name: str, raw: str) -> None:
        if raw.strip().lower() not in allowed:
            raise UserError(f"{name}={raw!r} is not valid; set it to one of {', '.join(allowed)}.")
    return check


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


def _fields(count: int, shape: str) -> Check:
    def check(name: str, raw: str) -> None:
        parts = raw.strip().split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != count or any(v < 0 or not math.isfinite(v) for v in values) or \
                any(v != int(v) for v in values[:2]):
            raise UserError(f"{name}={raw!r} is not valid; write {shape}.")
    return check


def _nonempty(name: str, raw: str) -> None:
    if not raw.strip():
        raise UserError(f"{name} is set but empty; unset it or give a value.")


def _json_object(name: str, raw: str) -> None:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UserError(f"{name} is not a JSON object; it maps setting names to values.")


VARIABLES: dict[str, Check] = {
    "BIMETAL_SIMULATE": _simulate,
    "BIMETAL_VENDOR": _choice("nvidia", "amd"),
    "BIMETAL_CF_STRIPES": _integer(1, 62),
    "BIMETAL_CF_IFACES": _interfaces,
    "BIMETAL_IFACES": _interfaces,
    "BIMETAL_REACH_S": _number(0.0),
    "BIMETAL_CF_CHUNK_BYTES": _size(1024),
    "BIMETAL_CF_POOL_BUFFERS": _integer(2),
    "BIMETAL_CF_CHECKSUM": _choice("0", "1"),
    "BIMETAL_CF_FORCE_STAGING": _choice("0", "1"),
    "BIMETAL_SIMULATE_DEVICE": _choice("cpu", "cuda"),
    "BIMETAL_CF_STALL_S": _number(0.0),
    "BIMETAL_DD_PROTOCOL": _choice("rdma", "tcp", "auto"),
    "BIMETAL_DD_ENGINE": _choice("mooncake"),
    "BIMETAL_DD_HOST": _host,
    "BIMETAL_DD_CHUNK_BYTES": _integer(1),
    "BIMETAL_DD_SLOTS": _integer(1),
    "BIMETAL_DD_WINDOW": _integer(1),
    "BIMETAL_DD_INLINE_BYTES": _integer(0, 256 << 10),
    "BIMETAL_DD_FALLBACK": _choice("error", "cpu-forward"),
    "BIMETAL_DD_DEVICE": _device,
    "BIMETAL_DD_DEVICES": _rdma_devices,
    "BIMETAL_DD_REG_CACHE_BYTES": _integer(1),
    "BIMETAL_THREADS": _integer(1),
    "BIMETAL_HOST": _nonempty,
    "BIMETAL_LAB": _nonempty,
    "BIMETAL_LAB_NICS": _interfaces,
    "BIMETAL_LAB_RANK_ENV": _json_object,
    "BIMETAL_FAULT_KILL": _fields(2, "rank:step, e.g. 3:6"),
    "BIMETAL_FAULT_STALL": _fields(3, "rank:step:seconds, e.g. 3:3:300"),
    "BIMETAL_TRACEBACK": _choice("0", "1"),
    "BIMETAL_LAUNCH_REPORT": _nonempty,
    # tests only: ranks that claim other software versions (bimetal.topology.versions), to test the refusal
    "BIMETAL_TEST_CLAIM_VERSIONS": _claims,
}
"""Variable -> check; each check raises ``UserError`` naming the variable and the values it takes."""


def check_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """Refuse the first bad ``BIMETAL_*`` value in one sentence; returns the ``BIMETAL_*`` names bimetal does not
    know (the caller warns about them once per job)."""
    env = os.environ if env is None else env
    unknown = []
    for name in sorted(env):
        if not name.startswith("BIMETAL_"):
            continue
        check = VARIABLES.get(name)
        if check is None:
            unknown.append(name)
        elif env[name] != "":
            check(name, env[name])
    return unknown


def unknown_warning(names: list[str]) -> str:
    """The one-line warning about variables bimetal does not read."""
    return (f"bimetal does not know the environment variable(s) {', '.join(names)}; they have no effect "
            "(the README lists the variables it reads).")


def read(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the listed variable ``name`` after its check; None when it is unset or empty."""
    check = VARIABLES[name]  # a KeyError here is a bug: list the variable in VARIABLES first
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
