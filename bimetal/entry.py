"""Running one command function as a process: the exit status and the one final sentence.

``bimetal.cli`` and every module a rank runs with ``python -m`` end the same way: a ``UserError`` is one
sentence and exit status 2, a ``JobAborted`` one sentence and status 1, Ctrl-C status 130. A rank started by
bimetal's launcher leaves its sentence to the launcher (``bimetal.supervisor``), which speaks once for the job.
Lives low in the layers so that no module needs to import ``bimetal.cli`` for this.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Callable

from bimetal.errors import JobAborted, UserError
from bimetal.log import rank_logging
from bimetal.supervisor import report_crash, report_outcome


def _freeze_at_exit() -> None:
    """The interpreter's shutdown walks every object left in the collector's generations, again and again as it
    clears the modules: with torch and the trainer imported about 0.9 s of CPU per process (each rank of a job
    started by torchrun or srun, each console call), for garbage the process's exit frees anyway. Frozen, it walks
    none. What a shutdown must do is done before: the command's own garbage was collected at its end (its process
    groups destroyed while the interpreter was whole), files and logs are flushed by the exit handlers and as
    the modules are cleared (reference counts, not the collector); a forked rank ends with ``os._exit`` and does
    none of this either."""
    gc.freeze()


def run_command(label: str, func: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """``func(argv)``'s exit status; errors a user can cause end as one sentence prefixed ``bimetal LABEL:``.

    In a rank (``RANK`` set by the launcher) diagnostics are set up first: ``[rank N]`` lines (``bimetal.log``).
    Last, the garbage collector runs: objects that hold process groups in reference cycles (a trainer, a
    pipeline stage and its schedule) are freed while the interpreter is whole, so each group's destructor
    joins Gloo's worker threads; left to interpreter shutdown, a worker still releasing the last collective's
    tensors needs the GIL after finalization began and the rank aborts after a finished run.

    What the process held before the command (its imported modules: torch's are some 300 000 objects) goes to
    the collector's permanent generation while the command runs, so that last collection, and every full one on
    the way, walks only what the command made (about 0.2 s of CPU less each, per console call and per in-process
    call in the tests); it is taken back afterwards. A forked rank's parent froze its objects already
    (``bimetal.rank_fork``): that is left as it is.

    At the process's exit every object is frozen (``_freeze_at_exit``, an exit handler: it changes nothing the other
    handlers do, whichever order they run in).
    """
    atexit.unregister(_freeze_at_exit)  # once per process, however many commands it runs
    atexit.register(_freeze_at_exit)
    if os.environ.get("RANK", "").isdigit():
        rank_logging(int(os.environ["RANK"]))
    froze = gc.get_freeze_count() == 0
    if froze:
        gc.freeze()
    try:
        return int(func(argv) or 0)
    except UserError as exc:
        if not report_outcome(2, str(exc)):  # a rank of bimetal's launcher leaves the sentence to it
            print(f"bimetal {label}: {exc}", file=sys.stderr)
        return 2
    except JobAborted as exc:
        if not report_outcome(1, str(exc)):
            print(f"bimetal {label}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bimetal {label}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): nothing left to say to it
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # a bug: its traceback is printed as ever, and its line is left for the launcher
        report_crash(exc)
        raise
    finally:
        gc.collect()
        if froze:
            gc.unfreeze()
