"""The one layout check of a job on a cluster spec: ``bimetal.parallel.layout.plan_layout`` on the spec's GPUs.

Every command that checks a layout against a cluster spec asks this: ``bimetal train`` (its preparation and
``--dry-run``, with ``parallel.cluster``), ``bimetal slurm`` (the components of the script) and ``bimetal plan``
(one layout, ``--pp`` or ``--config``). A simulated world is the same ``plan_layout`` on one host
(``bimetal.train.preflight.check_layout``). The spec's nodes become hosts and each GPU one rank, in the job's
rank order (``bimetal.plan.sbatch.islands``: the order ``bimetal slurm`` gives the components), so a
tensor-parallel group that would leave a node, or a stage that would span vendors, is refused in the same
sentence wherever the layout is checked.
"""

from __future__ import annotations

from bimetal.parallel.layout import Layout, ParallelDims, plan_layout
from bimetal.plan.sbatch import islands
from bimetal.plan.spec import ClusterSpec
from bimetal.topology.records import ClusterView, RankRecord
from bimetal.topology.slurm import Island


def spec_view(parts: list[Island]) -> ClusterView:
    """The ranks of a job on these node groups: one per GPU, node ``<group>-<n>`` as its host."""
    records, rank = [], 0
    for isl in parts:
        for node in range(isl.nodes):
            for local in range(isl.gpus_per_node):
                records.append(RankRecord(rank, local, f"{isl.name}-{node}", isl.vendor, isl.gpu, 0))
                rank += 1
    return ClusterView(records)


def check_on_spec(dims: ParallelDims, spec: ClusterSpec, parts: list[Island] | None = None) -> Layout:
    """``dims`` laid out on ``spec`` (``parts``: its node groups in the job's order, default ``islands(spec)``);
    ``LayoutError`` (a ``UserError``) naming the key, the ranks and the nodes when it cannot be."""
    return plan_layout(spec_view(parts if parts is not None else islands(spec)), dims)
