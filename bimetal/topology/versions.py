"""Software versions every rank record carries, and which disagreements stop the job at start-up.

A record carries torch's version (``2.6.0+cu124``), bimetal's, the transfer engine's (Mooncake's distribution
version, empty when none is installed) and ``wire``: the protocol version of each of bimetal's transports
(``bimetal.transports``). Compared with rank 0's record by every rank, so all stop with the same sentence:

* **bimetal**: the same version string. Record shapes, store keys and the transports' framing are one
  release's; a mix would hang in a store wait or misread a frame.
* **wire**: the same protocol version per transport (for development builds that share a version string).
* **torch**: the same major.minor release. Vendor builds of one release agree (``2.6.0+cu124`` and
  ``2.6.0+rocm6.2``: the same sources), so do patch releases. Minor releases may change Gloo's pair protocol,
  the c10d TCPStore's messages and what ``torch.distributed`` pickles (objects, pipelining metadata): a CUDA
  image and a ROCm image a release apart could hang in the store or in Gloo, with no word.
* **engine**: compared by device-direct groups only (their members speak its wire; a job on cpu-forward does
  not care): the same release (major.minor.micro, post-releases and build tags aside), see ``engine_mismatch``.

An older bimetal's record (another ``RECORD_VERSION``) is refused before its fields are read
(``records.RankRecord.from_dict``), with a sentence that says so.

``BIMETAL_TEST_CLAIM_VERSIONS`` (tests only) makes chosen ranks claim other versions, e.g.
``1:bimetal=0.0.9`` or ``0:torch=2.7.0+cu126;1:engine=0.3.12``, so the refusal can be tested end to end.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

from bimetal import env
from bimetal.transports import TABLE
from bimetal.version import __version__

CLAIM_ENV = "BIMETAL_TEST_CLAIM_VERSIONS"
FIELDS = ("torch", "bimetal", "engine")


def wire_versions() -> dict[str, int]:
    """Protocol version of each of bimetal's transports, by name."""
    return {t.name: t.wire for t in TABLE if t.module is not None}


ENGINE_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
                        "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-rocm")
"""The Mooncake wheels by build (CUDA 12, CUDA 13, CPU, ROCm); any other distribution owning ``mooncake`` is
found by a slower scan."""


@functools.cache
def engine_version() -> str:
    """The installed Mooncake transfer engine's distribution version (any build: CUDA, ROCm, CPU); '' if none."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("mooncake") is None:
        return ""
    for name in ENGINE_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    for dist in metadata.packages_distributions().get("mooncake", []):  # (reads every installed distribution)
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def local_versions(rank: int | None = None) -> dict[str, str]:
    """This process's ``torch``, ``bimetal`` and ``engine`` versions (with any test claim for ``rank`` applied)."""
    import torch

    out = {"torch": str(torch.__version__), "bimetal": __version__, "engine": engine_version()}
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    out.update(parse_claims(env.read(CLAIM_ENV) or "").get(rank, {}))
    return out


def parse_claims(raw: str) -> dict[int, dict[str, str]]:
    """``1:bimetal=0.0.9;0:torch=2.7.0`` -> {1: {"bimetal": "0.0.9"}, 0: {"torch": "2.7.0"}}; ValueError if bad."""
    out: dict[int, dict[str, str]] = {}
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        rank, _, claims = part.partition(":")
        if not rank.strip().isdigit() or not claims:
            raise ValueError(f"{part!r} is not RANK:field=version")
        for claim in claims.split(","):
            key, eq, value = (s.strip() for s in claim.partition("="))
            if key not in FIELDS or not eq or not value:
                raise ValueError(f"{claim!r} is not field=version with a field among {', '.join(FIELDS)}")
            out.setdefault(int(rank), {})[key] = value
    return out


def release(version: str, parts: int) -> tuple[int, ...] | str:
    """The first ``parts`` numbers of a version (``2.6.0+cu124`` -> (2, 6)); the string itself if it has fewer."""
    numbers = re.match(r"^\s*(\d+(?:\.\d+)*)", version.split("+")[0])
    found = tuple(int(n) for n in numbers.group(1).split(".")) if numbers else ()
    return found[:parts] if len(found) >= parts else version


def mismatch(a: int, b: int, va: Mapping[str, object], vb: Mapping[str, object]) -> str | None:
    """The sentence refusing ranks ``a`` and ``b`` with versions ``va``/``vb`` (keys ``torch``, ``bimetal``,
    ``wire``), or None when they agree."""
    if va["bimetal"] != vb["bimetal"]:
        return (f"ranks {a} and {b} run different bimetal versions (rank {a}: {va['bimetal']}, rank {b}: "
                f"{vb['bimetal']}); install one bimetal release on every node.")
    if va["wire"] != vb["wire"]:
        return (f"ranks {a} and {b} speak different transport protocol versions (rank {a}: {va['wire']}, rank {b}: "
                f"{vb['wire']}); install one bimetal build on every node.")
    if release(str(va["torch"]), 2) != release(str(vb["torch"]), 2):
        return (f"ranks {a} and {b} run different torch releases (rank {a}: {va['torch']}, rank {b}: {vb['torch']}); "
                "Gloo and the c10d store may differ between minor releases: install the same torch major.minor "
                "on every node (vendor builds such as +cu124 and +rocm6.2 of one release are fine).")
    return None


def engine_mismatch(ranks: list[int], versions: list[str]) -> str | None:
    """The sentence refusing a device-direct group whose members run different engine releases, else None.
    ``ranks`` are the members' global ranks, ``versions`` their engine versions ('' where none is installed:
    that rank's engine fails to start and the fallback policy speaks instead)."""
    have = [(r, v) for r, v in zip(ranks, versions) if v]
    for r, v in have[1:]:
        if release(v, 3) != release(have[0][1], 3):
            r0, v0 = have[0]
            return (f"ranks {r0} and {r} run different Mooncake transfer engine releases (rank {r0}: {v0}, rank {r}: "
                    f"{v}); device-direct needs one engine release on both ends: install the same version of the "
                    "engine wheel for each node's torch build.")
    return None
