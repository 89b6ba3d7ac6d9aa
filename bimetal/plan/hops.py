"""Each pipeline hop priced on its own link, as the trainer builds it (``bimetal.parallel.pipeline_groups``).

A hop joins the ranks of two neighbouring stages; per microbatch it carries one activation forward and its
gradient back. Its link is that of its kind:

* **inside a vendor island**: the vendor's library - over the node's GPU fabric (``intra_gbps``) when both
  stages share a node, else between nodes at the NIC line rate (the RDMA physics of ``hostpath``; without
  GPUDirect RDMA the copies through host memory are priced as cpu-forward's);
* **between islands**: the cross-vendor transport chosen (``cpu-forward``, ``device-direct`` where both ends
  have GPUDirect RDMA, else cpu-forward, or stock ``gloo``);
* with ``homogeneous = "gloo"`` (the ladder's all-Gloo rung) a hop inside an island is stock Gloo too.

``hop_costs`` is the one place both the planner's search (``search.evaluate``) and the trainer's dry-run
(``bimetal train --dry-run`` with ``parallel.cluster``) price hops; stages lie on the spec's node groups in file
order, ``width = dp * tp`` GPUs each.
"""

from __future__ import annotations

from dataclasses import dataclass

from bimetal.plan import hostpath
from bimetal.plan.spec import NodeGroup


@dataclass(frozen=True)
class HopCost:
    """One hop between stages ``stages[0]`` and ``stages[0] + 1``: its link and the time of one transfer."""

    stages: tuple[int, int]
    groups: tuple[str, str]
    """Node group of each end."""
    cross_vendor: bool
    link: str
    """``native (node fabric)``, ``native (between nodes)``, ``gloo``, ``cpu-forward`` or ``device-direct``."""
    priced_as: str
    """The physics used: ``intra`` (GPU fabric), or a ``hostpath`` transport."""
    nbytes: float
    """One activation (or gradient) of one microbatch, this tp rank's share."""
    seconds: float
    """One transfer of ``nbytes`` one way while every pair of the boundary transfers at once."""

    def describe(self) -> str:
        note = "" if self.priced_as in (self.link, "intra") or self.link.startswith("native") and \
            self.priced_as == "device-direct" else f" (priced as {self.priced_as})"
        return f"{self.link}{note}"


def usable(transport: str, a: NodeGroup, b: NodeGroup) -> str:
    """device-direct needs GPUDirect RDMA on both ends; otherwise the pair falls back to cpu-forward."""
    return "cpu-forward" if transport == "device-direct" and not (a.gpudirect and b.gpudirect) else transport


def hop_costs(stage_groups: list[NodeGroup], width: int, nbytes: float, transport: str,
              homogeneous: str = "native", nics: str = "per-gpu") -> list[HopCost]:
    """The ``len(stage_groups) - 1`` hops of a pipeline whose stage ``j`` runs on ``width`` GPUs of
    ``stage_groups[j]`` (consecutive stages of one group fill its nodes in order)."""
    out = []
    for j in range(len(stage_groups) - 1):
        g, other = stage_groups[j], stage_groups[j + 1]
        cross = other.vendor != g.vendor
        # Neighbouring stages of one group share a node unless the boundary falls on a node edge.
        same_node = other is g and width < g.gpus_per_node and (j + 1) * width % g.gpus_per_node != 0
        pairs = min(width, g.gpus_per_node, other.gpus_per_node)
        if not cross and homogeneous == "gloo":
            link = priced = "gloo"
            seconds = hostpath.pair_transfer_seconds(nbytes, "gloo", g, other, nics, pairs)
        elif same_node:
            link, priced = "native (node fabric)", "intra"
            seconds = nbytes / (g.intra_gbps * 1e9)
        else:
            link = transport if cross else "native (between nodes)"
            priced = usable(transport if cross else "device-direct", g, other)
            seconds = hostpath.pair_transfer_seconds(nbytes, priced, g, other, nics, pairs)
        out.append(HopCost((j, j + 1), (g.name, other.name), cross, link, priced, nbytes, seconds))
    return out


def format_hops(hops: list[HopCost], microbatches: int) -> list[str]:
    """One line per hop: stages, node groups, link, and seconds per step (an activation and a gradient per
    microbatch)."""
    return [f"  hop {h.stages[0]}->{h.stages[1]} {h.groups[0]}->{h.groups[1]}: {h.describe()}, "
            f"{h.nbytes / 1e6:.2f} MB each way per microbatch, {2 * h.seconds * microbatches * 1e3:.1f} ms per step"
            for h in hops]
