# Session 15 call 2 (new machine or call 1's with caches pointed at empty folders): the peer, compiled and
# eager in one process with packed attention and train's compiled AdamW, profiled after the timed steps;
# then the GPU tests.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 330 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER" --profile /tmp/prof
cp /tmp/prof/*_profile.txt $OUT/ 2>/dev/null
grep -h "peer:\|tokens/s\|warm-up step 5\|GPU idle\|Error" $OUT/drafter.log
step gputests 230 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -p no:cacheprovider
tail -15 $OUT/gputests.log
