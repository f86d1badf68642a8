# Session 10 call D: the 200-step audit of the eager step with the non-strict regions, the GPU tests, then the peer and eager beside each other
set -uo pipefail; source .dev/n10/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer $ROOT/.peerwhl/*.whl
tree next21
step recompiles 100 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --json $OUT/recompiles.json
grep -E "^ +(mode|eager) |recompiled" $OUT/recompiles.log
step tests21 110 python3 -m pytest -q -m gpu -rA -p no:cacheprovider --durations=0 tests/test_drafter_gpu.py
tail -c 8000 $OUT/tests21.log > $OUT/tests21_tail.txt; grep -h "passed\|failed" $OUT/tests21.log
step drafter 230 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager --json $OUT/drafter.json \
  --peer "env PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b python3 $ROOT/.dev/speculators_dflash_step.py"
grep -h "peer\|warm-up\|tokens/s" $OUT/drafter.log
