"""``python -m bimetal.integrations.megatron``: one rank of a Megatron script on bimetal (see ``cli``)."""

import sys

from bimetal.integrations.megatron.cli import rank_main

sys.exit(rank_main())
