set -uo pipefail
source .dev/setup.sh 1
export TRITON_CACHE_DIR=/tmp/tc1 TORCHINDUCTOR_CACHE_DIR=/tmp/ic1
s=$SECONDS
timeout 210 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_autotune.py tests/test_drafter_gpu.py tests/test_fused.py tests/test_packing.py tests/test_stream.py tests/test_target_runner.py tests/test_faults_extract.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $? $((SECONDS-s)) s"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -25
s=$SECONDS
timeout 230 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager,eager-unfused,compiled --json $OUT/drafter.json > $OUT/drafter.log 2>&1; echo "drafter rc $? $((SECONDS-s)) s"
s=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer ../../.peerwhl/*.whl
PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b T=16384 MAX_ANCHORS=512 timeout 140 python3 ../speculators_dflash_step.py > $OUT/peer.log 2>&1; echo "peer rc $? $((SECONDS-s)) s"
tail -12 $OUT/drafter.log; tail -2 $OUT/peer.log
