"""Start the ranks of a simulated job as bare processes, forked from one interpreter that imported torch once.

``python tests/forked_ranks.py NPROC LOGDIR -- -m bimetal.train ARGS...`` starts NPROC ranks of ``ARGS``, each with
this process's environment plus ``RANK``/``LOCAL_RANK`` (the caller sets ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``...), its stdout and stderr in ``LOGDIR/rank<R>.out`` and ``.err``, and prints ``<rank> <exit status>``
on a line of its own as each rank ends. It is the start of bimetal's launcher in fork mode
(``bimetal.rank_fork``: the rank's heavy imports once, then a fork per rank) without the launcher's watch: no rank
is stopped because another one died, so a test sees what every survivor of a fault does by itself, and each
rank's own last sentence on its own stderr - as with plain ``python -m bimetal.train`` processes, at a quarter
of the CPU (a new interpreter per rank spends about four seconds of CPU importing the trainer).

A rank gets SIGKILL when this process ends (the parent-death signal, as the launcher sets it): killing this
process ends a rank that never would by itself (a stalled one).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from forked_runs import fork_all

from bimetal.rank_fork import preload


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: forked_ranks.py NPROC LOGDIR -- RANK_ARGV...", file=sys.stderr)
        return 2
    nproc, logs, rank_argv = int(argv[0]), Path(argv[1]), argv[3:]
    logs.mkdir(parents=True, exist_ok=True)
    preload(rank_argv)
    fork_all([{"argv": rank_argv, "env": dict(os.environ, RANK=str(r), LOCAL_RANK=str(r)),
               "out": str(logs / f"rank{r}.out"), "err": str(logs / f"rank{r}.err")} for r in range(nproc)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
