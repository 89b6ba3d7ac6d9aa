"""Rank program of tests/test_megatron.py: several Megatron layouts in one job (Megatron's imports cost seconds
per process), each trained on every back-end asked for, in turn.

    bimetal megatron --simulate nvidia:1,amd:1 -- tests/megatron_cases.py OUT MODES CASE=ARGS [CASE=ARGS ...]

MODES: comma-separated ``all-gloo``, ``cpu-forward``, ``device-direct``; a case named ``NAME@MODES`` runs on
those of its own (a subset). Each (case, mode) runs
``scripts/megatron_gpt.py``'s ``main`` with the case's arguments, writing ``OUT/<case>.<mode>.rank<r>.json``
(losses and the operations every group carried). A two-rank job then checks how each back-end matches two
same-shaped messages to one peer posted in one batch (the pattern of pp=2 with the interleaved schedule), writing
``OUT/order.<mode>.rank<r>.json``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import megatron_gpt  # noqa: E402
import torch  # noqa: E402

import bimetal.integrations.megatron as bimetal_megatron  # noqa: E402


def main(argv: list[str]) -> int:
    out, modes, cases = argv[0], argv[1].split(","), [c.split("=", 1) for c in argv[2:]]
    bimetal_megatron.initialize()
    for name, args in cases:
        name, _, own = name.partition("@")
        for mode in [m for m in modes if not own or m in own.split("+")]:
            if mode == "all-gloo":
                bimetal_megatron.use(all_gloo=True)
            else:
                bimetal_megatron.use(transport=mode, all_gloo=False)
            megatron_gpt.main([*shlex.split(args), "--report", f"{out}/{name}.{mode}", "--count-ops"])
    if torch.distributed.get_world_size() == 2:
        for mode in modes:
            _batch_order(out, mode)
    return 0


def _batch_order(out: str, mode: str) -> None:
    """Each rank sends two messages to its peer, then receives two, all in one ``batch_isend_irecv``: a back-end
    must hand the first message to the first receive."""
    from bimetal.transports import TRANSPORTS

    dist = torch.distributed
    rank = dist.get_rank()
    backend = "gloo" if mode == "all-gloo" else TRANSPORTS[mode].backend
    group = dist.new_group([0, 1], backend=backend, group_desc=f"order.{mode}")
    peer = 1 - rank
    first, second = torch.full((4, 8), 10.0 * rank + 1), torch.full((4, 8), 10.0 * rank + 2)
    got = [torch.zeros(4, 8), torch.zeros(4, 8)]
    ops = [dist.P2POp(dist.isend, first, peer, group), dist.P2POp(dist.isend, second, peer, group),
           dist.P2POp(dist.irecv, got[0], peer, group), dist.P2POp(dist.irecv, got[1], peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    with open(f"{out}/order.{mode}.rank{rank}.json", "w") as f:
        json.dump({"backend": backend, "received": [float(got[0][0, 0]), float(got[1][0, 0])],
                   "peer_sent": [10.0 * peer + 1, 10.0 * peer + 2]}, f)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
