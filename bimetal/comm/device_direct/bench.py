"""Old name of the device-direct engine benchmark, which moved to ``bimetal.bench`` with the other benchmarks;
running it says where it went."""

import sys

if __name__ == "__main__":
    print("bimetal: the engine benchmark moved; run bimetal bench engine with the same options", file=sys.stderr)
    sys.exit(2)
