"""``NamedGroup``: a Python ``ProcessGroup`` with the name, description, rank and size torch asks every group
for (DeviceMesh, DTensor and functional collectives call these), shared by the transports' base and the
per-hop pipeline group."""

from __future__ import annotations

import torch.distributed as dist


class NamedGroup(dist.ProcessGroup):
    """Keeps the group's name and description as torch sets them, and answers rank, size and back-end name."""

    backend_name = "bimetal"

    def __init__(self, rank: int, size: int) -> None:
        # (torch's stubs list only the overload that takes a store; the (rank, size) one exists)
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._name = ""
        self._desc = ""

    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's method name)
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._desc

    def getBackendName(self) -> str:  # noqa: N802
        return self.backend_name

    def name(self) -> str:  # type: ignore[override]
        return self.backend_name

    def size(self) -> int:  # type: ignore[override]
        return self._size

    def rank(self) -> int:  # type: ignore[override]
        return self._rank
