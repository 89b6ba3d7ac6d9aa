"""``python -m bimetal.train`` / ``torchrun -m bimetal.train``: the rank entry point of ``bimetal train``."""

import sys

from bimetal.errors import JobAborted, UserError
from bimetal.train.cli import main

try:
    sys.exit(main(sys.argv[1:]))
except UserError as e:
    print(f"bimetal train: {e}", file=sys.stderr)
    sys.exit(2)
except JobAborted as e:
    print(f"bimetal train: {e}", file=sys.stderr)
    sys.exit(1)
