"""The ``--simulate`` / ``BIMETAL_SIMULATE`` syntax: which vendor each global rank plays (``"nvidia:2,amd:2"``).

Low in the layers (errors only), so the environment table (``bimetal.env``) can check the variable without
importing the topology package that reads it.
"""

from __future__ import annotations

import functools

from bimetal.errors import UserError

SIMULATED_VENDORS = ("nvidia", "amd")


class SimulationSpecError(UserError, ValueError):
    """A ``--simulate`` / ``BIMETAL_SIMULATE`` value that cannot be parsed."""


def parse_simulate(spec: str) -> list[str]:
    """Vendor of each global rank for a spec like ``"nvidia:2,amd:2"`` (ranks 0-1 nvidia, 2-3 amd). Parsed once
    per process and spec (a rank asks for its vendor from many places)."""
    return list(_parse(spec))


def strip_simulate(argv: list[str]) -> list[str]:
    """``argv`` less its ``--simulate X`` / ``--simulate=X``: what a command hands its ranks, which learn the
    simulation from one channel only, ``BIMETAL_SIMULATE`` in their environment (set by the launcher)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--simulate":
            skip = True
        elif not arg.startswith("--simulate="):
            out.append(arg)
    return out


@functools.lru_cache(maxsize=16)
def _parse(spec: str) -> tuple[str, ...]:
    vendors: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        name, sep, count = part.partition(":")
        if not sep or name not in SIMULATED_VENDORS or not count.isdigit() or int(count) < 1:
            raise SimulationSpecError(
                f"bad simulation entry {part!r} in {spec!r}: expected vendor:count with vendor one of "
                f"{', '.join(SIMULATED_VENDORS)} and count >= 1, e.g. 'nvidia:2,amd:2'"
            )
        vendors.extend([name] * int(count))
    return tuple(vendors)
