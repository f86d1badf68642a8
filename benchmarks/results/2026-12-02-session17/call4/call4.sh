# Session 17 call 4 (on call 3's machine, Triton and Inductor caches in new empty folders): the issue's
# command beside the peer, with the interval mask function.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 330 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5\|Error" $OUT/drafter.log
