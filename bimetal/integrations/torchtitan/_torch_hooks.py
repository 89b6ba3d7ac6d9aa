"""The one private torch API the torchtitan integration hooks: where DeviceMesh creates a dimension's groups.

torchtitan 0.3.0 builds its mesh inside ``ParallelDims.build_mesh`` with ``DeviceMesh._unflatten`` and
``_flatten``; it passes ``backend_override`` only to mark unused dimensions ``"fake"``, so every other
dimension would get the world group's back-end. ``DeviceMesh._init_one_process_group`` is the single
function both paths call for each dimension, with the dimension's name and rank layout: while
``build_mesh`` runs, it is wrapped so that a dimension torchtitan left without an override gets the
back-end ``MeshBackends.choose`` picks from the dimension's real groups (the fake ones stay fake). A ``pp``
dimension whose pipelines span vendors is made by bimetal itself (``MeshBackends.per_hop``: a
``bimetal_per_hop`` group per pipeline, with its pairs' groups and its collectives group): the hook creates them
and returns this rank's pipeline group, as the function would.

Checked against torch 2.13.0 and torchtitan 0.3.0; with another torch the hook refuses to run rather than
guess (``CHECKED_TORCH``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from bimetal.integrations.torchtitan.mesh import MeshBackends

CHECKED_TORCH = ("2.13",)
WORLD_DIM = "world"
"""torchtitan's root mesh dimension: it keeps the world group bimetal created."""


def _check_torch() -> None:
    version = torch.__version__.split("+")[0]
    if not version.startswith(CHECKED_TORCH) or not hasattr(DeviceMesh, "_init_one_process_group"):
        raise RuntimeError(
            f"bimetal's torchtitan mesh hook was checked against torch {', '.join(CHECKED_TORCH)} "
            f"(DeviceMesh._init_one_process_group); torch {torch.__version__} needs the hook re-checked"
        )


@contextlib.contextmanager
def mesh_backends(chooser: MeshBackends) -> Iterator[None]:
    """While active, each new mesh dimension's groups get the back-end ``chooser`` picks for them."""
    _check_torch()
    from torch.distributed._mesh_layout import _MeshLayout

    original = DeviceMesh.__dict__["_init_one_process_group"]
    create = original.__func__

    def init_one(sub_layout: Any, rank_map: torch.Tensor, dim_name: str, backend_override: Any) -> Any:
        if dim_name != WORLD_DIM and tuple(backend_override) == (None, None):
            rows = _MeshLayout([sub_layout]).remap_to_tensor(rank_map).tolist()
            groups = [tuple(int(r) for r in row) for row in rows]
            per_hop = chooser.per_hop(groups) if dim_name == "pp" else []
            if per_hop:
                return _create_pipelines(chooser, per_hop)
            backend = chooser.choose(dim_name, groups)
            chooser.record(dim_name, groups, backend)
            backend_override = (backend, None)
        return create(sub_layout, rank_map, dim_name, backend_override)

    DeviceMesh._init_one_process_group = staticmethod(init_one)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._init_one_process_group = original  # type: ignore[method-assign]


def _create_pipelines(chooser: MeshBackends, specs: list[Any]) -> str | None:
    """Create every pipeline's groups (all ranks, same order) and return this rank's pp group name."""
    from datetime import timedelta

    import torch.distributed as dist

    from bimetal.parallel.groups import create_groups

    made = create_groups(specs, timedelta(seconds=chooser.timeout_s))
    chooser.record_specs(specs)
    me = dist.get_rank()
    mine = next((s.name for s in specs if s.axis == "pp" and me in s.ranks), None)
    pg = made.get(mine) if mine else None
    return pg.group_name if pg is not None else None
