"""Old name of the striping experiment, which moved to ``bimetal.bench.stripes`` with the other benchmarks
(``lab/`` is the emulated cluster only); running it says where it went."""

import sys

if __name__ == "__main__":
    print("bimetal: the striping experiment moved; run python -m bimetal.bench.stripes with the same options",
          file=sys.stderr)
    sys.exit(2)
