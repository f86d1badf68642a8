"""The `dflash-cache` command line."""

import os

# Before torch loads its OpenMP runtime, which reads this once: idle OpenMP threads spin by default,
# and on a CPU that another busy process shares, training then ran several times slower (BENCHMARKS.md,
# "Every default, on the CPU"). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
