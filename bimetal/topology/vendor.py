"""Which GPU vendor this process runs on: the one place bimetal reads it.

Real hardware: ``torch.version.hip`` set means AMD (ROCm torch also reports device type ``"cuda"``),
``torch.version.cuda`` set means NVIDIA, neither means CPU. Simulation overrides both:
``BIMETAL_VENDOR`` names this process's vendor, or ``BIMETAL_SIMULATE="nvidia:2,amd:2"`` assigns
vendors to global ranks in order (what ``--simulate`` on the CLI sets for the ranks it starts).
"""

from __future__ import annotations

import os
from types import ModuleType

from bimetal.env import read as read_env
from bimetal.simulate import SIMULATED_VENDORS, SimulationSpecError, parse_simulate

VENDORS = ("nvidia", "amd", "cpu")
SIMULATE_ENV = "BIMETAL_SIMULATE"
VENDOR_ENV = "BIMETAL_VENDOR"
__all__ = ["SIMULATED_VENDORS", "SimulationSpecError", "parse_simulate"]  # re-exported: their home is bimetal.simulate


def hardware_vendor(torch_module: ModuleType | None = None) -> str:
    """The vendor of the torch build in use: from ``torch.version.hip`` / ``torch.version.cuda``."""
    if torch_module is None:
        import torch

        torch_module = torch
    version = torch_module.version
    if getattr(version, "hip", None):
        return "amd"
    if getattr(version, "cuda", None) and torch_module.cuda.is_available():
        return "nvidia"
    return "cpu"


def simulated_vendor(rank: int | None = None, env: dict[str, str] | None = None) -> str | None:
    """The simulated vendor of ``rank`` (default: ``$RANK``), or None when not simulating."""
    vendor = read_env(VENDOR_ENV, env)
    if vendor:
        if vendor not in SIMULATED_VENDORS:
            raise SimulationSpecError(
                f"{VENDOR_ENV}={vendor!r} is not a vendor; use one of {', '.join(SIMULATED_VENDORS)}"
            )
        return vendor
    spec = read_env(SIMULATE_ENV, env)
    if not spec:
        return None
    vendors = parse_simulate(spec)
    if rank is None:
        rank = int((os.environ if env is None else env).get("RANK", "0"))
    if not 0 <= rank < len(vendors):
        raise SimulationSpecError(
            f"rank {rank} is outside the simulated cluster {spec!r} of {len(vendors)} ranks; "
            "the simulation spec must cover the whole world"
        )
    return vendors[rank]


def is_simulated(env: dict[str, str] | None = None) -> bool:
    return bool(read_env(VENDOR_ENV, env) or read_env(SIMULATE_ENV, env))


def detect_vendor(rank: int | None = None, torch_module: ModuleType | None = None) -> str:
    """This process's vendor: simulation setting first, then the torch build."""
    return simulated_vendor(rank) or hardware_vendor(torch_module)
