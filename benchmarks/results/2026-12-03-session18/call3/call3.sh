# Session 18 call 3: after the loop's changes (the clipping factor stays on the device; the next batch's
# anchors are drawn after the statistics are read), train against the step alone as in call 1; the GPU test
# of the loop's waits; eager and compiled at a fixed --anchors-per-batch.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
step gputest 150 python3 -m pytest -q -m gpu tests/test_train.py -k gpu_step
tail -3 $OUT/gputest.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
CMD="python3 benchmarks/train_command.py --command 'python3 -m dflash_cache_cli.main' --work /tmp/tc"
step loop 240 bash -c "$CMD --modes eager --steps 20 --json $OUT/loop.json"
grep -h "eager:" $OUT/loop.log | cut -c1-500
step fixed 230 bash -c "$CMD --modes compiled,eager --steps 15 --anchors-per-batch 320 --no-step --json $OUT/fixed.json"
cp /tmp/tc/*.log $OUT/ 2>/dev/null; grep -h "compiled:\|eager:" $OUT/fixed.log | cut -c1-400; grep -h "padding" /tmp/tc/compiled.log
