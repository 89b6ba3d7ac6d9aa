"""megatron-core's trainer on bimetal: one call before Megatron builds its groups (docs/megatron.md).

    import bimetal.integrations.megatron as bimetal_megatron
    bimetal_megatron.initialize()                      # before initialize_model_parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=..., pipeline_model_parallel_size=...)

After the call every group Megatron creates gets the back-end bimetal's classification gives it: native inside a
vendor, the chosen transport (cpu-forward or device-direct) for a group that spans vendors. Install with bimetal's
``[megatron]`` extra (megatron-core ``MEGATRON_VERSION``). Entry points: this call in a script, and
``bimetal megatron --simulate nvidia:2,amd:2 -- SCRIPT ARGS`` (``cli``) for a script without it. Modules:

* ``groups``: which back-end each Megatron group gets (pure Python), the group table;
* ``hooks``: the megatron-core functions hooked (group creation, the pipeline's sends and receives);
* ``cpu_support``: stand-ins for running on a CPU-only machine (tests, ``--simulate``), never on GPUs;
* ``traffic``: counts the operations each process group carries (the example's ``--count-ops``);
* ``cli``: ``bimetal megatron`` and the rank runner (``python -m bimetal.integrations.megatron``).

Importing this package imports neither megatron-core nor torch.distributed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

MEGATRON_VERSION = "0.16.1"


@dataclass(frozen=True)
class Settings:
    """What ``initialize`` was called with (the first call decides)."""

    transport: str
    all_gloo: bool


_settings: Settings | None = None
_chooser: Any = None
"""The ``groups.MegatronGroups`` the hook asks (set by the first ``initialize``)."""


def available() -> bool:
    """Whether megatron-core is installed."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no top-level megatron package
        return False


def initialize(transport: str | None = None, all_gloo: bool | None = None, timeout_s: float = 600.0) -> None:
    """Create (or join) the world, learn every rank's vendor and hook Megatron's group creation; call it on every
    rank before ``parallel_state.initialize_model_parallel``. ``transport``: of groups that span vendors
    (``cpu-forward``, the default, or ``device-direct``); ``all_gloo``: reference run, every group on Gloo
    (simulation only). Without a GPU it also installs the CPU stand-ins (``cpu_support``).

    Later calls keep the first call's settings (``bimetal megatron`` calls it before the script does); one that
    names different ones is refused. Errors a user can cause end the process with one sentence, exit status 2.
    """
    from bimetal.errors import UserError

    global _settings
    try:
        if _settings is not None:
            if transport not in (None, _settings.transport) or all_gloo not in (None, _settings.all_gloo):
                raise UserError(f"initialize() already ran with transport={_settings.transport!r}, "
                                f"all_gloo={_settings.all_gloo}; a later call cannot change them")
            return
        settings = Settings(transport or "cpu-forward", bool(all_gloo))
        _start(settings, timeout_s)
        _settings = settings
    except UserError as exc:
        _refuse(str(exc))


def _start(settings: Settings, timeout_s: float) -> None:
    from datetime import timedelta

    from bimetal.errors import UserError
    from bimetal.integrations.common import start_world
    from bimetal.integrations.megatron import cpu_support, hooks
    from bimetal.integrations.megatron.groups import MegatronGroups
    from bimetal.topology.vendor import is_simulated

    version = hooks.check_release()
    if settings.all_gloo and not is_simulated():
        raise UserError("all_gloo is a reference for simulated runs (bimetal megatron --simulate)")
    if cpu_support.needed():
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        for line in cpu_support.install():
            print(line, file=sys.stderr, flush=True)
    view = start_world(settings.all_gloo, timedelta(seconds=timeout_s))
    chooser = MegatronGroups([view.vendor_of(r) for r in range(view.world_size)], settings.transport,
                             simulated=is_simulated(), all_gloo=settings.all_gloo)
    hooks.install(chooser)
    global _chooser
    _chooser = chooser
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"bimetal: megatron-core {version}, groups that span vendors on {settings.transport}"
              + (" (reference run: every group on Gloo)" if settings.all_gloo else ""), flush=True)


def use(transport: str | None = None, all_gloo: bool | None = None) -> None:
    """The back-ends of the groups the next ``initialize_model_parallel`` makes, for a script that runs several
    layouts in turn (``destroy_model_parallel`` between them); settings not named stay. After ``initialize``."""
    from bimetal.errors import UserError

    global _settings
    try:
        from megatron.core import parallel_state

        if _settings is None or _chooser is None:
            raise UserError("use() changes what initialize() set up; call initialize() first")
        if parallel_state.model_parallel_is_initialized():
            raise UserError("use() applies to the next initialize_model_parallel; call destroy_model_parallel first")
        settings = Settings(transport or _settings.transport,
                            _settings.all_gloo if all_gloo is None else all_gloo)
        from bimetal.transports import BIMETAL

        if settings.transport not in BIMETAL:
            raise UserError(f"transport {settings.transport!r} is unknown; use {' or '.join(BIMETAL)}")
        if settings.all_gloo and not _chooser.simulated:
            raise UserError("all_gloo is a reference for simulated runs (bimetal megatron --simulate)")
        _chooser.transport, _chooser.all_gloo = settings.transport, settings.all_gloo
        _settings = settings
    except UserError as exc:
        _refuse(str(exc))


def _refuse(message: str) -> None:
    from bimetal.integrations.megatron.hooks import refuse

    refuse(message)
