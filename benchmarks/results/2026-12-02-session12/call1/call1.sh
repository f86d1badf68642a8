# Session 12 call 1: the GPU tests; flex-attention per tile size and kernel options on the 27B shapes
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step gputests 270 python3 -m pytest -x -q -m gpu -rA --tb=short -p no:cacheprovider --durations=10 tests/test_drafter_gpu.py
step flex 230 python3 benchmarks/flex_configs.py --tiles 128,64 --options '{}' --autotune --iters 10
tail -15 $OUT/gputests.log; grep "^tile" $OUT/flex.log; grep -i "autotune\|BLOCK_M" $OUT/flex.log | head -40
