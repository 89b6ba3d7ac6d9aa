"""`bimetal plan fit`: set a cluster spec's host-path constants from measurements on the machines.

Inputs are what the machines report themselves:

* ``bimetal bench comm`` JSON, run between two nodes of the cluster (or two ranks of one) with every stripe
  on one interface (``--ifaces`` naming one NIC): raw Gloo's bandwidth at the largest message is one TCP
  connection's ceiling (``tcp_conn_gbps``); the best cpu-forward bandwidth with several stripes is what the
  TCP stack moves through that interface with K connections (``tcp_iface_gbps``; the one-connection figure
  when the report has no striped rows); half of raw Gloo's smallest-message delivery time (a send and a
  1-element acknowledgement) is the per-message latency (``msg_latency_us``).
* optionally a ``bimetal profile`` JSON: its ``copy_gbps`` (one staging-sized memcpy in host memory) becomes
  the host memory bandwidth the node's concurrent staging copies share (``host_copy_gbps``).

The spec is rewritten to ``--out`` with the fitted keys set on the chosen groups (all by default).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.outputs import check_file, write_text
from bimetal.plan.profile import ProfileRecord
from bimetal.plan.spec import load_spec, parse_spec
from bimetal.schema import SHAPE, check


@dataclass(frozen=True)
class BenchRow:
    """One (variant, message size) row of a ``bimetal bench comm`` report."""

    __pydantic_config__ = SHAPE

    variant: str
    bytes: int
    median_s: float
    samples_s: list[float] | None = None
    gbit_per_s: float | None = None


@dataclass(frozen=True)
class BenchCommReport:
    """``bench_comm.json`` as ``bimetal bench comm`` writes it (``recorded``: a provenance note added by hand)."""

    __pydantic_config__ = SHAPE

    rows: list[BenchRow]
    ratios: dict[str, float | dict[str, float]] | None = None  # (median) or {median, q1, q3}; fit reads rows only
    recorded: str | None = None


def _rows(path: str) -> list[dict[str, Any]]:
    try:
        report = check(BenchCommReport, json.loads(Path(path).read_text()), path)
    except (OSError, ValueError, UserError) as e:
        raise UserError(f"--bench-comm {path} is not a `bimetal bench comm` JSON ({e}); run `bimetal bench comm "
                        "--out DIR` and pass DIR/bench_comm.json.") from None
    return [{"variant": r.variant, "bytes": r.bytes, "median_s": r.median_s} for r in report.rows]


def fit_bench_comm(path: str) -> dict[str, float]:
    """tcp_conn_gbps, tcp_iface_gbps and msg_latency_us from a bench comm report (GB/s, microseconds)."""
    rows = _rows(path)
    gloo = sorted((r for r in rows if r["variant"] == "gloo"), key=lambda r: r["bytes"])
    if len(gloo) < 2:
        raise UserError(f"--bench-comm {path} has no raw Gloo rows at two sizes; run bench comm with gloo in "
                        "--transports and at least two --sizes (e.g. 4K,64M).")
    big = gloo[-1]
    conn = big["bytes"] / big["median_s"] / 1e9
    striped = [r["bytes"] / r["median_s"] / 1e9 for r in rows
               if r["variant"].startswith("cpu-forward x") and r["variant"] != "cpu-forward x1"
               and r["bytes"] == big["bytes"]]
    # Several connections on one interface tell its stack's ceiling; without them, one connection is all we know.
    return {"tcp_conn_gbps": round(conn, 3), "tcp_iface_gbps": round(max(striped) if striped else conn, 3),
            "msg_latency_us": round(gloo[0]["median_s"] / 2 * 1e6, 1)}


def fit_profile(path: str) -> dict[str, float]:
    """host_copy_gbps from a `bimetal profile` JSON."""
    try:
        rec = check(ProfileRecord, json.loads(Path(path).read_text()), path)
        if rec.copy_gbps is None:
            raise UserError("key 'copy_gbps' is missing")
    except (OSError, ValueError, UserError) as e:
        raise UserError(f"--profile {path} is not a `bimetal profile` JSON ({e}).") from None
    return {"host_copy_gbps": round(rec.copy_gbps, 3)}


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="bimetal plan fit", description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="cluster spec TOML to start from")
    ap.add_argument("--bench-comm", required=True, metavar="JSON", help="bench_comm.json from `bimetal bench comm`")
    ap.add_argument("--profile", metavar="JSON", help="`bimetal profile` JSON for host_copy_gbps")
    ap.add_argument("--group", action="append", default=[], help="group name to set (repeatable; default all)")
    ap.add_argument("--out", required=True, help="spec TOML to write")
    a = ap.parse_args(argv)
    check_file("--out", a.out)
    names = [g.name for g in load_spec(a.spec).groups]  # refuses a bad spec with the key and file named
    data = tomllib.loads(Path(a.spec).read_text())
    unknown = sorted(set(a.group) - set(names))
    if unknown:
        raise UserError(f"--group {unknown[0]!r} is not a group of {a.spec}; its groups are {', '.join(names)}.")
    fitted = fit_bench_comm(a.bench_comm) | (fit_profile(a.profile) if a.profile else {})
    for name, table in zip(names, data["group"]):
        if not a.group or name in a.group:
            table.update(fitted)
    parse_spec(data, a.out)  # the result must be a valid spec before it is written
    write_text(a.out, tomli_w.dumps(data))
    print(f"{a.spec} -> {a.out}: " + ", ".join(f"{k} = {v}" for k, v in fitted.items())
          + f" on {', '.join(a.group) or 'every group'}")
    return 0
