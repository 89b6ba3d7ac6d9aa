"""The GPU run's bundle (``scripts/gpu_bundle.sh``) installs with no network into a fresh interpreter that holds
only what the GPU machines' image holds (torch and its own needs, numpy, psutil, safetensors, tokenizers), through
the run's own unpacking (``scripts/gpu_unpack.sh``: ``pip install --no-index``, the engine with its metadata, the
Debian libraries the machine lacks); then every module the run imports imports there, the build check sees the
engine's distribution, and nothing the engine links is missing (``scripts/elf_needs.py``: the closure of its
libraries, less what every Debian/Ubuntu image has).

Built for this machine's Python and the CPU engine wheel (the device machines get CPython 3.12 and the CUDA wheel:
the same script with other arguments). Building needs PyPI and Debian's archive, as ``make test`` does; about
30-60 s, most of it the downloads (46 MB engine wheel) and torch's first import in the new interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)

IMAGE = ("torch", "torchgen", "functorch", "numpy", "numpy.libs", "psutil", "safetensors", "tokenizers", "sympy",
         "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "isympy.py")
"""What the GPU machines' image has of bimetal's needs (docs: the device's package list), given to the fresh
interpreter from this one's site-packages; pydantic, tomli-w and typing-extensions are not: the bundle brings them."""
RUN_MODULES = ("bimetal.cli", "bimetal.launch", "bimetal.train.cli", "bimetal.train.trainer",
               "bimetal.bench.gpu_ladder",
               "bimetal.bench.gpu_ladder_rank", "bimetal.bench.thread_profile", "bimetal.bench.steps",
               "bimetal.comm.cpu_forward", "bimetal.comm.device_direct", "bimetal.comm.device_direct.mooncake",
               "mooncake.engine")
"""What ``gpu_run.sh`` imports: the launcher, the trainer, the ladder and its ranks, both transports, the engine
(``scripts/gpu_check.py`` and ``gpu_check_rank.py`` are loaded by path below)."""


def _image(site: Path, into: Path) -> None:
    """Links to this interpreter's copies of the image's packages (and their metadata) in ``into``."""
    into.mkdir()
    for name in IMAGE:
        for entry in [site / name, *site.glob(f"{name.replace('.libs', '')}-*.dist-info")]:
            if entry.exists() and not (into / entry.name).exists():
                (into / entry.name).symlink_to(entry)


def test_the_bundle_installs_offline_and_the_run_imports_everything(tmp_path: Path) -> None:
    if not (shutil.which("apt-get") and shutil.which("dpkg") and shutil.which("ldd")):
        pytest.skip("apt-get, dpkg and ldd are needed to build and unpack the bundle (a Debian or Ubuntu machine)")
    bundle, work = tmp_path / "bundle", tmp_path / "work"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = dict(os.environ, BUNDLE=str(bundle), PYTHON=sys.executable, PYVER=py,
               ENGINE="mooncake-transfer-engine-non-cuda")
    built = subprocess.run([str(ROOT / "scripts/gpu_bundle.sh")], env=env, capture_output=True, text=True,
                           timeout=180, cwd=ROOT)
    assert built.returncode == 0, built.stdout + built.stderr
    assert {"libnl-3-200", "libnl-route-3-200", "libibverbs1"} <= {d.name.split("_")[0] for d in
                                                                   (bundle / "debs").glob("*.deb")}

    # a fresh interpreter: its own venv (pip from ensurepip, no network) plus the image's packages only
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=120)
    fresh_py = fresh / "bin/python"
    _image(Path(sysconfig.get_paths()["purelib"]), tmp_path / "image")
    fresh_site = Path(subprocess.run([str(fresh_py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "image.pth").write_text(str(tmp_path / "image") + "\n")
    offline = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "LD_LIBRARY_PATH"))}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", http_proxy="http://127.0.0.1:9",
                   https_proxy="http://127.0.0.1:9", PYTHONNOUSERSITE="1")
    gone = subprocess.run([str(fresh_py), "-c", "import pydantic"], env=offline, capture_output=True, text=True)
    assert gone.returncode != 0, "the fresh interpreter must not see this one's pydantic"

    unpacked = subprocess.run([str(ROOT / "scripts/gpu_unpack.sh"), str(bundle), str(work), str(fresh_py), str(ROOT)],
                              env=offline, capture_output=True, text=True, timeout=120)
    assert unpacked.returncode == 0 and "could not install" not in unpacked.stdout, unpacked.stdout + unpacked.stderr
    assert "still lacks" not in unpacked.stdout, unpacked.stdout
    for line in (work / "env.sh").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        offline[key] = value.strip('"')
    script = f"""
import importlib, importlib.util, sys
for name in {RUN_MODULES!r}:
    importlib.import_module(name)
for path in ("scripts/gpu_check.py", "scripts/gpu_check_rank.py"):
    spec = importlib.util.spec_from_file_location("m", "{ROOT}/" + path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import pydantic, tomli_w, typing_extensions, mooncake
from bimetal.topology import versions
print("engine", versions.local_versions()["engine"])
print("from", pydantic.__file__, mooncake.__file__)
"""
    ran = subprocess.run([str(fresh_py), "-c", script], env=offline, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "engine 0.3.13.post1" in ran.stdout and f"{work}/site/pydantic" in ran.stdout, ran.stdout
    assert f"{work}/site/mooncake" in ran.stdout, ran.stdout

    # every library the engine links, transitively: in the bundle or in every Debian/Ubuntu image
    lacking = subprocess.run([sys.executable, str(ROOT / "scripts/elf_needs.py"), "missing",
                              str(work / "site/mooncake/engine.so"), str(work / "site"), str(work / "debs"),
                              str(bundle / "lib")], capture_output=True, text=True, check=True).stdout.split()
    assert lacking == [], f"the bundle lacks {lacking}"
