# Session 10 call A: the branch's GPU drafter tests, then the peer and our eager, eager-layers and compiled steps in one process, each profiled
set -uo pipefail; source .dev/n10/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer $ROOT/.peerwhl/*.whl
tree next21; step tests21 140 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_drafter_gpu.py
step drafter_all 430 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager,eager-layers,compiled --profile /tmp/prof --json $OUT/drafter_all.json \
  --peer "env PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b python3 $ROOT/.dev/speculators_dflash_step.py"
cp /tmp/prof/*_profile.txt $OUT/ 2>/dev/null; gzip -c /tmp/prof/drafter_compiled_trace.json > $OUT/drafter_compiled_trace.json.gz 2>/dev/null
gzip -c /tmp/prof/drafter_eager_trace.json > $OUT/drafter_eager_trace.json.gz 2>/dev/null
grep -h "passed\|failed" $OUT/tests21.log; grep -h "peer\|warm-up\|tokens/s" $OUT/drafter_all.log
