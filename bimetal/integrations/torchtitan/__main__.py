"""``python -m bimetal.integrations.torchtitan``: one rank of a torchtitan job on bimetal (see ``cli``)."""

import sys

from bimetal.integrations.torchtitan.cli import rank_main

sys.exit(rank_main())
