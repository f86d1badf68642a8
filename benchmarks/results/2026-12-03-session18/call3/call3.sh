# Session 18 call 3: after the loop's changes (the clipping factor stays on the device; the next batch's
# anchors are drawn right after the statistics are read), train against the step alone as in call 1; the
# GPU test of the loop's waits.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
step gputest 150 python3 -m pytest -q -m gpu tests/test_train.py -k gpu_step
tail -3 $OUT/gputest.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step loop 300 python3 benchmarks/train_command.py --command "python3 -m dflash_cache_cli.main" --work /tmp/tc \
  --modes eager --steps 20 --json $OUT/loop.json
cp /tmp/tc/eager.log $OUT/ 2>/dev/null; grep -h "eager:\|rror" $OUT/loop.log | cut -c1-500
