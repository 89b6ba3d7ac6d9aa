"""What each group of a rank carried, and the pipeline's transport as the summary names it.

At the end of a run every rank writes ``<run_dir>/comm-rank<R>.json``: each of its groups (a per-hop pipeline
listed by its parts: every pair of neighbouring stages and its collectives group) with its back-end as built,
its ranks and kind, and the byte counters of the groups that are bimetal transports (``null`` for native and
stock Gloo groups, which keep none). A hop inside a vendor never appears with bimetal counters: its bytes went
over the vendor's library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bimetal.outputs import write_text
from bimetal.parallel.groups import HOP
from bimetal.parallel.pipeline_groups import REVERSE
from bimetal.transports import PER_HOP


def pipeline_transport(ctx: Any, name: str) -> tuple[str, str]:
    """(the pp transport as built, why a device-direct part fell back or ""); a per-hop pipeline names the back-end
    of its hops across vendors and of those inside one."""
    spec = ctx.spec(name)
    if spec.backend != PER_HOP:
        return ctx.built_backend(name), ctx.fallbacks.get(name, "")
    hops = [g for g in ctx.group_specs if g.axis == HOP and g.name.startswith(name + ".")]
    across = sorted({ctx.built_backend(g.name) if g.name in ctx.fallbacks else g.backend
                     for g in hops if g.kind == "cross-vendor"})
    inside = sorted({g.backend for g in hops if g.kind != "cross-vendor"})
    why = next((ctx.fallbacks[g.name] for g in hops if g.name in ctx.fallbacks), "")
    return f"per hop: {', '.join(across)} across vendors, {', '.join(inside)} inside a vendor", why


def comm_records(ctx: Any) -> dict[str, dict[str, Any]]:
    """This rank's groups (name -> backend, ranks, kind, counters); a per-hop pipeline group is left out for its
    parts, the second direction of a native pair is listed under ``<hop>/reverse``."""
    out: dict[str, dict[str, Any]] = {}
    for key, pg in ctx.groups.items():
        if pg is None:
            continue
        spec = ctx.spec(key.removesuffix(REVERSE))
        if spec.backend == PER_HOP:
            continue
        counters = getattr(pg, "counters", None)
        out[key] = {"backend": ctx.built_backend(spec.name), "ranks": list(spec.ranks), "kind": spec.kind,
                    "axis": spec.axis, "counters": counters.snapshot() if counters is not None else None}
    return out


def write_comm_report(run_dir: str | Path, ctx: Any) -> Path:
    """``<run_dir>/comm-rank<R>.json`` for this rank; returns its path."""
    path = Path(run_dir) / f"comm-rank{ctx.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"rank": ctx.rank, "vendor": ctx.vendor, "groups": comm_records(ctx)}, indent=1))
    return path
