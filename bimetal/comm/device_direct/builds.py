"""Which build of the Mooncake Transfer Engine is installed, and whether it is the one this torch needs.

Mooncake publishes one wheel per GPU build (read from its release workflows and PyPI): ``mooncake-transfer-engine``
(CUDA 12), ``mooncake-transfer-engine-cuda13`` (CUDA 13), ``mooncake-transfer-engine-rocm`` (ROCm/HIP, from 0.3.13
on) and ``mooncake-transfer-engine-non-cuda`` (host memory only). All of them install the same ``mooncake/``
package, so two installed together overwrite each other's files and the engine that loads is whichever was
installed last. A GPU build that is not torch's cannot read torch's device pointers: the CUDA build on ROCm torch
(or the non-CUDA build on any GPU torch) would treat GPU memory as host memory. Both are refused here with one
sentence naming the installed wheel, torch's build and the wheel to install, before the engine starts.

Each GPU build links one major of its vendor's runtime (``readelf -d mooncake/engine.so`` of the 0.3.13.post1
wheels: ``libcudart.so.12``, ``libcudart.so.13``, ``libamdhip64.so.7``). ROCm torch carries its own HIP runtime
(``torch.version.hip``), and one process cannot hold two majors of it, so the ROCm build needs a torch built for
ROCm 7 (``runtime_problem``). A wheel that is installed but cannot load names the missing library and what
provides it (``load_problem``), never "install" the wheel that is already there.
"""

from __future__ import annotations

import platform
import re
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
    runtime: str = ""
    """The GPU runtime library its ``engine.so`` links (``readelf -d``), empty for the CPU build."""
    runtime_label: str = ""
    """That runtime's vendor and major, as a user installs it."""


BUILDS = {
    "cuda12": Build("mooncake-transfer-engine", "cuda", "CUDA 12", "libcudart.so.12", "CUDA 12"),
    "cuda13": Build("mooncake-transfer-engine-cuda13", "cuda13", "CUDA 13", "libcudart.so.13", "CUDA 13"),
    "rocm": Build("mooncake-transfer-engine-rocm", "rocm", "ROCm", "libamdhip64.so.7", "ROCm 7"),
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


def runtime_problem(engines: list[tuple[str, str]], torch_hip: str | None, torch_version: str = torch.__version__
                    ) -> str | None:
    """One sentence when the installed ROCm build needs another ROCm major than torch's HIP runtime, else None.

    ``torch_hip``: ``torch.version.hip`` (``"6.4.43482-0f2d60242"``); the engine's runtime is loaded into torch's
    process, so the two must be one major."""
    if len(engines) != 1 or _BY_WHEEL.get(engines[0][0]) != "rocm" or not torch_hip:
        return None
    build, (name, version) = BUILDS["rocm"], engines[0]
    need = int(build.runtime_label.split()[-1])
    have = re.match(r"(\d+)\.(\d+)", torch_hip)
    if have is None or int(have.group(1)) == need:
        return None
    return (f"the Mooncake ROCm build ({name} {version}) links the {build.runtime_label} runtime ({build.runtime}) but "
            f"torch {torch_version} is built for ROCm {have.group(1)}.{have.group(2)}, and one process cannot load "
            f"both; install a torch built for {build.runtime_label} (`pip install torch --index-url "
            f"https://download.pytorch.org/whl/rocm{need}.X`, see pytorch.org)")


LIBRARIES = {
    "libibverbs.so": "run `apt-get install libibverbs1` (the RDMA verbs library; the engine links it even for TCP)",
    "libmlx5.so": "run `apt-get install ibverbs-providers`",
    "libnuma.so": "run `apt-get install libnuma1`",
    "libcurl.so": "run `apt-get install libcurl4`",
    "libamdhip64.so": "install the ROCm {major} runtime (a torch built for ROCm {major} carries it)",
    "libhsa-runtime64.so": "install the ROCm runtime (hsa-rocr)",
    "libcudart.so": "install the CUDA {major} runtime (a torch built for CUDA {major} carries it)",
    "libcuda.so": "install the NVIDIA driver",
}
"""Libraries the engine wheels link that a node may lack (``readelf -d``), and how to get each."""


def load_problem(error: str, engines: list[tuple[str, str]]) -> str:
    """One sentence for an engine that is installed (``engines``) but failed to load with ``error``."""
    which = ", ".join(f"{n} {v}" for n, v in engines) or "the mooncake package"
    glibc = re.search(r"GLIBC_(\d+\.\d+)'? not found", error)
    if glibc is not None:  # the ROCm wheel is manylinux_2_35: an older distribution cannot load it
        have = platform.libc_ver()[1] or "older"
        return (f"Mooncake Transfer Engine ({which}) is installed but could not load because it needs glibc "
                f"{glibc.group(1)} and this node has glibc {have}; run it on a newer distribution (glibc "
                f"{glibc.group(1)} or later, e.g. Ubuntu 22.04)")
    missing = re.search(r"(lib[\w.+-]+\.so)((?:\.\d+)*): cannot open shared object file", error)
    if missing is None:
        return (f"Mooncake Transfer Engine ({which}) is installed but could not load ({error}); reinstall it with "
                f"`pip install --force-reinstall --no-deps {engines[0][0] if engines else 'WHEEL'}=={ENGINE_RELEASE}`")
    lib = missing.group(1) + missing.group(2)
    major = missing.group(2).lstrip(".").split(".")[0] or "matching"
    fix = LIBRARIES.get(missing.group(1), "install the package that provides it").format(major=major)
    return (f"Mooncake Transfer Engine ({which}) is installed but could not load because {lib} is not on this node's "
            f"library path; {fix}")


def wanted(torch_kind: str, gpu_visible: bool) -> Build:
    """The build for a torch of ``torch_kind`` (the CPU build where no GPU is visible)."""
    return BUILDS.get(torch_kind, BUILDS["cpu"]) if gpu_visible else BUILDS["cpu"]


def install_hint() -> str:
    """How to install the engine this process needs, in a few words."""
    want = wanted(torch_build(torch.version.cuda, torch.version.hip), torch.cuda.is_available())
    return f"`pip install {want.wheel}=={ENGINE_RELEASE}` (bimetal's [{want.extra}] extra, the {want.label} build)"


def check_installed() -> str | None:
    """``build_problem``, then ``runtime_problem``, for this process: the installed wheels against this torch and
    its GPUs."""
    engines = installed_engines()
    return build_problem(engines, torch_build(torch.version.cuda, torch.version.hip),
                         torch.cuda.is_available()) or runtime_problem(engines, torch.version.hip)
