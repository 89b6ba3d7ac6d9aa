"""The names the transfer engine gives memory locations, so it picks the RDMA device next to the memory.

Mooncake's topology (``topology.cpp``) maps location names to the RDMA devices nearest them: ``cpu:<numa node>``
for host memory and ``<gpu prefix>:<device>`` for GPU memory, where the prefix is ``cuda`` on its CUDA builds and
``hip`` on its ROCm build (``gpu_vendor/hip.h``). A name its table does not hold (``cpu``, or ``cuda:0`` on the
ROCm build) silently means "any RDMA device", losing the GPU-NIC affinity; ``*`` asks the engine to find out
itself (``getMemoryLocation``: the driver's attributes of the pointer, or the NUMA node of its first page).

We name what we know: a GPU buffer by its torch device index (the same ordinal the engine's runtime uses in this
process, after ``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES``), a host buffer by the NUMA node its first page
sits on (the ``move_pages`` system call, no libnuma), else the only node of a one-node machine, else ``*``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch

WILDCARD = "*"
NODE_SYSFS = Path("/sys/devices/system/node")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "ppc64le": 301}  # syscall numbers of move_pages(2)


def location_name(device: torch.device, ptr: int, gpu_prefix: str = "cuda") -> str:
    """The engine's name for memory at ``ptr`` on ``device`` (``gpu_prefix``: the engine build's, cuda or hip)."""
    if device.type != "cpu":
        return f"{gpu_prefix}:{device.index if device.index is not None else torch.cuda.current_device()}"
    node = numa_node_of(ptr)
    if node is None:
        nodes = numa_nodes()
        node = nodes[0] if len(nodes) == 1 else None
    return WILDCARD if node is None else f"cpu:{node}"


@functools.cache
def numa_nodes() -> tuple[int, ...]:
    """The NUMA nodes of this machine (``/sys/devices/system/node``); (0,) where the kernel shows none."""
    try:
        found = sorted(int(p.name[4:]) for p in NODE_SYSFS.iterdir()
                       if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        found = []
    return tuple(found) or (0,)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def numa_node_of(ptr: int) -> int | None:
    """The NUMA node holding the page at ``ptr``; None when it cannot be told (no such call, a page never
    touched, a container that forbids it)."""
    number, libc = _MOVE_PAGES.get(platform.machine()), _libc()
    if number is None or libc is None or not ptr:
        return None
    pages = (ctypes.c_void_p * 1)(ptr - ptr % _PAGE)
    status = (ctypes.c_int * 1)(-1)
    # move_pages(pid 0 = us, 1 page, pages, nodes NULL = only ask where they are, status, flags 0)
    rc = libc.syscall(ctypes.c_long(number), 0, ctypes.c_ulong(1), pages, None, status, 0)
    return status[0] if rc == 0 and status[0] >= 0 else None
