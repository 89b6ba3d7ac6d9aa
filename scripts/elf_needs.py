"""The shared libraries an ELF file needs (its ``DT_NEEDED`` entries), read without binutils, and two uses of them
for the GPU run's bundle (``scripts/gpu_bundle.sh``, ``tests/test_gpu_bundle.py``).

``python scripts/elf_needs.py engine WHEEL DEST``: unpack from a Mooncake wheel the package's top-level Python
files, ``mooncake/engine.so`` and every library of the wheel it needs (transitively), and the wheel's
``.dist-info`` (so ``importlib.metadata`` and the build check see the engine), but not the rest of the wheel (the
CUDA wheel is 98 MB: the store, its servers and benchmarks, above what a device call may carry).

``python scripts/elf_needs.py missing FILE DIR...``: the libraries ``FILE`` needs, transitively, that no file in
the ``DIR``s provides and that are not in ``BASE`` (what every Debian or Ubuntu image with Python has); one per
line, nothing when the closure is complete.
"""

from __future__ import annotations

import struct
import sys
import tempfile
import zipfile
from pathlib import Path

BASE = frozenset({
    # glibc and the GCC runtime
    "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libresolv.so.2",
    "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1",
    # what Python and apt themselves link (OpenSSL, zlib, the compressors, GnuTLS and its libraries, e2fsprogs)
    "libz.so.1", "libssl.so.3", "libcrypto.so.3", "libzstd.so.1", "liblzma.so.5", "libbz2.so.1.0", "libffi.so.8",
    "libgnutls.so.30", "libhogweed.so.6", "libnettle.so.8", "libgmp.so.10", "libp11-kit.so.0", "libtasn1.so.6",
    "libidn2.so.0", "libunistring.so.2", "libunistring.so.5", "libcom_err.so.2",
})
"""Libraries present on any Debian/Ubuntu image that runs Python and apt (the GPU machines' is Ubuntu 24.04)."""


def needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF file; [] for anything else."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                out.append(data[strtab + value:end].decode())
    return out


def unpack_engine(wheel: Path, dest: Path) -> list[str]:
    """The engine's part of ``wheel`` into ``dest`` (module docstring); the members unpacked."""
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        names = z.namelist()
        by_base = {Path(n).name: n for n in names if ".so" in Path(n).name and
                   (n.startswith("mooncake/") or ".libs/" in n) and n.count("/") == 1}
        keep = {n for n in names if (n.startswith("mooncake/") and n.endswith(".py") and n.count("/") == 1)
                or ".dist-info/" in n}
        queue = ["mooncake/engine.so"]
        while queue:
            member = queue.pop()
            if member in keep:
                continue
            keep.add(member)
            for lib in needed(Path(z.extract(member, tmp))):
                if lib in by_base:
                    queue.append(by_base[lib])
        for member in sorted(keep):
            z.extract(member, dest)
    return sorted(keep)


def missing(start: Path, dirs: list[Path]) -> list[str]:
    """Libraries ``start`` needs, transitively, found neither in ``dirs`` (any depth) nor in ``BASE``."""
    have: dict[str, Path] = {}
    for d in dirs:
        for f in sorted(d.rglob("*")):
            if f.is_file() or f.is_symlink():
                have.setdefault(f.name, f)
    lacking, seen, queue = [], set(), [start]
    while queue:
        for lib in needed(queue.pop().resolve()):
            if lib in seen or lib in BASE:
                continue
            seen.add(lib)
            if lib in have and have[lib].exists():
                queue.append(have[lib])
            else:
                lacking.append(lib)
    return sorted(lacking)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "engine":
        print("\n".join(unpack_engine(Path(sys.argv[2]), Path(sys.argv[3]))))
    elif len(sys.argv) >= 3 and sys.argv[1] == "missing":
        print("\n".join(missing(Path(sys.argv[2]), [Path(d) for d in sys.argv[3:]])))
    else:
        sys.exit("usage: elf_needs.py engine WHEEL DEST | missing FILE DIR...")
