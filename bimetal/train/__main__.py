"""``python -m bimetal.train`` / ``torchrun -m bimetal.train``: the rank entry point of ``bimetal train``.

A rank that stops on an error ends with one sentence: printed here under torchrun, handed to the launcher
when bimetal's own launcher started it (which then speaks once for the job, see ``bimetal.supervisor``).
"""

import gc
import sys

from bimetal.errors import JobAborted, UserError
from bimetal.supervisor import report_outcome
from bimetal.train.cli import main


def _stop(status: int, message: str) -> None:
    if not report_outcome(status, message):
        print(f"bimetal train: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


try:
    status = main(sys.argv[1:])
    # The trainer's objects hold the process groups in reference cycles; collected now, each group's destructor
    # joins Gloo's worker threads. Left to interpreter shutdown, a worker still releasing the last collective's
    # tensors needs the GIL after finalization began and the rank aborts after a finished run.
    gc.collect()
    sys.exit(status)
except UserError as e:
    _stop(2, str(e))
except JobAborted as e:
    _stop(1, str(e))
