"""``FakeCudaDevices``: a test double of torch's CUDA device table, for a CPU-only torch.

It stands in for the runtime of a node with ``count`` GPUs (CUDA or ROCm torch: both say ``cuda``) in the calls
bimetal makes to place a rank and its transports: ``is_available``, ``device_count``, ``current_device``,
``set_device``, ``get_device_properties``, the ``torch.cuda.device`` guard, ``torch.cuda.Stream`` and
``torch.empty``/``torch.zeros`` with a CUDA device or pinned memory. There is no GPU memory: an allocation on
``cuda:N`` returns a CPU tensor of the size asked, and the double records the device it was asked on
(``allocated_on``); a pinned allocation records the device current at the time (``pinned_on``: where the runtime would
make its context); a stream records its device (``FakeStream``). Installed through pytest's ``monkeypatch``, so it is
gone after the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch


@dataclass
class FakeProperties:
    """What ``torch.cuda.get_device_properties`` answers for one fake GPU."""

    name: str
    total_memory: int


class FakeStream:
    """Stands in for ``torch.cuda.Stream``: it only remembers the device it was made for."""

    def __init__(self, table: FakeCudaDevices, device: Any = None, priority: int = 0) -> None:
        self.device = table.as_device(device)

    def wait_event(self, event: object) -> None:
        pass


class FakeCudaDevices:
    """A node of ``count`` GPUs as the CUDA runtime would show it (see the module docstring)."""

    def __init__(self, count: int = 8, name: str = "FAKE GPU 80GB", memory: int = 80 * 2**30) -> None:
        self.count, self.name, self.memory = count, name, memory
        self.current = 0
        self.set_calls: list[int] = []
        self.allocated_on: list[int] = []
        self.pinned_on: list[int] = []
        self.streams: list[FakeStream] = []

    def as_device(self, device: Any) -> torch.device:
        if device is None:
            return torch.device("cuda", self.current)
        if isinstance(device, int):
            return torch.device("cuda", device)
        dev = torch.device(device)
        return torch.device("cuda", self.current if dev.index is None else dev.index) if dev.type == "cuda" else dev

    def _index(self, device: Any) -> int:
        index = self.as_device(device).index
        assert index is not None and 0 <= index < self.count, f"no fake GPU {device!r} among {self.count}"
        return index

    def set_device(self, device: Any) -> None:
        self.current = self._index(device)
        self.set_calls.append(self.current)

    def properties(self, device: Any = None) -> FakeProperties:
        self._index(device)
        return FakeProperties(self.name, self.memory)

    def stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        s = FakeStream(self, device, priority)
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def guard(self, device: Any) -> Iterator[None]:
        before = self.current
        self.current = self._index(device)
        try:
            yield
        finally:
            self.current = before

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCudaDevices:
        def allocator(real: Any) -> Any:
            def allocate(*size: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
                if device is not None and torch.device(device).type == "cuda":
                    self.allocated_on.append(self._index(device))
                    return real(*size, **kwargs)
                if pin_memory:
                    self.pinned_on.append(self.current)
                    return real(*size, **kwargs)
                return real(*size, device=device, **kwargs)
            return allocate

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "Stream", self.stream)
        monkeypatch.setattr(torch.cuda, "device", self.guard)
        monkeypatch.setattr(torch, "empty", allocator(torch.empty))
        monkeypatch.setattr(torch, "zeros", allocator(torch.zeros))
        return self
