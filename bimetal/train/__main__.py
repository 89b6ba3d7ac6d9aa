"""``python -m bimetal.train`` / ``torchrun -m bimetal.train``: the rank entry point of ``bimetal train``.

A rank that stops on an error ends with one sentence: printed here under torchrun, handed to the launcher
when bimetal's own launcher started it (which then speaks once for the job, see ``bimetal.supervisor``); the
rank's process groups are freed before the interpreter shuts down (``bimetal.entry.run_command``).
"""

import sys

from bimetal.entry import run_command
from bimetal.train.cli import main

sys.exit(run_command("train", main, sys.argv[1:]))
