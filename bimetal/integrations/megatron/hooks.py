"""The megatron-core functions the integration hooks, checked against the supported release (``CHECKED``).

* ``parallel_state.create_group``: every group ``initialize_model_parallel`` makes goes through it (by its module
  name, at call time); the hook gives each the back-end ``groups.MegatronGroups`` chooses;
* ``parallel_state.initialize_model_parallel``: a layout Megatron refuses before making any group ends in one
  sentence, and rank 0 prints the group table once the groups exist;
* ``parallel_state.destroy_model_parallel``: Megatron forgets its groups but leaves them open; the hook destroys
  the ones it made, so a script that runs several layouts in turn does not pile up open transports (sockets,
  engines) from the layouts before;
* ``p2p_communication._p2p_ops`` (``batch_p2p_comm=False``): with a pipeline group of two ranks Megatron sends one
  direction over the world group unless the group's back-end is ``ucc``, to overlap two NCCL communicators. The
  world cannot carry cross-vendor device tensors natively, so bimetal's version keeps both directions on the
  pipeline group, in Megatron's own even/odd order (its ``ucc`` path);
* ``p2p_communication._batched_p2p_ops`` (``batch_p2p_comm=True``): Megatron posts send-prev, recv-prev, send-next,
  recv-next. When the previous and the next rank are one peer (pp=2 with the interleaved schedule) two same-shaped
  messages go to that peer in one batch, and every back-end (Gloo, NCCL, bimetal's) matches a peer's messages in
  the order they are posted: the peer's receive-from-prev takes the gradient meant for its receive-from-next,
  and the losses are silently wrong. bimetal's version posts sends next-then-prev and receives prev-then-next,
  the order the unbatched path uses, so each message meets the receive it was meant for.

Installed by ``bimetal.integrations.megatron.initialize`` for the rest of the process (a Megatron job lives as long
as its process); nothing is hooked on import.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from bimetal.errors import UserError
from bimetal.integrations.megatron.groups import MegatronGroups

CHECKED = ("0.16.",)
"""megatron-core releases whose hooked functions were read and tested (0.16.1 is the newest on Python 3.11)."""
HOOKED = ("parallel_state.create_group", "parallel_state.initialize_model_parallel",
          "parallel_state.destroy_model_parallel",
          "pipeline_parallel.p2p_communication._p2p_ops", "pipeline_parallel.p2p_communication._batched_p2p_ops")


def megatron_version() -> str:
    """The installed megatron-core's version, read from its package metadata (importing megatron.core costs seconds;
    a source checkout without metadata answers through ``package_info``); ``UserError`` if it is missing."""
    import importlib.metadata
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UserError("megatron-core is not installed; install bimetal's [megatron] extra "
                        "(pip install 'megatron-core==0.16.1')")
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info

        return str(package_info.__version__)


def check_release(functions: bool = True) -> str:
    """The installed release, if bimetal supports it (``CHECKED``) and (``functions``) every hooked function is
    there; ``functions=False`` reads the version only (the launcher, before any rank imports megatron-core)."""
    version = megatron_version()
    if not version.startswith(CHECKED):
        raise UserError(f"megatron-core {version} is not a release bimetal was checked against "
                        f"({', '.join(c + 'x' for c in CHECKED)}); install megatron-core==0.16.1 "
                        "(bimetal's [megatron] extra)")
    import importlib

    for where in HOOKED if functions else ():
        module, name = where.rsplit(".", 1)
        if not hasattr(importlib.import_module(f"megatron.core.{module}"), name):
            raise UserError(f"megatron-core {version} has no {where}, which bimetal hooks; install "
                            "megatron-core==0.16.1")
    return version


def refuse(message: str) -> NoReturn:
    """One sentence (to bimetal's launcher when it started this rank, else stderr) and exit status 2: the end of a
    user's error inside a script, where no bimetal command is there to catch it."""
    from bimetal.supervisor import report_outcome

    if not report_outcome(2, message):
        print(f"bimetal megatron: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def install(chooser: MegatronGroups) -> None:
    """Hook the five functions (see the module docstring). Raises ``UserError`` when Megatron's groups exist."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import p2p_communication

    if parallel_state.model_parallel_is_initialized():
        raise UserError("initialize_model_parallel already ran, so Megatron's groups were made without bimetal's "
                        "back-ends; call bimetal.integrations.megatron.initialize() before it")
    create = parallel_state.create_group
    initialize = parallel_state.initialize_model_parallel
    destroy = parallel_state.destroy_model_parallel
    made: list[Any] = []
    created = [0]  # groups made so far (a layout refusal comes before the first of its call)

    def create_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                     use_local_synchronization: bool = False, group_desc: Any = None) -> Any:
        try:
            chosen = chooser.choose(ranks, backend, group_desc)
        except UserError as exc:
            refuse(str(exc))
        created[0] += 1
        group = create(ranks, timeout=timeout, backend=chosen, pg_options=pg_options if chosen == backend else None,
                       use_local_synchronization=use_local_synchronization, group_desc=group_desc)
        if backend != "gloo":  # Megatron destroys its own Gloo groups in destroy_model_parallel
            made.append(group)
        return group

    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        out = destroy(*args, **kwargs)
        for group in made:
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        made.clear()
        return out

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        before = created[0]
        chooser.begin()
        try:
            out = initialize(*args, **kwargs)
        except (RuntimeError, AssertionError) as exc:
            if created[0] > before:
                raise  # after groups were made: not a layout refusal
            refuse(f"megatron-core refused the layout ({exc or type(exc).__name__}) for a world of "
                   f"{dist.get_world_size()} ranks; choose sizes whose product divides it")
        if dist.get_rank() == 0:
            print("bimetal groups (megatron-core):\n" + chooser.table(), flush=True)
        return out

    parallel_state.create_group = create_group
    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.destroy_model_parallel = destroy_model_parallel
    p2p_communication._p2p_ops = p2p_ops
    p2p_communication._batched_p2p_ops = batched_p2p_ops


def p2p_ops(*, tensor_send_prev: torch.Tensor | None, tensor_recv_prev: torch.Tensor | None,
            tensor_send_next: torch.Tensor | None, tensor_recv_next: torch.Tensor | None, group: dist.ProcessGroup,
            prev_pipeline_rank: int, next_pipeline_rank: int) -> dict[str, Any]:
    """Megatron's ``_p2p_ops`` with every message on the pipeline group (never the world): even ranks send before
    they receive, odd ranks receive first, so no two ranks wait on each other's send."""
    reqs: dict[str, Any] = {}
    even = group.rank() % 2 == 0
    steps = [("send_next", tensor_send_next, next_pipeline_rank, dist.isend),
             ("recv_prev", tensor_recv_prev, prev_pipeline_rank, dist.irecv),
             ("send_prev", tensor_send_prev, prev_pipeline_rank, dist.isend),
             ("recv_next", tensor_recv_next, next_pipeline_rank, dist.irecv)]
    if not even:  # Megatron's odd order: recv_prev, send_next, recv_next, send_prev
        steps = [steps[1], steps[0], steps[3], steps[2]]
    for name, tensor, peer, op in steps:
        if tensor is not None:
            reqs[name] = op(tensor, peer, group=group)
    return reqs


def batched_p2p_ops(*, tensor_send_prev: torch.Tensor | None, tensor_recv_prev: torch.Tensor | None,
                    tensor_send_next: torch.Tensor | None, tensor_recv_next: torch.Tensor | None,
                    group: dist.ProcessGroup, prev_pipeline_rank: int, next_pipeline_rank: int) -> list[Any]:
    """Megatron's ``_batched_p2p_ops`` posting sends next-then-prev and receives prev-then-next: where the previous
    and the next rank are one peer, its send-next meets this rank's receive-prev (see the module docstring)."""
    ops = [dist.P2POp(op, tensor, peer, group) for tensor, peer, op in (
        (tensor_send_next, next_pipeline_rank, dist.isend), (tensor_recv_prev, prev_pipeline_rank, dist.irecv),
        (tensor_send_prev, prev_pipeline_rank, dist.isend), (tensor_recv_next, next_pipeline_rank, dist.irecv),
    ) if tensor is not None]
    return dist.batch_isend_irecv(ops) if ops else []
