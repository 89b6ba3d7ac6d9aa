"""The transports a process group can use, by the names users write: one table every layer reads.

A name (``cpu-forward``) is what configs, specs and command lines say; the back-end is what torch.distributed
is given (``bimetal_cpu_forward``); the module builds the process group (``create_process_group``), imported
only when a group asks for it. Pure data: the planner reads it without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_FORWARD = "bimetal_cpu_forward"
DEVICE_DIRECT = "bimetal_device_direct"
SIM_NATIVE = "bimetal_sim_native"
"""The native back-end under simulation (Gloo that refuses a group mixing vendors, like NCCL/RCCL)."""
HOST_COPY = "bimetal_host_copy"
"""Reference boundary of the GPU ladder: copy to host, stock Gloo, copy back (``bimetal.comm.reference``)."""
PER_HOP = "bimetal_per_hop"
"""A pipeline group that routes each send and receive to the group of its pair of ranks: native inside a vendor,
a transport across (``bimetal.comm.per_hop``); built by ``bimetal.parallel.pipeline_groups``, never chosen by name."""
IDEAL = "bimetal_ideal"
"""Reference boundary of the GPU ladder: the schedule's order kept, no payload moved (``bimetal.comm.reference``).
Neither is in ``TABLE``: they measure transports, nobody trains on them."""


@dataclass(frozen=True)
class Transport:
    """One transport of groups that span vendors."""

    name: str
    """What configs and command lines say: ``cpu-forward``."""
    backend: str
    """The torch.distributed back-end name: ``bimetal_cpu_forward``."""
    module: str | None
    """Module whose ``create_process_group`` builds it (None: a stock torch back-end)."""
    doc: str
    wire: int = 0
    """Version of what the transport puts on the wire (its framing, control notes and store records); ranks
    whose versions differ are refused at start-up (``bimetal.topology.versions``). Raise it with any change
    an older peer would misread. 0: not bimetal's (stock Gloo speaks torch's protocol)."""


TABLE = (
    Transport("cpu-forward", CPU_FORWARD, "bimetal.comm.cpu_forward",
              "chunk-pipelined staging through pinned host memory, striped over TCP connections and NICs", wire=1),
    Transport("device-direct", DEVICE_DIRECT, "bimetal.comm.device_direct",
              "RDMA between GPU memories through a transfer engine (falls back to cpu-forward where allowed)",
              wire=1),
    Transport("gloo", "gloo", None, "stock Gloo over TCP: the baseline of an unmodified PyTorch job"),
)
TRANSPORTS = {t.name: t for t in TABLE}
"""Name -> transport, in table order."""
NAMES = tuple(TRANSPORTS)
BIMETAL = tuple(t.name for t in TABLE if t.module is not None)
"""bimetal's own transports (the planner's search space for cross-vendor pipeline groups)."""
DEFAULT = "cpu-forward"
"""The transport of every group that spans vendors (pipeline and data-parallel) unless one is chosen."""
