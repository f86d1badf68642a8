set -uo pipefail; source .dev/n10/env.sh
tree next21; step tests21 270 python3 -m pytest -q -x -m gpu -rA -p no:cacheprovider --durations=0 tests/test_drafter_gpu.py
tail -c 6000 $OUT/tests21.log > $OUT/tests21_tail.txt
step recompiles 300 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager,compiled --json $OUT/recompiles.json
grep -h "passed\|failed" $OUT/tests21.log; grep -E "^ +(mode|eager|compiled) " $OUT/recompiles.log
