"""Which build of the Mooncake Transfer Engine is installed, and whether it is the one this torch needs.

Mooncake publishes one wheel per GPU build (read from its release workflows and PyPI): ``mooncake-transfer-engine``
(CUDA 12), ``mooncake-transfer-engine-cuda13`` (CUDA 13), ``mooncake-transfer-engine-rocm`` (ROCm/HIP, from 0.3.13
on) and ``mooncake-transfer-engine-non-cuda`` (host memory only). All of them install the same ``mooncake/``
package, so two installed together overwrite each other's files and the engine that loads is whichever was
installed last. A GPU build that is not torch's cannot read torch's device pointers: the CUDA build on ROCm torch
(or the non-CUDA build on any GPU torch) would treat GPU memory as host memory. Both are refused here with one
sentence naming the installed wheel, torch's build and the wheel to install, before the engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

import torch

ENGINE_RELEASE = "0.3.13.post1"
"""The release every node installs (the wire protocol is the engine's; the extras pin it)."""


@dataclass(frozen=True)
class Build:
    """One build of the engine: its wheel, the bimetal extra that installs it, and the torch it goes with."""

    wheel: str
    extra: str
    label: str


BUILDS = {
    "cuda12": Build("mooncake-transfer-engine", "cuda", "CUDA 12"),
    "cuda13": Build("mooncake-transfer-engine-cuda13", "cuda13", "CUDA 13"),
    "rocm": Build("mooncake-transfer-engine-rocm", "rocm", "ROCm"),
    "cpu": Build("mooncake-transfer-engine-non-cuda", "cpu-engine", "CPU-only"),
}
"""Build name -> its wheel; the build names are also what ``torch_build`` returns."""
_BY_WHEEL = {b.wheel: name for name, b in BUILDS.items()}


_OTHER_WHEELS = ("mooncake-transfer-engine-efa", "mooncake-transfer-engine-efa-cuda13",
                 "mooncake-transfer-engine-efa-non-cuda", "mooncake-transfer-engine-musa",
                 "mooncake-transfer-engine-npu")
"""Mooncake's other published builds: they install ``mooncake/`` too (its build script renames one package)."""


def installed_engines() -> list[tuple[str, str]]:
    """(distribution, version) of every installed Mooncake engine wheel (each provides the ``mooncake`` package).

    Looked up by their published names, a few milliseconds; ``metadata.packages_distributions()`` would read
    every installed package's file list (0.3-0.6 s per group here)."""
    out = []
    for name in (*(b.wheel for b in BUILDS.values()), *_OTHER_WHEELS):
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return out


def torch_build(cuda: str | None, hip: str | None) -> str:
    """``rocm``, ``cuda12``, ``cuda13``... or ``cpu``: the build of a torch whose ``torch.version.cuda`` and
    ``torch.version.hip`` are ``cuda`` and ``hip``."""
    if hip:
        return "rocm"
    if cuda:
        return f"cuda{cuda.split('.')[0]}"
    return "cpu"


def build_problem(engines: list[tuple[str, str]], torch_kind: str, gpu_visible: bool,
                  torch_version: str = torch.__version__) -> str | None:
    """One sentence when the installed engine wheels cannot serve this torch, else None.

    ``engines``: ``installed_engines()``; ``torch_kind``: ``torch_build()``; ``gpu_visible``: whether this process
    sees a GPU (without one, every build handles the host memory it is given, so only a clash is refused)."""
    want = wanted(torch_kind, gpu_visible)
    fix = f"`pip install {want.wheel}=={ENGINE_RELEASE}` (bimetal's [{want.extra}] extra)"
    if len(engines) > 1:
        names = [name for name, _ in engines]
        listed = ", ".join(f"{n} {v}" for n, v in engines)
        return (f"several Mooncake Transfer Engine wheels are installed ({listed}) and they overwrite each other's "
                f"mooncake/ package; run `pip uninstall -y {' '.join(names)}`, then {fix} for this "
                f"{BUILDS.get(torch_kind, BUILDS['cpu']).label} torch {torch_version}")
    if not engines or not gpu_visible or torch_kind not in BUILDS or torch_kind == "cpu":
        return None
    name, version = engines[0]
    kind = _BY_WHEEL.get(name)
    if kind is None or kind == torch_kind:
        return None  # a build we do not know (EFA, MUSA...): its maker's business
    return (f"the installed Mooncake Transfer Engine is the {BUILDS[kind].label} build ({name} {version}) but torch "
            f"{torch_version} is a {BUILDS[torch_kind].label} build, so the engine cannot address this GPU's memory; "
            f"run `pip uninstall -y {name}`, then {fix}")


def wanted(torch_kind: str, gpu_visible: bool) -> Build:
    """The build for a torch of ``torch_kind`` (the CPU build where no GPU is visible)."""
    return BUILDS.get(torch_kind, BUILDS["cpu"]) if gpu_visible else BUILDS["cpu"]


def install_hint() -> str:
    """How to install the engine this process needs, in a few words."""
    want = wanted(torch_build(torch.version.cuda, torch.version.hip), torch.cuda.is_available())
    return f"`pip install {want.wheel}=={ENGINE_RELEASE}` (bimetal's [{want.extra}] extra, the {want.label} build)"


def check_installed() -> str | None:
    """``build_problem`` for this process: the installed wheels against this torch and its GPUs."""
    return build_problem(installed_engines(), torch_build(torch.version.cuda, torch.version.hip),
                         torch.cuda.is_available())
