# Session 11 call A: the peer, then plain, eager (regions) and compiled in one process, profiled; then the GPU drafter tests
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step drafter 400 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes plain,eager,compiled \
  --profile /tmp/prof --json $OUT/drafter.json --peer "$PEER"
cp /tmp/prof/*_profile.txt $OUT/ 2>/dev/null
step gputests 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_drafter_gpu.py
grep -h "peer\|tokens/s" $OUT/drafter.log; tail -5 $OUT/gputests.log
