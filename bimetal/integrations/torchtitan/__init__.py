"""torchtitan's own trainer on bimetal: a world that spans vendors, per-dimension back-ends, uneven splits.

Install with bimetal's ``[torchtitan]`` extra (``pip install -e '.[torchtitan]'`` in a clone; pinned to
``TORCHTITAN_VERSION``). Entry points: ``bimetal titan ...`` and ``python -m bimetal.integrations.torchtitan ...``
(``cli``). Modules:

* ``mesh``: which back-end each torchtitan mesh dimension gets (pure Python), the refusal of mixed native dims;
* ``_torch_hooks``: the one private torch API hooked (where DeviceMesh creates a dimension's groups);
* ``_torch_compat``: adapters for two torch APIs torchtitan 0.3.0 calls that torch 2.13 lacks;
* ``trainer``: ``BimetalTrainer`` / ``BimetalParallelDims``, torchtitan's public extension points;
* ``split``: bimetal's layer split as ``parallelism.module_fqns_per_model_part``;
* ``plan``: a planner plan as a torchtitan overrides file (``bimetal plan --write-titan``);
* ``cpu_support``: stand-ins for running on a CPU-only machine (tests, ``--simulate``), never on GPUs.

Importing this package does not import torchtitan.
"""

from __future__ import annotations

import importlib.util

TORCHTITAN_VERSION = "0.3.0"


def available() -> bool:
    """Whether torchtitan is installed."""
    return importlib.util.find_spec("torchtitan") is not None
