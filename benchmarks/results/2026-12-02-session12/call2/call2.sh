# Session 12 call 2: the GPU tests (flex main kernel forced, tuned backward tiles); the peer, compiled and eager
# in one process (profiled after timing); compiled with CUDA graphs (reduce-overhead) in a process of its own
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step gputests 130 python3 -m pytest -x -q -m gpu -rA --tb=short -p no:cacheprovider -p no:logging --durations=10 tests/test_drafter_gpu.py
step drafter 290 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --profile /tmp/prof --json $OUT/drafter.json --peer "$PEER"
cp /tmp/prof/*_profile.txt $OUT/ 2>/dev/null
step graphs 130 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled \
  --compile-mode reduce-overhead --json $OUT/graphs.json
grep -v "^DEBUG\|^  \|^$" $OUT/gputests.log | tail -12; grep -h "peer:\|tokens/s\|warm-up step 5\|Error" $OUT/drafter.log $OUT/graphs.log
