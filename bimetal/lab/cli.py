"""``bimetal lab up|down|run|status``: the emulated cluster from the command line.

``run`` is the usual form: it brings the lab up, starts one torchrun per node inside its namespace with
the given rank command, waits (with a timeout), and tears everything down whatever happens::

    bimetal lab run --spec configs/lab/pair.toml -- -m bimetal.train --config configs/demo.toml

``up`` leaves a lab standing (``ip netns exec bml-<id>-<node> ...`` to use it) until ``down``.
"""

from __future__ import annotations

import argparse
import sys

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.lab import cgroup, net
from bimetal.lab.cluster import LabCluster, all_lab_ids, cleanup_stale, owner_alive, read_state, remove_lab
from bimetal.lab.spec import load_spec


def _parser(name: str, help_: str) -> argparse.ArgumentParser:
    return ArgumentParser(prog=f"bimetal lab {name}", description=help_)


def up_main(argv: list[str]) -> int:
    """``bimetal lab up``: bring a lab up and leave it standing."""
    p = _parser("up", "bring a lab up and leave it standing")
    p.add_argument("--spec", required=True, help="lab spec TOML (see configs/lab/)")
    p.add_argument("--id", help="lab id (default: lab.name of the spec)")
    args = p.parse_args(argv)
    spec = load_spec(args.spec, args.id)  # a bad spec is refused before anything else, root or not
    net.require_root()
    stale = cleanup_stale()
    if stale:
        print(f"removed stale labs: {', '.join(stale)}")
    lab = LabCluster(spec, persistent=True).up()
    for i, n in enumerate(spec.nodes):
        addrs = ", ".join(f"{nic}={lab.address(n.name, k)}" for k, nic in enumerate(lab.nics(n.name)))
        print(f"node {i} {n.name} ({n.vendor}, {n.ranks} ranks): netns {lab.namespace(n.name)}; {addrs}; "
              f"{n.rate_mbit:g} Mbit/s")
    print(f"lab {spec.lab_id} is up; 'bimetal lab down --id {spec.lab_id}' removes it")
    return 0


def down_main(argv: list[str]) -> int:
    """``bimetal lab down``: tear a lab down (namespaces, links, qdiscs, cgroups)."""
    p = _parser("down", "tear a lab down (namespaces, links, qdiscs, cgroups)")
    p.add_argument("--id", help="lab id")
    p.add_argument("--spec", help="lab spec whose lab to tear down")
    p.add_argument("--all", action="store_true", help="tear down every lab on this machine")
    args = p.parse_args(argv)
    net.require_root()
    if args.all:
        ids = sorted(all_lab_ids())
    elif args.id or args.spec:
        ids = [args.id or load_spec(args.spec).lab_id]
    else:
        raise UserError("say which lab to tear down: --id ID, --spec FILE or --all")
    for lab_id in ids:
        removed = remove_lab(lab_id)
        print(f"lab {lab_id}: removed {len(removed)} namespaces/cgroups")
    return 0


def run_main(argv: list[str]) -> int:
    """``bimetal lab run``: bring a lab up, run one torchrun per node, tear it down."""
    p = _parser("run", "bring a lab up, run one torchrun per node, tear it down")
    p.add_argument("--spec", required=True, help="lab spec TOML")
    p.add_argument("--id", help="lab id (default: lab.name of the spec)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the job is killed (default 900)")
    p.add_argument("--master-port", type=int, default=29400)
    p.add_argument("rank_argv", nargs=argparse.REMAINDER, help="-- then a script or -m module and its args")
    args = p.parse_args(argv)
    spec = load_spec(args.spec, args.id)  # a bad spec is refused before anything else, root or not
    net.require_root()
    rank_argv = args.rank_argv[1:] if args.rank_argv[:1] == ["--"] else args.rank_argv
    if not rank_argv:
        raise UserError("nothing to run: add '-- <script or -m module> [args]' after the options")
    try:
        with LabCluster(spec) as lab:
            print(f"lab {spec.lab_id}: {len(spec.nodes)} nodes, {spec.world_size} ranks "
                  f"({spec.simulate_string()}), master {lab.master_addr}:{args.master_port}", flush=True)
            results = lab.run(rank_argv, timeout=args.timeout, master_port=args.master_port)
    except KeyboardInterrupt:
        print(f"bimetal lab: interrupted; lab {spec.lab_id} torn down", file=sys.stderr)
        return 130
    worst = 0
    for r in results:
        print(f"node {r.node}: exit {r.returncode}{' (timed out)' if r.returncode == 124 else ''}")
        worst = worst or r.returncode
    return worst


def status_main(argv: list[str]) -> int:
    """``bimetal lab status``: list labs on this machine."""
    _parser("status", "list labs on this machine").parse_args(argv)
    ids = sorted(all_lab_ids())
    if not ids:
        print("no labs on this machine")
        return 0
    for lab_id in ids:
        state = read_state(lab_id)
        owner = "none (stale)" if state is None else (
            "left up" if state.get("owner_pid") == 0 else f"pid {state.get('owner_pid')}")
        alive = "" if owner_alive(state) else " [stale: removed by the next lab up/run]"
        spaces = [n for n in net.list_namespaces() if n.startswith(f"{net.PREFIX}{lab_id}-")]
        groups = cgroup.lab_cgroups(lab_id)
        print(f"lab {lab_id}: owner {owner}{alive}; {len(spaces)} namespaces ({', '.join(spaces)}), "
              f"{len(groups)} cgroups; spec {state.get('source') if state else '?'}")
    return 0

