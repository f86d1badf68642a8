# Session 10 call C: the GPU tests with the unbacked norm rows, the 200-step recompilation audit of both eager modes, then the peer, eager and compiled beside each other
set -uo pipefail; source .dev/n10/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer $ROOT/.peerwhl/*.whl
tree next21; step tests21 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider --durations=0 tests/test_drafter_gpu.py
tail -c 8000 $OUT/tests21.log > $OUT/tests21_tail.txt; grep -h "passed\|failed" $OUT/tests21.log
step recompiles 170 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager,eager-layers --json $OUT/recompiles.json
grep -E "^ +(mode|eager|eager-layers|compiled) |recompiled" $OUT/recompiles.log
step drafter 290 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager,compiled --json $OUT/drafter.json \
  --peer "env PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b python3 $ROOT/.dev/speculators_dflash_step.py"
grep -h "peer\|warm-up\|tokens/s" $OUT/drafter.log
step diag 40 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_diag_gpu.py -k "fla_eager_step"
grep -h "passed\|failed\|NoValidChoices" $OUT/diag.log | head -3
